"""`llmopt export`: the table, the one-line refusal (exit 2, no file), --allow-requantize's list, --json."""
import json

import pytest

from llmopt.cli.main import main


@pytest.fixture(scope="module")
def w4_auto(tiny_hf, tmp_path_factory):
    """RTN W4A16 with groups auto: 32 for most Linears, 64 for down_proj (input 64), bf16 scales."""
    out = tmp_path_factory.mktemp("export-cli") / "w4"
    assert main(["quantize", str(tiny_hf[0]), "-o", str(out), "--method", "rtn", "--dtype", "bf16",
                 "--eval-windows", "0", "--embeddings", "keep", "--json"]) == 0
    return out


def test_a_tensor_without_an_exact_type_is_one_line_exit_2_and_no_file(w4_auto, tmp_path, capsys):
    capsys.readouterr()
    assert main(["export", str(w4_auto), "--format", "gguf", "-o", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: export: model.layers.0.mlp.down_proj (blk.0.ffn_down.weight): int4 group 64")
    assert len(err.splitlines()) == 1 and "--allow-requantize" in err
    assert list(tmp_path.iterdir()) == []


def test_allow_requantize_lists_every_re_quantized_tensor(w4_auto, tmp_path, capsys):
    capsys.readouterr()
    assert main(["export", str(w4_auto), "-o", str(tmp_path / "m.gguf"), "--allow-requantize", "q8_0"]) == 0
    shown = capsys.readouterr().out
    assert "exported -> " in shown and "re-quantized (2 tensors, not bit-exact)" in shown
    assert "12 Q4_0" in shown and "2 Q8_0" in shown
    for i in range(2):
        assert f"model.layers.{i}.mlp.down_proj.weight" in shown


def test_json_and_bad_options(w4_auto, tmp_path, capsys):
    capsys.readouterr()
    assert main(["export", str(w4_auto), "-o", str(tmp_path / "m.gguf"), "--allow-requantize", "q4_0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["file_type"] == "MOSTLY_Q4_0" and report["counts"]["requantized"] == {"Q4_0": 2}
    assert [t["gguf_name"] for t in report["requantized"]] == ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]
    assert report["lineage"] == ["quantize"] and report["tokenizer"]["pre"] == "gpt2"
    for argv, expect in ((["--allow-requantize", "q3_k"], "--allow-requantize: expected one of q8_0"),
                         (["--format", "onnx"], "--format: expected one of gguf")):
        assert main(["export", str(w4_auto), "-o", str(tmp_path / "x.gguf"), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expect in err


def test_the_command_s_options_are_the_stage_s_with_its_defaults():
    import inspect

    from llmopt.cli import export_cmd
    from llmopt.stages.export.config import OPTIONS, ExportConfig

    params = inspect.signature(export_cmd.run).parameters
    assert set(params) - {"source", "output", "force", "json"} == set(OPTIONS)
    assert all(params[name].default == OPTIONS[name].default for name in OPTIONS)
    assert ExportConfig.from_options({}) == ExportConfig()
