"""The serve runtime against transformers: same logits (fp32, 1e-4) for every way a step can look."""
import json

import pytest
import torch
import torch.nn.functional as F

from llmopt.kernels import cpu_native, select_backend
from llmopt.kernels.cpu_attention import decode_groups
from llmopt.kernels.cpu_backends import CpuTorchBackend
from llmopt.kernels.cpu_linear import ROW_CHUNK, DenseLinear, row_bucket
from llmopt.stages.errors import ConfigError
from llmopt.stages.serve.loader import load_runtime
from llmopt.stages.serve.model import SUPPORTED_ARCHITECTURES, spec_from_config
from llmopt.stages.serve.runner import ModelRunner
from tests.helpers import BF16_ROUTED
from tests.kernels.helpers import kernel_calls, kernel_names
from tests.stages.serve.runner_steps import Sequences, hf_last_logits, save_hf

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0, bos_token_id=0, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
ATOL = RTOL = 1e-4
CPU_BACKENDS = ["cpu-native", "cpu-torch"]
needs_gemv = pytest.mark.skipif(not cpu_native.gemv_available(), reason="native GEMV needs a C compiler and AVX-512")


def _randomize(model, seed):
    """HF init is tiny and leaves biases at zero and norms at one: widen everything so bugs show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def build_hf(kind: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama-tied":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True))
    elif kind == "llama-untied":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False))
    elif kind == "llama3-rope":
        model = LlamaForCausalLM(LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False))
    elif kind == "qwen2-bias":
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=False))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None, tie_word_embeddings=False))
    elif kind in FAMILY_CONFIGS:
        model = build_family(kind)
    else:
        raise ValueError(kind)
    return _randomize(model, seed)


def build_family(kind: str):
    """A tiny model of one of the families beyond Llama (stages/families.py), HF's own class."""
    import transformers

    config_cls, model_cls, extra = FAMILY_CONFIGS[kind]
    config = getattr(transformers, config_cls)(**SMALL, **extra)
    return getattr(transformers, model_cls)(config)


FAMILY_CONFIGS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    # a local and a global layer with their own RoPE bases; the window longer than any test's context
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=8, query_pre_attn_scalar=12, sliding_window=512, layer_types=["sliding_attention", "full_attention"],
        architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True)),
    # windows shorter than the tests' contexts: the window decides every step shape's logits
    "gemma3-window": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=8, query_pre_attn_scalar=12, sliding_window=7, layer_types=["sliding_attention", "full_attention"],
        architectures=["Gemma3ForCausalLM"], tie_word_embeddings=False)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, tie_word_embeddings=False)),
}
KINDS = ["llama-tied", "llama-untied", "llama3-rope", "qwen2-bias", "mistral", *FAMILY_CONFIGS]


@pytest.fixture(scope="module", params=KINDS)
def saved(request, tmp_path_factory):
    """(HF model, its saved directory) of one architecture variant."""
    model = build_hf(request.param)
    return model, save_hf(model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def pair(saved):
    """(HF model, our runtime on the default backend) of one architecture variant."""
    model, path = saved
    return model, load_runtime(str(path))[0]


def _tokens(n, seed):
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(out, model, seqs, ids):
    for row, seq in zip(out, ids):
        torch.testing.assert_close(row, hf_last_logits(model, seqs.tokens[seq][:seqs.cached[seq]]), atol=ATOL,
                                   rtol=RTOL)


def test_full_prefill(pair):
    model, runtime = pair
    seqs = Sequences(32, 16, groups=runtime.kv_groups.count)
    a, b = seqs.add(_tokens(23, 1)), seqs.add(_tokens(9, 2))
    out = ModelRunner(runtime, 32, 16).execute(seqs.step([(a, 23), (b, 9)]))
    assert out.shape == (2, VOCAB) and out.dtype == torch.float32
    _check(out, model, seqs, [a, b])


def test_chunked_prefill_then_decode(pair):
    model, runtime = pair
    runner, seqs = ModelRunner(runtime, 64, 4), Sequences(64, 4, seed=3, groups=runtime.kv_groups.count)
    a = seqs.add(_tokens(40, 4))
    for n in (7, 12, 1, 9):  # chunks that continue a cached prefix, one of a single token
        _check(runner.execute(seqs.step([(a, n)])), model, seqs, [a])
    for _ in range(6):  # decode token by token over non-contiguous blocks of 4
        _check(runner.execute(seqs.step([(a, 1)])), model, seqs, [a])


def test_mixed_batch_prefill_chunks_and_decodes(pair):
    model, runtime = pair
    runner, seqs = ModelRunner(runtime, 96, 4), Sequences(96, 4, seed=5, groups=runtime.kv_groups.count)
    a, b, c, d = (seqs.add(_tokens(n, 10 + n)) for n in (30, 25, 14, 20))
    runner.execute(seqs.step([(b, 10), (c, 5)]))
    # c and b decode around a fresh prompt and a continued chunk; contexts of different lengths
    for work in ([(c, 1), (a, 8), (b, 1), (d, 6)], [(a, 9), (b, 1), (c, 1), (d, 1)], [(d, 3), (c, 1), (b, 1)]):
        out = runner.execute(seqs.step(work))
        _check(out, model, seqs, [s for s, _ in work])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_decode_batch_of_unequal_contexts(saved, backend):
    # the native kernel (C, in place) and the torch path (gathered blocks, SDPA) against transformers
    if backend == "cpu-native" and not cpu_native.gemv_available():
        pytest.skip("cpu-native needs a C compiler and an AVX-512 CPU")
    model, path = saved
    runtime, _, _ = load_runtime(str(path), backend=backend)
    runner, seqs = ModelRunner(runtime, 64, 4), Sequences(64, 4, seed=7, groups=runtime.kv_groups.count)
    ids = [seqs.add(_tokens(n, n)) for n in (3, 11, 6)]
    runner.execute(seqs.step([(s, len(seqs.tokens[s]) - 2) for s in ids]))
    for _ in range(2):
        step = seqs.step([(s, 1) for s in ids])
        _check(runner.execute(step), model, seqs, ids)  # as served (cpu-native: the fused decode step)
        # the same step again, layer by layer (it rewrites the same cache slots with the same keys and values)
        out = []
        names = kernel_names(lambda: out.append(runner.execute(step, fused=False)), ("llmopt::",))
        _check(out[0], model, seqs, ids)
        assert ("llmopt::paged_decode" in names) == (backend == "cpu-native")


def test_decode_groups_split_where_padding_costs_more_than_a_call():
    # one long context among short ones gets a call of its own; similar lengths share one
    assert decode_groups([800] + [50] * 15, overhead=384) == [[0], list(range(1, 16))]
    assert decode_groups([100, 90, 95, 99], overhead=384) == [[0, 3, 2, 1]]
    assert decode_groups([5, 40, 6], overhead=0) == [[1], [2], [0]]
    groups = decode_groups([743, 318, 7, 21, 37, 80, 46, 4, 23, 26, 271, 115, 11, 25, 9, 69], overhead=384)
    assert sorted(i for g in groups for i in g) == list(range(16))  # a partition
    padded = sum(len(g) * max([743, 318, 7, 21, 37, 80, 46, 4, 23, 26, 271, 115, 11, 25, 9, 69][i] for i in g)
                 for g in groups)
    assert padded + 384 * len(groups) < 16 * 743 / 2  # vs one call padded to 743


def test_decode_batch_split_into_length_groups(saved):
    # torch path, every decode its own group (overhead 0), mixed with a prefill chunk: rows scattered back
    model, path = saved
    runtime, _, _ = load_runtime(str(path), backend=CpuTorchBackend(group_overhead_keys=0))
    runner, seqs = ModelRunner(runtime, 96, 4), Sequences(96, 4, seed=9, groups=runtime.kv_groups.count)
    ids = [seqs.add(_tokens(n, 20 + n)) for n in (3, 41, 6, 29, 17)]
    runner.execute(seqs.step([(s, len(seqs.tokens[s]) - 2) for s in ids[:4]]))
    for work in ([(s, 1) for s in ids[:4]], [(ids[1], 1), (ids[4], 9), (ids[0], 1), (ids[3], 1), (ids[2], 1)]):
        step, out = seqs.step(work), []
        names = kernel_names(lambda: out.append(runner.execute(step)), ("aten::scaled_dot_product_attention",))
        _check(out[0], model, seqs, [s for s, _ in work])
        if runtime.kv_groups.windows == (None,):  # windowed: the lengths a window leaves are not distinct
            assert len(names) == len(work) * runtime.spec.num_layers  # distinct lengths: a call per sequence


def test_runtime_bf16_close_to_fp32(tmp_path):
    model = build_hf("llama-untied")
    runtime, _, _ = load_runtime(str(save_hf(model, tmp_path)), dtype="bf16")
    assert runtime.dtype == torch.bfloat16
    seqs = Sequences(16, 16, groups=runtime.kv_groups.count)
    a = seqs.add(_tokens(12, 0))
    out = ModelRunner(runtime, 16, 16).execute(seqs.step([(a, 12)]))
    ref = hf_last_logits(model, seqs.tokens[a])
    assert ((out[0] - ref).norm() / ref.norm()) < 0.05


def test_unsupported_architecture_is_refused(tmp_path):
    config = {**SMALL, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(ConfigError, match="supported: " + ", ".join(SUPPORTED_ARCHITECTURES)):
        spec_from_config(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel is not supported"):
        load_runtime(str(tmp_path))


def test_spec_reads_both_rope_config_styles():
    llama = {**SMALL, "model_type": "llama"}
    old = spec_from_config({**llama, "rope_theta": 5e5, "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items()
                                                                         if k != "rope_theta"}})
    new = spec_from_config({**llama, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}})
    assert old.rope_theta == new.rope_theta == 5e5 and old.rope_scaling == new.rope_scaling
    # A window is the attention's, not a cap on the sequence: the whole max_position_embeddings is served.
    mistral = spec_from_config({**SMALL, "model_type": "mistral", "sliding_window": 64})
    assert mistral.max_positions == SMALL["max_position_embeddings"]
    assert {layer.window for layer in mistral.shape.layers} == {64}
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        spec_from_config({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpreted_triton), "reference"])
def test_kernel_backends_match_transformers(tmp_path, backend):
    """triton: the CUDA code path (Triton rotary, norm with in-place residual, paged attention, on CPU tensors
    under the interpreter); reference: every op's torch twin."""
    model = build_hf("qwen2-bias")
    runtime, _, _ = load_runtime(str(save_hf(model, tmp_path)), backend=backend)
    runner, seqs = ModelRunner(runtime, 32, 4), Sequences(32, 4, seed=2, groups=runtime.kv_groups.count)
    a, b = seqs.add(_tokens(12, 1)), seqs.add(_tokens(9, 2))
    for work in ([(a, 6), (b, 7)], [(a, 5), (b, 1)], [(b, 1), (a, 1)]):  # prefill, mixed, decode
        _check(runner.execute(seqs.step(work)), model, seqs, [s for s, _ in work])
    assert runner.fused_decode is None and runner.prebuild_matmuls(32, 4) == 0


def test_prefill_after_a_shared_cached_prefix(pair):
    """Prefix caching: a new sequence starts on another's blocks and prefills only its own tokens."""
    model, runtime = pair
    runner, seqs = ModelRunner(runtime, 32, 4), Sequences(32, 4, seed=9, groups=runtime.kv_groups.count)
    a = seqs.add(_tokens(14, 3))
    runner.execute(seqs.step([(a, 14)]))
    b = seqs.share_prefix(a, 3, _tokens(6, 4))  # 12 cached tokens, 6 new ones
    c = seqs.share_prefix(a, 3, _tokens(1, 5))  # only its last token is new: the decode path
    _check(runner.execute(seqs.step([(b, 6), (c, 1)])), model, seqs, [b, c])


def test_row_buckets_are_few_and_pad_little():
    buckets = {row_bucket(m) for m in range(1, ROW_CHUNK + 1)}
    assert len(buckets) == 44 and max(buckets) == ROW_CHUNK
    assert all(row_bucket(m) == m for m in range(1, 17))  # small decode batches: exact
    for m in range(1, ROW_CHUNK + 1):
        assert m <= row_bucket(m) <= m * (1.125 if m <= 64 else 1.25)
        assert row_bucket(row_bucket(m)) == row_bucket(m)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, BF16_ROUTED])
def test_dense_linear_on_row_buckets_matches_f_linear(dtype, backend):
    # padded rows and 512-row chunks must not change any real row
    if backend == "cpu-native" and not cpu_native.gemv_available():
        pytest.skip("cpu-native needs a C compiler and an AVX-512 CPU")
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    layer = select_backend(backend).dense_linear(weight.clone(), bias)
    calls = []
    for rows in (1, 2, 17, 33, 100, 513, 1100):
        x = torch.randn(rows, 40, generator=g).to(dtype)
        onednn = kernel_calls(lambda: calls.append(layer(x)), ("mkldnn::_linear_pointwise",))
        y = calls.pop()
        assert y.shape == (rows, 48)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), F.linear(x, weight, bias).float(), rtol=tol, atol=tol)
        calls += [shapes[0][0] for _, shapes in onednn]
    assert set(calls) <= {row_bucket(m) for m in range(1, ROW_CHUNK + 1)}
    assert {18, 36, 112, 512} <= set(calls)  # 17, 33 and 100 rows padded; 1,100 split into 512s plus a rest


def onednn_rows(fn) -> dict[tuple, list[int]]:
    """{weight shape [N, K]: rows of each oneDNN linear call} while `fn()` runs."""
    seen: dict[tuple, list[int]] = {}
    for _, shapes in kernel_calls(fn, ("mkldnn::_linear_pointwise",)):
        seen.setdefault(tuple(shapes[1]), []).append(shapes[0][0])
    return seen


def test_prebuild_runs_each_weight_shape_once_per_bucket(tmp_path):
    # one module per distinct shape (primitives are per shape), layers up to the token budget, lm_head
    # up to the sequence count; afterwards a step's matmuls meet only row counts already run
    runtime, _, _ = load_runtime(str(save_hf(build_hf("llama-untied"), tmp_path)))
    runner = ModelRunner(runtime, 64, 4)
    calls = []
    seen = onednn_rows(lambda: calls.append(runner.prebuild_matmuls(40, 6)))
    modules = {tuple(m.weight.shape): m for m in runtime.modules() if isinstance(m, DenseLinear)}
    assert set(seen) == set(modules) and (VOCAB, 32) in modules  # the lm_head's shape is its own
    for shape, rows in seen.items():
        limit = 6 if shape == (VOCAB, 32) else 40
        onednn = [m for m in range(1, limit + 1) if m > modules[shape].small_rows]  # the others skip oneDNN
        assert rows == sorted({row_bucket(m) for m in onednn}), shape
    assert calls == [sum(len(r) for r in seen.values())]
    built = {shape: set(rows) for shape, rows in seen.items()}
    seqs = Sequences(64, 4, seed=3, groups=runtime.kv_groups.count)
    ids = [seqs.add(_tokens(n, n)) for n in (9, 13, 5)]
    seen = onednn_rows(lambda: runner.execute(seqs.step([(s, len(seqs.tokens[s]) - 2) for s in ids])))  # 21 rows
    seen |= onednn_rows(lambda: runner.execute(seqs.step([(s, 1) for s in ids]), fused=False))  # logits for 3
    assert seen and all(set(rows) <= built[shape] for shape, rows in seen.items())


def test_prebuild_can_be_switched_off(tmp_path):
    runtime, _, _ = load_runtime(str(save_hf(build_hf("llama-untied"), tmp_path)))
    assert ModelRunner(runtime, 16, 4).prebuild_matmuls(32, 4) > 0
    assert ModelRunner(runtime, 16, 4, prebuild=False).prebuild_matmuls(32, 4) == 0


@needs_gemv
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qwen2-bias", "qwen3", "gemma3-window", "mistral-window"])
def test_fused_decode_step_equals_the_per_layer_path(tmp_path, dtype, kind):
    # a decode-only step of few sequences runs every layer in one native call (csrc/layer.c): same kernels, same
    # order, so the logits must be bit-identical to the per-layer path of the Python layer (and that path must
    # really be skipped); every family's variant (q/k norms, Gemma's sandwich norms and GeGLU, two KV layer
    # groups with their own RoPE, windows shorter than the contexts)
    runtime, _, _ = load_runtime(str(save_hf(build_hf(kind), tmp_path)), dtype=dtype, backend="cpu-native")

    def decode(fused):
        runner, seqs = ModelRunner(runtime, 64, 4), Sequences(64, 4, seed=11, groups=runtime.kv_groups.count)
        assert runner.fused_decode is not None and runner.fused_decode.max_rows >= 2
        ids = [seqs.add(_tokens(n, n)) for n in (9, 14, 5)]
        runner.execute(seqs.step([(s, len(seqs.tokens[s]) - 4) for s in ids]), fused)  # prefill: never fused
        outs = []
        names = kernel_names(lambda: outs.extend(runner.execute(seqs.step([(s, 1) for s in ids[:rows]]), fused)
                                                  for rows in (1, 2, 1, 2)), ("llmopt::",))
        return outs, runner.kv_cache.clone(), names

    (per_layer, cache_a, layered), (one_call, cache_b, fused) = decode(False), decode(True)
    assert fused.count("llmopt::DecodeLayers.run") == 4 and "llmopt::DecodeLayers.run" not in layered
    assert "llmopt::paged_decode" in layered and "llmopt::paged_decode" not in fused
    for a, b in zip(per_layer, one_call):
        assert torch.equal(a, b)
    assert torch.equal(cache_a, cache_b)  # the same keys and values were cached


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_lets_the_loaded_weight_go_once_both_cpu_layouts_exist(dtype):
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(24, 40, generator=g).to(dtype), torch.randn(24, generator=g).to(dtype)
    layer = select_backend("cpu-native").dense_linear(weight.clone(), bias)
    assert layer.weight.device.type == "meta" and layer.weight.shape == (24, 40) and layer.released == ("weight",)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 2, 3, 9, 40):  # the native GEMV, then oneDNN: both from their own copies
        x = torch.randn(rows, 40, generator=g).to(dtype)
        torch.testing.assert_close(layer(x).float(), F.linear(x, weight, bias).float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="x must be a CPU"):  # no path reads the released values
        layer(torch.empty(1, 40, dtype=dtype, device="meta"))
