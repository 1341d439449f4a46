"""Structured pruning: MLP channels and whole layers, written as smaller plain HF models."""
import warnings

import pytest
import torch

from llmopt.stages.calib import CalibConfig
from llmopt.stages.model_io import load_model_dir
from llmopt.stages.prune.config import PruneConfig
from llmopt.stages.prune.run import run_prune
from llmopt.stages.prune.structured import angular_distances, shrink_mlp

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 200, 17, 4]])


def _config(calib_text, **kw):
    return PruneConfig(calib=CalibConfig(str(calib_text), nsamples=4, seqlen=32), eval_windows=0, batch_size=2, **kw)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _transformers(path):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_shrunk_mlp_equals_the_full_one_without_those_channels():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4))
    x = torch.randn(3, 5, 16)
    keep = torch.tensor([0, 2, 3, 7, 8, 11, 20, 23])
    masked = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4))
    masked.load_state_dict(mlp.state_dict())
    dropped = torch.ones(24, dtype=torch.bool)
    dropped[keep] = False
    with torch.no_grad():
        masked.down_proj.weight[:, dropped] = 0
        shrink_mlp(mlp, keep)
        assert mlp.gate_proj.weight.shape == (8, 16) and mlp.down_proj.weight.shape == (16, 8)
        assert torch.allclose(mlp(x), masked(x), atol=1e-6)


def test_structured_mlp_writes_a_smaller_hf_model(tiny_hf, tmp_path, calib_text):
    art = run_prune(str(tiny_hf[0]), tmp_path / "p", _config(calib_text, structured="mlp", ratio=0.25))
    m = art.manifest["metrics"]
    hidden, layers, removed = 32, 2, 16  # 25% of 64 channels
    assert m["num_parameters_before"] - m["num_parameters"] == layers * 3 * hidden * removed
    assert m["structured"]["intermediate_size"] == 48 and len(m["structured"]["layers"]) == 2
    theirs, ours = _transformers(art.path), load_model_dir(art.path)
    assert theirs.config.intermediate_size == 48
    assert theirs.model.layers[0].mlp.down_proj.weight.shape == (32, 48)
    assert torch.allclose(_logits(theirs), _logits(ours), atol=1e-5)
    # the least important quarter went: the output moves, but stays close to the source's
    ref = _logits(tiny_hf[1])
    assert 0 < ((_logits(ours) - ref).norm() / ref.norm()).item() < 0.5


def test_an_identity_layer_is_dropped_first(tiny4, tmp_path, calib_text):
    """Layer 2 with zero output projections adds nothing to the residual: angular distance 0."""
    from llmopt.stages.calib import calibration_windows
    from llmopt.stages.source import load

    loaded = load(str(tiny4[0]))
    layer = loaded.model.model.layers[2]
    layer.self_attn.o_proj.weight.data = torch.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight.data = torch.zeros_like(layer.mlp.down_proj.weight)
    windows = calibration_windows(loaded.tokenizer, CalibConfig(str(calib_text), nsamples=4, seqlen=32))
    distances = angular_distances(loaded.model, windows, batch_size=2)
    assert distances[2] == pytest.approx(0, abs=1e-3) and min(distances[:2] + distances[3:]) > 0.01
    loaded.model.save_pretrained(tmp_path / "src")
    loaded.tokenizer.save_pretrained(tmp_path / "src")
    art = run_prune(str(tmp_path / "src"), tmp_path / "p", _config(calib_text, structured="layers", drop=1))
    assert art.manifest["metrics"]["structured"]["dropped_layers"] == [2]
    # dropping a layer that did nothing changes nothing
    assert torch.allclose(_logits(load_model_dir(art.path)), _logits(loaded.model), atol=1e-5)


def test_structured_layers_updates_the_config_and_generates(tiny4, tmp_path, calib_text):
    art = run_prune(str(tiny4[0]), tmp_path / "p", _config(calib_text, structured="layers", drop=2))
    st = art.manifest["metrics"]["structured"]
    dropped = st["dropped_layers"]
    assert len(dropped) == 2 and st["num_hidden_layers"] == 2 and len(st["angular_distance"]) == 4
    assert sorted(st["angular_distance"])[:2] == sorted(st["angular_distance"][i] for i in dropped)
    theirs = _transformers(art.path)
    assert theirs.config.num_hidden_layers == 2 and len(theirs.model.layers) == 2
    # the same as the source with those layers skipped
    kept = [i for i in range(4) if i not in dropped]
    src = tiny4[1]
    full_layers = src.model.layers
    src.model.layers = torch.nn.ModuleList([full_layers[i] for i in kept])
    src.config.num_hidden_layers = 2
    try:
        expected = _logits(src)
    finally:
        src.model.layers, src.config.num_hidden_layers = full_layers, 4
    assert torch.allclose(_logits(theirs), expected, atol=1e-5)
    # the KV cache is indexed by the renumbered layers: cached decoding equals uncached
    ids = IDS[:, :4]
    with torch.no_grad():
        cached = theirs.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
        plain = theirs.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, plain)
