"""`llmopt profile --synthetic SHAPE` beyond the engine run, on CPU with the tiny shape: --quantize (the
quantize stage's RTN, bit for bit, and the quantized modules in the engine), --kernel-speed, --check-greedy
and its near-tie rule, --save-model; and the ways to ask for them wrongly."""
import json
import warnings

import pytest
import torch

from llmopt.cli.main import main
from llmopt.kernels import W4A16Linear, W8A16Linear
from llmopt.stages.compressed import parse_schemes
from llmopt.stages.profile.config import TASK_PRESETS, ProfileConfig
from llmopt.stages.profile.greedy import compare, first_difference
from llmopt.stages.profile.synthetic import model_config, random_tensors
from llmopt.stages.serve.loader import build_runtime
from llmopt.stages.synthetic_model import quantize_state, write_synthetic_model


def _run(argv, tmp_path) -> tuple[int, dict]:
    path = tmp_path / "report.json"
    code = main(["profile", "--synthetic", "tiny", *argv, "--threads", "1", "--json", str(path)])
    return code, json.loads(path.read_text())


@pytest.mark.parametrize("scheme, module", [("w4a16", W4A16Linear), ("w8a16", W8A16Linear)])
def test_quantize_state_compresses_every_decoder_linear_and_the_loader_builds_quantized_modules(scheme, module):
    config = model_config("tiny", 1)
    state, qconfig = quantize_state(random_tensors(config, torch.device("cpu"), torch.bfloat16), config, scheme)
    linears = [k.removesuffix(".weight_packed") for k in state if k.endswith(".weight_packed")]
    assert len(linears) == 7 and "lm_head.weight" in state and qconfig["ignore"] == ["lm_head"]
    schemes = parse_schemes(qconfig, linears + ["lm_head"])
    assert {(s.bits, s.group_size) for s in schemes.values()} == {(int(scheme[1]), 128)} and "lm_head" not in schemes
    runtime = build_runtime({**config, "quantization_config": qconfig}, state, torch.device("cpu"), torch.bfloat16,
                            "reference")
    layer = runtime.layers[0]
    assert all(isinstance(getattr(layer, name), module) for name in ("qkv", "o_proj", "gate_up", "down"))


def test_quantize_state_equals_llmopt_quantize_rtn_on_the_saved_model(tmp_path):
    """The synthetic engine's W4A16 layers are what `llmopt quantize --method rtn` writes for the same weights."""
    from safetensors.torch import load_file

    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    art = write_synthetic_model(tmp_path / "base", "tiny", layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = run_quantize(str(art.path), tmp_path / "w4", QuantizeConfig(method="rtn", eval_windows=0))
    written = {k: v for f in quantized.weight_files for k, v in load_file(quantized.path / f).items()}
    base = load_file(art.path / "model.safetensors")
    config = json.loads((art.path / "config.json").read_text())
    ours, qconfig = quantize_state(base.items(), config, "w4a16")
    assert set(ours) == set(written)
    for key, tensor in ours.items():
        assert torch.equal(tensor, written[key]), key
    assert qconfig["config_groups"] == json.loads((quantized.path / "config.json").read_text())[
        "quantization_config"]["config_groups"]


def test_the_engine_runs_quantized_layers_and_reads_fewer_bytes(tmp_path):
    small = ["--layers", "1", "--batch-sizes", "1,2", "--decode-context", "16", "--decode-steps", "5"]
    code, dense = _run(small, tmp_path)
    assert code == 0 and dense["quantize"] is None
    code, w4 = _run([*small, "--quantize", "w4a16"], tmp_path)
    assert code == 0 and w4["quantize"] == "w4a16" and [r["batch"] for r in w4["rows"]] == [1, 2]
    layer_bytes = 2 * (256 * (256 + 2 * 64) + 256 * 256 + 3 * 256 * 512)  # one bf16 layer's projections
    assert dense["weight_bytes"] - w4["weight_bytes"] > 0.7 * layer_bytes  # int4 codes + scales: about 27%


def test_kernel_speed_times_every_scheme_at_each_row_count(tmp_path, capsys):
    code, report = _run(["--kernel-speed", "--dtype", "fp32", "--batch-sizes", "1,3", "--decode-context", "40",
                         "--repeats", "1"], tmp_path)
    assert code == 0 and [(r["k"], r["n"], r["m"]) for r in report["matmuls"]] == [
        (256, 256, 1), (256, 256, 3), (256, 512, 1), (256, 512, 3)]
    for r in report["matmuls"]:
        assert r["bytes"]["w4a16"] == r["n"] * r["k"] // 2 + r["n"] * (r["k"] // 128) * 4  # codes + fp32 scales
        assert r["speedup"]["w8a16"] == pytest.approx(r["us"]["dense"] / r["us"]["w8a16"])
    attention = report["attention"]
    assert (attention["batch"], attention["context"], attention["kv_heads"]) == (32, 40, 2) and attention["us"] > 0
    assert "Paged decode attention" in " ".join(capsys.readouterr().out.split())


def test_greedy_check_on_the_same_path_is_exact(tmp_path):
    code, report = _run(["--check-greedy", "--dtype", "fp32", "--decode-steps", "6"], tmp_path)
    assert code == 0 and report["passed"] and report["exact"] == 8 and report["margin"] == 1e-3
    assert [r["prompt_tokens"] for r in report["rows"]] == [8, 13, 18, 23, 28, 33, 38, 43]


@pytest.mark.parametrize("tokens, top2, ok", [
    ([5, 6, 7], [(-1.0, -2.0)] * 3, True),  # equal throughout
    ([5, 9, 9], [(-1.0, -2.0), (-1.0, -1.0005), (-1.0, -3.0)], True),  # differs where the best two tie
    ([5, 9, 7], [(-1.0, -2.0), (-1.0, -1.5), (-1.0, -3.0)], False),  # differs where the reference was sure
    ([5, 6], [(-1.0, -2.0)] * 3, False),  # stopped early
])
def test_the_near_tie_rule(tokens, top2, ok):
    assert compare(tokens, [5, 6, 7], top2, margin=1e-3)["ok"] is ok


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_save_model_writes_an_artifact_with_a_chat_tokenizer(tmp_path):
    from llmopt.stages.artifact import Artifact
    from llmopt.stages.model_io import load_tokenizer

    code, report = _run(["--layers", "1", "--save-model", str(tmp_path / "m")], tmp_path)
    art = Artifact.open(report["path"])
    assert code == 0 and art.stage == "synthetic" and art.manifest["model"]["num_hidden_layers"] == 1
    tok = load_tokenizer(art.path)
    assert len(tok) == art.manifest["model"]["vocab_size"] == json.loads((art.path / "config.json").read_text())[
        "vocab_size"]
    text = tok.apply_chat_template([{"role": "user", "content": "héllo, wörld ✓"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nhéllo, wörld ✓<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("héllo, wörld ✓")) == "héllo, wörld ✓"  # byte-level: any text round-trips


def test_task_presets():
    config = ProfileConfig.from_options({"synthetic": "tiny", "kernel_speed": True})
    assert config.task == "kernel_speed" and config.batch_sizes == TASK_PRESETS["kernel_speed"]["batch_sizes"]
    assert config.dtype == "fp16" and ProfileConfig.from_options({"synthetic": "tiny"}).task == "engine"
    assert ProfileConfig.from_options({"synthetic": "tiny", "check_greedy": True}).decode_steps == 32


@pytest.mark.parametrize("argv, expect", [
    (["profile", "--kernel-speed"], "--kernel-speed works on a synthetic model"),
    (["profile", "--synthetic", "tiny", "--kernel-speed", "--check-greedy"], "give one of them"),
    (["profile", "--synthetic", "tiny", "--check-greedy", "--quantize", "w4a16"], "engine run"),
    (["profile", "--synthetic", "tiny", "--quantize", "w3a16"], "w3a16"),
])
def test_task_misuse_is_one_line(argv, expect, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
