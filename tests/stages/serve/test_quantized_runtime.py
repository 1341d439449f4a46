"""Quantized artifacts written by our quantize stage, served by the runtime.

Reference: transformers with the artifact's dequantized weights (`(q - zero) * scale`, what the
quantizer evaluated). Two tolerances:
- `backend="reference"` runs the kernels' fp32 twins: exact dequantized matmuls, so 1e-4 as
  for dense models. W8A8 quantizes activations per token by design; its reference applies the
  same per-token int8 rounding to every Linear's input (then it is exact too).
- The CPU backends' fast paths ("cpu-native" and "cpu-torch" alike: torch's packed kernels beyond the
  native GEMV's rows) round activations (and scales) to bf16 for W4A16/W8A16, and fbgemm
  quantizes W8A8 activations its own way. Their tolerance is measured, not guessed: the error
  against the exact reference may be at most 3x the error that rounding every Linear's input and
  output to bf16 (or to per-token int8) causes in the reference itself. On these random models
  that emulated error is 1-5 % (they amplify perturbations), the fast paths measure 1-1.8x it.
"""
import warnings

import pytest
import torch

from llmopt.kernels import W4A16Linear, W8A8Linear, W8A16Linear, cpu_native, cpu_prefill
from llmopt.kernels.cpu_linear import DenseLinear
from llmopt.kernels.op_backends import TorchLinear
from llmopt.stages.model_io import load_model_dir
from llmopt.stages.quantize.config import QuantizeConfig
from llmopt.stages.quantize.run import run_quantize
from llmopt.stages.serve.loader import load_runtime
from llmopt.stages.serve.model import ConcatLinear
from llmopt.stages.serve.runner import ModelRunner
from tests.helpers import needs_avx512_fbgemm, write_hf_dir
from tests.kernels.helpers import kernel_names
from tests.stages.serve.runner_steps import Sequences, hf_last_logits

SCHEMES = {"w4-sym": dict(scheme="W4A16", group_size=32), "w4-asym": dict(scheme="W4A16", group_size=32,
                                                                              symmetric=False),
           "w4-auto": dict(scheme="W4A16"), "w8-group": dict(scheme="W8A16", group_size=32),
           "w8-channel": dict(scheme="W8A16", group_size=-1), "w8a8": dict(scheme="W8A8"),
           "w4-ignore-k": dict(scheme="W4A16", group_size=32, ignore=("re:.*k_proj$",)),
           "w4-emb8": dict(scheme="W4A16", group_size=32, embeddings="int8")}
BASES = {"untied": dict(hidden=64, tie=False),  # the base model with its own lm_head
         "h192": dict(hidden=192)}  # embedding groups of 64 < hidden (as SmolLM2's 576)
TOKENS = torch.randint(1, 300, (24,), generator=torch.Generator().manual_seed(0)).tolist()
NATIVE = cpu_native.gemv_available()
needs_gemv = pytest.mark.skipif(not NATIVE, reason="native GEMV needs a C compiler and an AVX-512 CPU")
CPU_BACKENDS = [pytest.param("cpu-native", marks=needs_gemv), "cpu-torch"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    write_hf_dir(root / "base", hidden=64)
    made = {}

    def get(name, base="base"):
        if (name, base) not in made:
            if not (root / base).exists():
                write_hf_dir(root / base, **BASES[base])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = QuantizeConfig(method="rtn", eval_windows=0, **SCHEMES[name])
                made[name, base] = run_quantize(str(root / base), root / f"{name}-{base}", cfg).path
        return made[name, base]

    return get


def _round_inputs(model, how: str):
    """Forward hooks that round every Linear's input (and, for bf16, output) as the fast path does."""
    def pre(module, args):
        x = args[0]
        if how == "bf16":
            return (x.to(torch.bfloat16).float(),)
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        y = x / scale
        return (torch.sign(y) * torch.floor(y.abs() + 0.5) * scale,)

    def post(module, args, out):
        return out.to(torch.bfloat16).float() if how == "bf16" else out

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)
    return model


def _dequantized_hf(path):
    """transformers model with dense `(q - zero) * scale` weights everywhere (W8A8 Linears too)."""
    model = load_model_dir(path)
    for name, module in list(model.named_modules()):
        if isinstance(module, W8A8Linear):
            dense = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            dense.weight.data = module.weight.float() * module.weight_scale.float().reshape(-1, 1)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, dense)
    return model


def _run(path, backend):
    """Logits of a prefill of 16 tokens, then 4 decode steps, over blocks of 4."""
    runtime, _, _ = load_runtime(str(path), backend=backend)
    runner, seqs = ModelRunner(runtime, 32, 4), Sequences(32, 4)
    a = seqs.add(TOKENS)
    return [(runner.execute(seqs.step([(a, n)]))[0], TOKENS[:seqs.cached[a]]) for n in (16, 1, 1, 1, 1)]


@pytest.mark.parametrize("name", ["w4-sym", "w4-asym", "w8-group", "w8-channel", "w4-ignore-k", "w4-emb8"])
def test_reference_path_matches_dequantized_weights(artifacts, name):
    model = _dequantized_hf(artifacts(name))
    for out, tokens in _run(artifacts(name), "reference"):
        torch.testing.assert_close(out, hf_last_logits(model, tokens), atol=1e-4, rtol=1e-4)


def test_w8a8_reference_path_matches_per_token_int8_activations(artifacts):
    model = _round_inputs(_dequantized_hf(artifacts("w8a8")), "int8")
    for out, tokens in _run(artifacts("w8a8"), "reference"):
        torch.testing.assert_close(out, hf_last_logits(model, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["w4-sym", "w4-asym", "w8-channel", "w8-group",
                                  pytest.param("w8a8", marks=needs_avx512_fbgemm), "w4-emb8"])
def test_cpu_fast_paths_stay_within_their_rounding_error(artifacts, name, backend):
    exact = _dequantized_hf(artifacts(name))
    emulated = _round_inputs(_dequantized_hf(artifacts(name)), "int8" if name == "w8a8" else "bf16")
    for out, tokens in _run(artifacts(name), backend):
        ref = hf_last_logits(exact, tokens)
        budget = (hf_last_logits(emulated, tokens) - ref).norm()
        assert (out - ref).norm() <= 3 * budget + 1e-4 * ref.norm()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_quantized_linears_are_fused_with_recorded_group_sizes(artifacts, backend):
    runtime, _, _ = load_runtime(str(artifacts("w4-auto")), backend=backend)
    layer = runtime.layers[0]
    # hidden 64, intermediate 128: auto picks 64 for the hidden-input Linears and 128 for down_proj
    assert isinstance(layer.qkv, W4A16Linear) and layer.qkv.out_features == 64 + 2 * 32
    assert (layer.qkv.group_size, layer.gate_up.group_size, layer.down.group_size) == (64, 64, 128)
    assert layer.gate_up.out_features == 256
    # beyond the GEMV's rows: on AMX the native prefill kernel (no torch int4 layout made), else torch's
    amx = backend == "cpu-native" and cpu_prefill.amx_available()
    assert (layer.qkv.cpu_weight is None) == amx
    assert (layer.qkv.native is not None) == (backend == "cpu-native")
    assert isinstance(load_runtime(str(artifacts("w8-channel")), backend=backend)[0].layers[1].gate_up, W8A16Linear)
    # no torch CPU kernel for group-wise int8: on cpu-native the GEMV, then the prefill kernel (dequantized per
    # call into a scratch, `cpu_prefill`) beyond its rows; on cpu-torch dequantized once to a dense weight
    gate_up = load_runtime(str(artifacts("w8-group")), backend=backend)[0].layers[1].gate_up
    if backend == "cpu-native":
        assert isinstance(gate_up, W8A16Linear) and gate_up.native is not None
        assert (gate_up.dense is None) == cpu_prefill.prefill_available()
    else:
        assert isinstance(gate_up, DenseLinear) and gate_up.native is None
    assert isinstance(load_runtime(str(artifacts("w8-group")), backend="reference")[0].layers[1].gate_up,
                      W8A16Linear)
    assert isinstance(load_runtime(str(artifacts("w8a8")), backend=backend)[0].layers[1].qkv, W8A8Linear)


def test_mixed_schemes_in_one_projection_run_side_by_side(artifacts):
    qkv = load_runtime(str(artifacts("w4-ignore-k")))[0].layers[0].qkv
    assert isinstance(qkv, ConcatLinear)
    assert [type(p).__name__ for p in qkv.parts] == ["W4A16Linear", "DenseLinear", "W4A16Linear"]


@needs_gemv
@pytest.mark.parametrize("name", ["w4-asym", "w4-auto", "w8-channel", "w8-group", "w4-emb8"])
def test_quantized_decode_runs_in_one_native_call_like_the_per_layer_path(artifacts, name):
    runtime, _, _ = load_runtime(str(artifacts(name)), backend="cpu-native")

    def decode(fused):
        runner, seqs = ModelRunner(runtime, 32, 4), Sequences(32, 4)
        assert runner.fused_decode.max_rows == (cpu_native.W8_MAX_ROWS if "w8" in name else cpu_native.W4_MAX_ROWS)
        a, b = seqs.add(TOKENS), seqs.add(TOKENS[::-1])
        runner.execute(seqs.step([(a, 16), (b, 12)]))
        outs = []
        names = kernel_names(lambda: outs.extend(runner.execute(seqs.step(work), fused)
                                                 for work in ([(a, 1)], [(a, 1), (b, 1)], [(b, 1), (a, 1)])),
                             ("llmopt::DecodeLayers.run",))
        return outs, len(names)

    (per_layer, none), (one_call, three) = decode(False), decode(True)
    assert (none, three) == (0, 3)
    assert all(torch.equal(x, y) for x, y in zip(per_layer, one_call))
    # W8A8 projections (dynamic int8 activations) have no native GEMV: their decode stays per layer
    w8a8, _, _ = load_runtime(str(artifacts("w8a8")), backend="cpu-native")
    assert ModelRunner(w8a8, 8, 4).fused_decode is None


@pytest.mark.parametrize("base, groups", [("base", 1), ("h192", 3)])
def test_int8_embedding_stays_int8_and_a_tied_lm_head_shares_its_codes(artifacts, base, groups):
    path = artifacts("w4-emb8", base)
    model = load_model_dir(path)
    ids = torch.tensor(TOKENS)
    for backend in ("cpu-native", "cpu-torch", "reference"):
        if backend == "cpu-native" and not NATIVE:
            continue
        runtime, _, _ = load_runtime(str(path), backend=backend)
        assert runtime.embed_tokens.dtype == torch.int8 and runtime.embed_scale.shape == (runtime.vocab_size, groups)
        assert runtime.dtype == torch.float32
        assert torch.equal(runtime.embed(ids), model.model.embed_tokens(ids))  # the rows the eval path holds
        head = runtime.lm_head
        if backend == "cpu-torch" and groups > 1:  # group-wise: no int8 CPU kernel, dequantized once
            assert isinstance(head, DenseLinear)
            continue
        assert isinstance(head, W8A16Linear) and head.weight is runtime.embed_tokens
        assert (head.native is not None) == (backend == "cpu-native")  # the fast path: the native int8 GEMV
        h = torch.randn(3, runtime.spec.hidden_size)
        if backend != "cpu-torch":  # the native GEMV or the exact twin: fp32 arithmetic
            torch.testing.assert_close(head(h), model.lm_head(h), atol=1e-4, rtol=1e-4)
        h = torch.randn(12, runtime.spec.hidden_size)  # beyond the GEMV's rows: torch's int8 kernel (bf16
        ref = model.lm_head(h)  # inputs) for channel-wise scales, else the dense fallback
        budget = (model.lm_head(h.bfloat16().float()).bfloat16().float() - ref).norm()
        assert (head(h) - ref).norm() <= 3 * budget + 1e-4 * ref.norm()


def test_int8_embedding_beside_an_untied_lm_head(artifacts):
    path = artifacts("w4-emb8", base="untied")
    runtime, _, _ = load_runtime(str(path), backend="reference")
    assert runtime.embed_tokens.dtype == torch.int8 and isinstance(runtime.lm_head, TorchLinear)
    model = _dequantized_hf(path)
    for out, tokens in _run(path, "reference"):
        torch.testing.assert_close(out, hf_last_logits(model, tokens), atol=1e-4, rtol=1e-4)
