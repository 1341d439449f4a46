"""Native CPU paged decode (C, built at first use) vs the torch twin, and how its build fails safely."""
import math
import shutil
import subprocess
import sys

import pytest
import torch

from llmopt.kernels import cpu_native, paged_attention_decode_ref

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="no C compiler: the native kernels cannot be built here")


def _case(ctx_lens, hq, hk, d, block_size, dtype, seed=0, token_stride_pad=0):
    """Random K/V scattered over shuffled blocks of one layer's cache [blocks, block_size, 2, Hk, D]."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(c / block_size) for c in ctx_lens)
    num_blocks = sum(math.ceil(c / block_size) for c in ctx_lens) + 3
    cache = torch.randn(num_blocks, block_size, 2, hk, d, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    for s, c in enumerate(ctx_lens):
        for b in range(math.ceil(c / block_size)):
            tables[s, b] = free.pop()
    wide = torch.randn(len(ctx_lens), hq * d + token_stride_pad, generator=g).to(dtype)
    q = wide[:, :hq * d].view(len(ctx_lens), hq, d)  # a token stride wider than Hq * D, as in a fused qkv
    return q, cache, tables, torch.tensor(ctx_lens, dtype=torch.int32)


def _reference(q, cache, tables, lens, scale):
    out = paged_attention_decode_ref(q.float(), cache[:, :, 0].float(), cache[:, :, 1].float(), tables, lens, scale)
    return out.to(q.dtype)


@pytest.mark.parametrize("hq,hk,d,block_size", [(9, 3, 64, 16), (8, 2, 128, 4), (4, 4, 32, 8), (6, 1, 80, 16)])
def test_matches_torch_twin_fp32(hq, hk, d, block_size):
    assert cpu_native.available(), cpu_native.why_unavailable()
    q, cache, tables, lens = _case([1, 5, block_size, 3 * block_size + 1, 70], hq, hk, d, block_size, torch.float32,
                                   token_stride_pad=2 * hk * d)
    scale = d ** -0.5
    out = cpu_native.paged_decode(q, cache.view(-1, 2 * hk * d), tables, lens, scale, block_size)
    torch.testing.assert_close(out, _reference(q, cache, tables, lens, scale), rtol=1e-5, atol=1e-5)


def test_matches_torch_twin_bf16():
    q, cache, tables, lens = _case([2, 17, 40, 129], 9, 3, 64, 16, torch.bfloat16, seed=3)
    out = cpu_native.paged_decode(q, cache.view(-1, 384), tables, lens, 0.125, 16)
    assert out.dtype == torch.bfloat16
    ref = _reference(q, cache, tables, lens, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)  # a bf16 rounding or two


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_split_over_threads_by_heads_matches_it_in_a_batch_exactly(dtype):
    # fewer sequences than threads: each one's query heads are split over the threads; every head's
    # arithmetic is unchanged, so the output equals, bit for bit, the same sequence's row in a batch
    # large enough to give each thread whole sequences
    q, cache, tables, lens = _case([37, 5, 70, 16, 33, 1, 64, 20], 9, 3, 64, 16, dtype, seed=5)
    kv, before = cache.view(-1, 384), torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        batched = cpu_native.paged_decode(q, kv, tables, lens, 0.125, 16)
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            for s in range(len(lens)):
                alone = cpu_native.paged_decode(q[s:s + 1], kv, tables[s:s + 1], lens[s:s + 1], 0.125, 16)
                assert torch.equal(alone[0], batched[s]), (threads, s)
    finally:
        torch.set_num_threads(before)


def test_large_scores_stay_finite_and_peak_where_the_key_matches():
    # online softmax across blocks: a huge score in a late block must rescale everything before it
    q, cache, tables, lens = _case([50], 2, 1, 64, 4, torch.float32, seed=5)
    q[0] = 0
    q[0, :, 0] = 1000.0
    cache[:, :, 0, 0, 0] = -1.0
    cache[:, :, 1] = 0.0
    block, offset = int(tables[0, 47 // 4]), 47 % 4
    cache[block, offset, 0, 0, 0] = 1.0  # position 47 is the only key with a positive score
    cache[block, offset, 1, 0, :] = 7.0
    out = cpu_native.paged_decode(q, cache.view(-1, 128), tables, lens, 1.0, 4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.full_like(out, 7.0))


def test_loading_the_library_keeps_denormals():
    # a library linked with -ffast-math would set flush-to-zero for the whole process on load
    assert cpu_native.available(), cpu_native.why_unavailable()
    tiny = 5e-324
    assert tiny * 1.0 == tiny
    assert torch.tensor([1e-40]).mul(1.0).item() != 0.0


def test_bad_inputs_are_refused_with_a_message():
    q, cache, tables, lens = _case([5], 9, 3, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="share dtype"):
        cpu_native.paged_decode(q, cache.view(-1, 384).to(torch.bfloat16), tables, lens, 0.1, 4)
    with pytest.raises(ValueError, match="int32"):
        cpu_native.paged_decode(q, cache.view(-1, 384), tables.long(), lens, 0.1, 4)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_native.paged_decode(q, cache.view(-1, 384)[:, :300], tables, lens, 0.1, 4)


PROBE = """
from llmopt.kernels import KernelBackendError, cpu_native, select_backend
print(cpu_native.available())
print(cpu_native.why_unavailable())
print(select_backend("auto").name)
try:
    select_backend("cpu-native")
    print("built")
except KernelBackendError as e:
    print(e)
"""


def _probe(env):
    """(available(), why_unavailable(), what "auto" picks, what "cpu-native" says) in a fresh interpreter
    (the library is built once per process)."""
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_failed_build_falls_back_to_cpu_torch_and_caches_nothing(tmp_path):
    import os

    base = {**os.environ, "LLMOPT_CACHE_DIR": str(tmp_path)}
    available, why, auto, explicit = _probe({k: v for k, v in base.items() if k != "CC"} | {"PATH": str(tmp_path)})
    assert (available, why, auto) == ("False", "no C compiler (gcc or cc) on PATH", "cpu-torch")
    assert explicit == "cpu-native: native kernels not built: no C compiler (gcc or cc) on PATH"
    available, why, auto, explicit = _probe({**base, "CC": "/nonexistent/cc"})  # a compiler that is not there
    assert available == "False" and "/nonexistent/cc" in why and auto == "cpu-torch"
    assert explicit.startswith("cpu-native: native kernels not built: ")
    available, why, auto, _ = _probe({**base, "CC": "false"})  # a "compiler" that always fails
    assert available == "False" and why.startswith("false failed") and auto == "cpu-torch"
    assert not any((tmp_path / "native").iterdir())  # no half-written library left behind
    available, why, auto, explicit = _probe(base)
    needs = "cpu-native: the native GEMVs need an AVX-512 CPU, which this is not; use cpu-torch"
    assert (available, why, explicit) == ("True", "None", "built" if cpu_native.gemv_available() else needs)
    assert auto == ("cpu-native" if cpu_native.gemv_available() else "cpu-torch")
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
