"""The prune stage end to end on tiny random Llamas: the written artifacts, bad input, the
pruned -> quantized pipeline, the CLI and inspect."""
import json

import pytest
import torch

from llmopt.stages.calib import CalibConfig
from llmopt.stages.errors import ConfigError
from llmopt.stages.prune.config import PruneConfig
from llmopt.stages.prune.run import run_prune
from llmopt.stages.safetensors_io import load_dir
from tests.helpers import few_stdlib_files


def _config(calib_text, **kw):
    base = dict(calib=CalibConfig(str(calib_text), nsamples=4, seqlen=32), eval_windows=0, batch_size=2)
    base.update(kw)
    return PruneConfig(**base)


def _pruned_weights(art) -> dict:
    """The decoder layers' Linear weights as written on disk."""
    state = load_dir(art.path, art.weight_files)
    return {k: v for k, v in state.items() if k.startswith("model.layers.") and k.endswith("proj.weight")}


@pytest.mark.parametrize("method, pattern", [("magnitude", "2:4"), ("wanda", "2:4"), ("sparsegpt", "2:4"),
                                             ("sparsegpt", "4:8"), ("wanda", "1:4")])
def test_nm_artifact_holds_exactly_n_in_every_group(tiny_hf, tmp_path, calib_text, method, pattern):
    n, m = map(int, pattern.split(":"))
    art = run_prune(str(tiny_hf[0]), tmp_path / "p", _config(calib_text, method=method, pattern=pattern))
    weights = _pruned_weights(art)
    assert len(weights) == 14  # 2 layers x 7 Linears
    for name, w in weights.items():
        nonzero = (w.reshape(w.shape[0], -1, m) != 0).sum(-1)  # [out, in/m]
        assert (nonzero == n).all(), name
    state = load_dir(art.path, art.weight_files)
    assert torch.equal(state["model.embed_tokens.weight"], tiny_hf[1].model.embed_tokens.weight)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("sparsity", [0.5, 0.3])
def test_unstructured_sparsity_equals_the_target_per_layer(tiny_hf, tmp_path, calib_text, method, sparsity):
    art = run_prune(str(tiny_hf[0]), tmp_path / "p", _config(calib_text, method=method, sparsity=sparsity))
    recorded = art.manifest["metrics"]["sparsity"]["linears"]
    for name, w in _pruned_weights(art).items():
        zeros = (w == 0).float().mean().item()
        assert abs(zeros - sparsity) <= 1 / w.shape[1], (name, zeros)  # floor(s * n) per row / block / matrix
        assert recorded[name[: -len(".weight")]] == pytest.approx(zeros)
    assert art.manifest["config"]["method"] == method
    assert ("calibration" in art.manifest["metrics"]) == (method != "magnitude")  # magnitude reads no data


def test_ignored_linears_stay_dense(tiny_hf, tmp_path, calib_text):
    art = run_prune(str(tiny_hf[0]), tmp_path / "p", _config(calib_text, method="wanda", ignore=("down_proj",)))
    weights = _pruned_weights(art)
    assert torch.equal(weights["model.layers.1.mlp.down_proj.weight"], tiny_hf[1].model.layers[1].mlp.down_proj.weight)
    assert (weights["model.layers.1.mlp.up_proj.weight"] == 0).float().mean() == 0.5


def test_calibration_flows_through_the_already_pruned_layers(tiny_hf, tmp_path, calib_text):
    """Layer 1's Wanda mask comes from inputs computed by the pruned layer 0: a whole-model
    reference (layer 0 replaced by what we wrote, hooks on layer 1) must choose the same weights."""
    from llmopt.stages.calib import calibration_windows
    from llmopt.stages.prune.masks import InputNorms, wanda_mask
    from llmopt.stages.source import load

    cfg = _config(calib_text, method="wanda")
    art = run_prune(str(tiny_hf[0]), tmp_path / "p", cfg)
    written = _pruned_weights(art)
    ref = load(str(tiny_hf[0]))
    for name, w in written.items():
        if name.startswith("model.layers.0."):
            ref.model.get_parameter(name).data = w
    target = ref.model.model.layers[1].mlp.gate_proj
    norms = InputNorms(target.in_features)
    handle = target.register_forward_pre_hook(lambda mod, args: norms.add(args[0]))
    with torch.no_grad():
        ref.model(input_ids=calibration_windows(ref.tokenizer, cfg.calib))
    handle.remove()
    expected = wanda_mask(target.weight.data, norms.norm, 0.5, None)
    assert torch.equal(written["model.layers.1.mlp.gate_proj.weight"] == 0, expected)


@pytest.mark.parametrize("kw, message", [
    (dict(method="wanda", pattern="3:5"), "5 does not divide the input size 32"),
    (dict(method="wanda", sparsity=1.0), r"\[0, 1\)"),
    (dict(method="magnitude", ignore=("no_such_layer",)), "matches no Linear"),
    (dict(structured="mlp", ratio=0.999), "removes all 64 MLP channels"),
    (dict(structured="mlp", ratio=0.001), "removes no channel"),
    (dict(structured="layers", drop=2), "the model has 2 layers"),
])
def test_bad_input_writes_nothing(tiny_hf, tmp_path, calib_text, kw, message):
    with pytest.raises(ConfigError, match=message):
        run_prune(str(tiny_hf[0]), tmp_path / "p", _config(calib_text, **kw))
    assert not (tmp_path / "p").exists()
    assert not any(tmp_path.iterdir())  # no temporary sibling either


def test_pruned_then_gptq_keeps_every_zero(tiny_hf, tmp_path, calib_text):
    from llmopt.stages.model_io import load_model_dir
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    pruned = run_prune(str(tiny_hf[0]), tmp_path / "p", _config(calib_text, method="sparsegpt", pattern="2:4"))
    quant = run_quantize(str(pruned.path), tmp_path / "q", QuantizeConfig(
        method="gptq", scheme="W4A16", group_size=16, calib=CalibConfig(str(calib_text), nsamples=4, seqlen=32),
        eval_windows=0, batch_size=2))
    assert [e["stage"] for e in quant.manifest["lineage"]] == ["prune", "quantize"]
    model = load_model_dir(quant.path)
    for name, w in _pruned_weights(pruned).items():
        q = model.get_parameter(name)
        assert (q[w == 0] == 0).all(), name
        assert ((q.reshape(q.shape[0], -1, 4) != 0).sum(-1) <= 2).all(), name  # still 2:4 at most


def test_perplexity_before_and_after_are_recorded(tiny_hf, tmp_path, calib_text, monkeypatch):
    few_stdlib_files(monkeypatch)  # the code set from a few files: this test is about the record
    art = run_prune(str(tiny_hf[0]), tmp_path / "p", _config(calib_text, method="magnitude", eval_windows=1))
    ba = art.manifest["metrics"]["perplexity_before_after"]
    assert ba["before"] > 1 and ba["after"] > 1 and "first 1 windows" in ba["protocol"]


def test_cli_prune_json_inspect_and_bad_input(tiny_hf, tmp_path, calib_text, capsys):
    from llmopt.cli.main import main

    argv = ["prune", str(tiny_hf[0]), "-o", str(tmp_path / "p"), "--method", "wanda", "--pattern", "2:4",
            "--calib", str(calib_text), "--nsamples", "4", "--seqlen", "32", "--eval-windows", "0", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["metrics"]["sparsity"]["overall"] == 0.5
    assert main(["inspect", str(tmp_path / "p")]) == 0
    shown = capsys.readouterr().out
    assert "sparsity: wanda 2:4" in shown and "down_proj" in shown and "50.0%" in shown
    assert main(["prune", str(tiny_hf[0]), "-o", str(tmp_path / "bad"), "--sparsity", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[0, 1)" in err
    assert not (tmp_path / "bad").exists()
