"""Prune on every family of stages/families.py: unstructured zeros in every layer Linear, MLP channels removed
from gate/up rows (both halves of Phi-3's fused gate_up_proj) and down columns, whole layers dropped (Gemma 3's
layer types with them); each result loads back in transformers."""
import warnings

import pytest
import torch

from llmopt.stages.calib import CalibConfig
from llmopt.stages.errors import ConfigError
from llmopt.stages.families import family_of
from llmopt.stages.prune.config import PruneConfig
from llmopt.stages.prune.methods import same_input
from llmopt.stages.prune.run import run_prune
from llmopt.stages.prune.stage import check_plan
from llmopt.stages.prune.structured import shrink_mlp
from tests.stages.quantize.family_models import FAMILY_NAMES, make_family_model, write_family_dirs

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 200, 17, 4]])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{family: (directory, model)}: each family's tiny model saved once for the module."""
    return write_family_dirs(tmp_path_factory.mktemp("families"), seed=4)


def _config(calib_text, **kw):
    return PruneConfig(calib=CalibConfig(str(calib_text), nsamples=4, seqlen=32), eval_windows=0, batch_size=2, **kw)


def _transformers(path):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_shrunk_mlp_equals_the_full_one_without_those_channels(name):
    model = make_family_model(name, seed=5)
    family = family_of(model.config.to_dict())
    mlp, masked = model.model.layers[0].mlp, make_family_model(name, seed=5).model.layers[0].mlp
    keep = torch.tensor([0, 2, 3, 7, 8, 11, 20, 23, 64, 100, 127])
    dropped = torch.ones(128, dtype=torch.bool)
    dropped[keep] = False
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        masked.down_proj.weight[:, dropped] = 0
        shrink_mlp(mlp, keep, family)
        assert mlp.down_proj.weight.shape == (64, 11)
        assert all(mlp.get_submodule(n.removeprefix("mlp.")).weight.shape[0] == 11 * (2 if family.fused_source else 1)
                   for n in family.projections["gate_up"])
        assert torch.allclose(mlp(x), masked(x), atol=1e-5)


def test_linears_reading_one_input_are_observed_once():
    llama, phi3 = (family_of({"model_type": t}) for t in ("llama", "phi3"))
    assert same_input(llama) == {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
                                 "mlp.up_proj": "mlp.gate_proj"}
    assert same_input(phi3) == {} and same_input(None) == {}


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_unstructured_prunes_every_layer_linear(sources, calib_text, tmp_path, name, method):
    path, model = sources[name]
    art = run_prune(str(path), tmp_path / "p", _config(calib_text, method=method, sparsity=0.5))
    family = family_of(model.config.to_dict())
    linears = art.manifest["metrics"]["sparsity"]["linears"]
    assert set(linears) == {f"model.layers.{i}.{n}" for i in range(2) for n in family.layer_linears()}
    assert all(abs(s - 0.5) < 0.02 for s in linears.values())
    pruned = _transformers(art.path)
    for full in linears:
        w = pruned.get_submodule(full).weight
        assert abs(float((w == 0).float().mean()) - 0.5) < 0.02
    for norm in family.norms.values():  # untouched
        mine, source = (m.model.layers[1].get_submodule(norm).weight for m in (pruned, model))
        assert torch.equal(mine, source)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_structured_mlp_writes_a_smaller_model_of_the_same_family(sources, calib_text, tmp_path, name):
    path, model = sources[name]
    art = run_prune(str(path), tmp_path / "p", _config(calib_text, structured="mlp", ratio=0.25))
    m = art.manifest["metrics"]
    assert m["structured"]["intermediate_size"] == 96
    assert m["num_parameters_before"] - m["num_parameters"] == 2 * 3 * 64 * 32  # gate, up and down of 32 channels
    pruned = _transformers(art.path)
    assert type(pruned) is type(model) and pruned.config.intermediate_size == 96
    ref, out = _logits(model), _logits(pruned)
    assert 0 < ((out - ref).norm() / ref.norm()).item() < 1.0


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_dropping_a_layer_keeps_the_others_and_their_kinds(sources, calib_text, tmp_path, name):
    path, model = sources[name]
    art = run_prune(str(path), tmp_path / "p", _config(calib_text, structured="layers", drop=1))
    dropped = art.manifest["metrics"]["structured"]["dropped_layers"]
    kept = 1 - dropped[0]
    pruned = _transformers(art.path)
    assert pruned.config.num_hidden_layers == 1 and len(pruned.model.layers) == 1
    if getattr(model.config, "layer_types", None):
        assert pruned.config.layer_types == [model.config.layer_types[kept]]
    for key, value in model.model.layers[kept].state_dict().items():
        assert torch.equal(pruned.model.layers[0].state_dict()[key], value)
    _logits(pruned)  # runs


def test_structured_mlp_refuses_an_architecture_it_cannot_describe(sources, calib_text):
    from llmopt.stages.source import load

    loaded = load(str(sources["llama"][0]))
    loaded.model.config.architectures = ["OtherForCausalLM"]
    loaded.model.config.model_type = "other"
    with pytest.raises(ConfigError, match="does not describe OtherForCausalLM's MLP; prune it unstructured"):
        check_plan(loaded.model, _config(calib_text, structured="mlp", ratio=0.25))
    check_plan(loaded.model, _config(calib_text, method="wanda"))  # unstructured: any Linear
