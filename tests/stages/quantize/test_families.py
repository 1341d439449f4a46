"""Quantize on every family of stages/families.py: the folds keep the float layer (Gemma's (1 + w) norms,
Phi-3's fused gate_up_proj), and RTN, GPTQ, AWQ and SmoothQuant write artifacts whose every layer Linear is
quantized and whose logits stay near the source's."""
import warnings

import pytest
import torch

from llmopt.stages.calib import CalibConfig
from llmopt.stages.errors import ConfigError
from llmopt.stages.families import family_of
from llmopt.stages.model_io import load_model_dir
from llmopt.stages.quantize.config import QuantizeConfig
from llmopt.stages.quantize.methods import AWQ, GPTQ, apply_fold, clip_rows, family_folds, layer_rows
from llmopt.stages.quantize.rtn import QuantArgs
from llmopt.stages.quantize.run import run_quantize
from tests.helpers import CORPUS, needs_avx512_fbgemm
from tests.stages.quantize.family_models import FAMILY_NAMES, make_family_model, write_family_dirs

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 200, 17, 4, 8, 12, 40, 41, 42, 43, 44, 45, 46, 47]])


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory):
    f = tmp_path_factory.mktemp("calib") / "calib.txt"
    f.write_text("\n".join(CORPUS * 10) + "\n")
    return f


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{family: (directory, model)}: each family's tiny model saved once for the module."""
    return write_family_dirs(tmp_path_factory.mktemp("families"), seed=1)


def _config(calib_text, **kw):
    return QuantizeConfig(calib=CalibConfig(str(calib_text), nsamples=4, seqlen=32), eval_windows=0, batch_size=2,
                          **kw)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _layer_output(model, layer, x):
    """Decoder layer 0's output on x [1, S, H] at positions 0..S-1 (no mask: the same attention either way)."""
    import inspect

    positions = torch.arange(x.shape[1]).unsqueeze(0)
    rotary = model.model.rotary_emb
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters  # Gemma 3: one RoPE per layer type
    cos_sin = rotary(x, positions, model.config.layer_types[0]) if per_type else rotary(x, positions)
    with torch.no_grad():
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_fold_keeps_the_float_layer(name):
    """A random scale folded at each of the family's shared inputs leaves the layer's output unchanged:
    into a norm (Gemma: its (1 + w)), or into the up rows that feed down_proj (Phi-3: half of gate_up_proj)."""
    model = make_family_model(name, seed=2).double()
    layer, family = model.model.layers[0], family_of(model.config.to_dict())
    x = torch.randn(1, 12, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    before = _layer_output(model, layer, x)
    folds = family_folds(family)
    assert [f.norm for f in folds[:2]] == [family.norms["input"], family.norms["mlp"]] and folds[2].section == "up"
    g = torch.Generator().manual_seed(1)
    for fold in folds:
        width = layer.get_submodule(fold.consumers[0]).in_features
        apply_fold(layer, family, fold, torch.rand(width, generator=g, dtype=torch.float64) * 4 + 0.1)
    after = _layer_output(model, layer, x)
    assert ((after - before).norm() / before.norm()).item() < 1e-5  # the folds compute in float32
    assert not torch.equal(layer.get_submodule(folds[0].consumers[0]).weight,
                           make_family_model(name, seed=2).double().model.layers[0].get_submodule(
                               folds[0].consumers[0]).weight)  # the weights did change


def test_fused_sections_and_the_rows_awq_clips():
    phi3, gemma = (family_of({"model_type": t}) for t in ("phi3", "gemma3_text"))
    model = make_family_model("phi3")
    rows = layer_rows(phi3, model.model.layers[0])
    assert rows["k"] == ("self_attn.qkv_proj", 64, 96) and rows["up"] == ("mlp.gate_up_proj", 128, 256)
    assert clip_rows(rows) == {"self_attn.qkv_proj": [(96, 128)], "self_attn.o_proj": [(0, 64)],
                               "mlp.gate_up_proj": [(0, 256)], "mlp.down_proj": [(0, 64)]}  # v rows, not q/k
    rows = layer_rows(gemma, make_family_model("gemma3").model.layers[0])
    assert set(clip_rows(rows)) == {"self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                    "mlp.down_proj"}


def test_gptq_shares_hessians_as_the_family_reads_inputs():
    model = make_family_model("phi3")
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    method = GPTQ({0: {n: QuantArgs(4, 16, True) for n in names}}, damp=0.01, act_order=False, sink_share=0.0,
                  observer="minmax")
    assert set(method.observers(0, model.model.layers[0])) == {"", *names}  # one Linear per input: four
    assert method.family.name == "phi3"


def test_awq_refuses_a_layer_it_cannot_describe():
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="cannot be folded; use --method gptq or rtn"):
        AWQ({0: {}}, sink_share=0.0).observers(0, layer)


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("kw", [dict(method="rtn", group_size=16), dict(method="gptq", group_size=16),
                                dict(method="awq", group_size=16),
                                pytest.param(dict(method="smoothquant", scheme="W8A8"), marks=needs_avx512_fbgemm)],
                         ids=lambda kw: kw["method"])
def test_every_method_quantizes_every_layer_linear(sources, calib_text, tmp_path, name, kw):
    path, model = sources[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = run_quantize(str(path), tmp_path / "q", _config(calib_text, **kw))
    family = family_of(model.config.to_dict())
    quantized = set(art.manifest["metrics"]["quantization"]["linears"])
    assert quantized == {f"model.layers.{i}.{n}" for i in range(2) for n in family.layer_linears()}
    layer = art.manifest["metrics"]["quantization"]["layers"][0]
    if kw["method"] in ("awq", "smoothquant"):  # a scale on each shared input: q/k/v, gate/up, down
        assert set(layer["scale_spread"]) == {f.consumers[0] for f in family_folds(family)}
    if kw["method"] == "awq":
        assert not {"self_attn.q_proj", "self_attn.k_proj"} & set(layer["clipped_share"])
        assert family.projections["o_proj"][0] in layer["clipped_share"]
    ref = _logits(model)
    err = ((_logits(load_model_dir(art.path)) - ref).norm() / ref.norm()).item()
    assert err < (0.15 if kw["method"] == "smoothquant" else 0.8)  # random N(0, 0.3) weights amplify errors


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_awq_w8_stays_as_close_as_rtn(sources, calib_text, tmp_path, name):
    """At 8 bits the quantization error is small, so a fold that changed the float model would show."""
    path, model = sources[name]
    ref, errs = _logits(model), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in ("rtn", "awq"):
            art = run_quantize(str(path), tmp_path / method,
                               _config(calib_text, method=method, scheme="W8A16", group_size=16))
            errs[method] = ((_logits(load_model_dir(art.path)) - ref).norm() / ref.norm()).item()
    assert errs["awq"] < 1.3 * errs["rtn"] + 1e-3, errs
