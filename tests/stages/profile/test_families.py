"""Profile's cost model on every family of stages/families.py, against transformers' own models: the bytes a
step reads per layer (Gemma 3's four norms and q/k norms, Phi-3's fused projections, Qwen2's biases), the
parameters, the matmul FLOPs, the matmul shapes of a step and the synthetic model's tensors."""
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmopt.stages.families import family_of
from llmopt.stages.profile.costs import attention_flops, parameter_count, prefill_flops, weight_bytes
from llmopt.stages.profile.matmuls import step_shapes
from llmopt.stages.profile.synthetic import random_tensors
from llmopt.stages.serve.loader import load_runtime
from llmopt.stages.serve.model import spec_from_config
from tests.stages.quantize.family_models import FAMILY_NAMES, make_family_model, write_family_dirs


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{family: (directory, model)}; Gemma 3 with its tied embedding, the others untied."""
    return write_family_dirs(tmp_path_factory.mktemp("families"), seed=7, tied=("gemma3",))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_weight_bytes_are_the_models_tensors_but_the_embedding(sources, name):
    path, model = sources[name]
    runtime, _, _ = load_runtime(str(path), backend="reference")
    weights = weight_bytes(runtime)
    params = dict(model.named_parameters())  # a tied lm_head once, as the embedding
    tied = "lm_head.weight" not in params
    embed = 0 if tied else _bytes([params["model.embed_tokens.weight"]])  # untied: a lookup reads one row
    assert weights["total"] == _bytes(params.values()) - embed
    assert weights["norms"] == _bytes(p for n, p in params.items() if _is_norm(n))  # every norm of the family
    for i, layer_bytes in enumerate(weights["per_layer"]):
        linears = [p for n, p in params.items() if n.startswith(f"model.layers.{i}.") and not _is_norm(n)]
        assert layer_bytes == _bytes(linears)  # fused or not, biases included


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_parameter_count_is_the_models(sources, name):
    path, model = sources[name]
    spec = spec_from_config(model.config.to_dict())
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))  # not in config.json
    assert parameter_count(spec) == sum(p.numel() for p in model.parameters()) - biases


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_linear_flops_match_torchs_counter(sources, name):
    _, model = sources[name]
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, logits_to_keep=1, use_cache=False)
    matmuls = sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.addmm"))
    spec = spec_from_config(model.config.to_dict())
    assert prefill_flops(spec, 24) - attention_flops(spec, 24 * 25 // 2) == matmuls


def test_step_shapes_follow_the_checkpoints_linears():
    phi3 = spec_from_config(make_family_model("phi3").config.to_dict())
    assert step_shapes(phi3, 2) == {"q+k+v": (64, 128, 2), "o": (64, 64, 2), "gate+up": (64, 256, 2),
                                    "down": (128, 64, 2), "lm_head": (64, 300, 1)}
    gemma = spec_from_config(make_family_model("gemma3").config.to_dict())
    assert step_shapes(gemma, 2) == {"q/o": (64, 64, 4), "k/v": (64, 32, 4), "gate/up": (64, 128, 4),
                                     "down": (128, 64, 2), "lm_head": (64, 300, 1)}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_synthetic_tensors_are_the_familys_checkpoint(name):
    model = make_family_model(name)
    config = {**model.config.to_dict(), "head_dim": 16}
    tensors = dict(random_tensors(config, torch.device("cpu"), torch.float32))
    hf = {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith(".bias")}  # Qwen2's: none drawn
    assert {n: tuple(t.shape) for n, t in tensors.items()} == hf
    offset = family_of(config).norm_offset
    for n, t in tensors.items():
        if _is_norm(n):  # a unit scale as the family stores it: Gemma's (1 + w) with w = 0
            assert torch.all(t == 1 - offset), n


def test_the_sweep_runs_a_model_of_several_kv_layer_groups(sources):
    """`llmopt profile` on the tiny Gemma 3 (a local and a global layer: two KV layer groups): its synthetic steps
    bring every group's block tables, and a token's KV bytes count both groups."""
    from llmopt.stages.profile.costs import kv_bytes_per_token
    from llmopt.stages.profile.run import run_profile
    from tests.stages.profile.conftest import TINY

    path = sources["gemma3"][0]
    spec = spec_from_config(json.loads((path / "config.json").read_text()))
    assert spec.shape.kv.count == 2
    assert kv_bytes_per_token(spec, torch.float32) == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    report = run_profile([str(path)], TINY)
    assert report["sources"][0]["decode"] and report["sources"][0]["prefill"]
