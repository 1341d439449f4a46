"""Sliding-window attention on every path (the torch twins, Triton, cpu-torch, cpu-native and its C decode
kernel) against dense fp64 attention with the window mask: decode, fresh prefill and chunks over a cached
prefix; windows below, equal to and above the contexts; odd block sizes. Cache rows older than every
query's window are NaN in every case: no path may read them (their blocks may have been freed)."""
import math

import pytest
import torch

from llmopt.kernels import StepMetadata, cpu_native, paged_attention_decode, paged_attention_prefill
from llmopt.kernels.cpu_attention import NativeCpuAttention
from llmopt.kernels.cpu_backends import CpuNativeBackend, CpuTorchBackend
from llmopt.kernels.op_backends import ReferenceBackend, TritonBackend
from llmopt.kernels.paged_attention import window_start
from tests.kernels.helpers import HAS_TRITON, assert_close

SCENARIOS = {  # name: (context lengths, new tokens per sequence)
    "decode": ([1, 6, 13, 20, 37], [1, 1, 1, 1, 1]),
    "prefill": ([9, 17], [9, 17]),
    "chunks": ([23, 9, 30, 13], [6, 1, 4, 13]),  # cached prefixes, a decode and a fresh prompt in one step
}
WINDOWS = (1, 4, 13, 64, None)  # 13: equal to a context in every scenario; 64: above all of them


class WindowCase:
    """Random sequences in a paged cache [blocks, block_size, 2, Hk, D] (the engine's layout), every position's
    K/V already written, rows before each sequence's earliest window NaN; the step's q||k||v rows."""

    def __init__(self, scenario, window, hq=6, hk=2, d=16, block_size=5, dtype=torch.float32, device="cpu",
                 seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ctx, self.q_lens = SCENARIOS[scenario]
        self.window, self.hq, self.hk, self.d, self.block_size = window, hq, hk, d, block_size
        self.k = [torch.randn(c, hk, d, generator=g) for c in self.ctx]
        self.v = [torch.randn(c, hk, d, generator=g) for c in self.ctx]
        width = max(math.ceil(c / block_size) for c in self.ctx)
        num_blocks = len(self.ctx) * width + 2
        order = torch.randperm(num_blocks, generator=g)[: len(self.ctx) * width]
        self.tables = order.view(len(self.ctx), width).to(torch.int32)
        cache = torch.zeros(num_blocks, block_size, 2, hk, d)
        for s, c in enumerate(self.ctx):
            first = window_start(c, self.q_lens[s], window)
            for p in range(c):
                row = cache[self.tables[s, p // block_size], p % block_size]
                row.copy_(torch.stack([self.k[s][p], self.v[s][p]]) if p >= first else torch.full_like(row, math.nan))
        self.cache = cache.to(device, dtype)
        q = torch.randn(sum(self.q_lens), hq, d, generator=g)
        new = [slice(c - n, c) for c, n in zip(self.ctx, self.q_lens)]
        k_new = torch.cat([k[sl] for k, sl in zip(self.k, new)])
        v_new = torch.cat([v[sl] for v, sl in zip(self.v, new)])
        self.qkv = torch.cat([q.flatten(1), k_new.flatten(1), v_new.flatten(1)], 1).to(device, dtype)  # [T, ...]
        self.meta = self._meta(device)

    def _meta(self, device) -> StepMetadata:
        new = [torch.arange(c - n, c) for c, n in zip(self.ctx, self.q_lens)]  # each sequence's new positions
        bs = self.block_size
        slots = torch.cat([self.tables[s, p // bs].long() * bs + p % bs for s, p in enumerate(new)])
        cu = torch.tensor([0, *self.q_lens]).cumsum(0).to(torch.int32)
        ctx = torch.tensor(self.ctx, dtype=torch.int32)
        return StepMetadata(torch.cat(new).to(device), cu.to(device), ctx.to(device), self.tables.to(device),
                            slots.to(device), max(self.q_lens))

    def views(self, qkv):
        """q [T, Hq, D], k, v [T, Hk, D] and k||v [T, 2 Hk D]: views of the fused rows, as the runtime has them."""
        t, qd, kd = qkv.shape[0], self.hq * self.d, self.hk * self.d
        return (qkv[:, :qd].view(t, self.hq, self.d), qkv[:, qd:qd + kd].view(t, self.hk, self.d),
                qkv[:, qd + kd:].view(t, self.hk, self.d), qkv[:, qd:])

    def reference(self):
        """Dense fp64 attention of each sequence's new queries over its (un-poisoned) K/V, window-masked."""
        q, outs, start, group = self.views(self.qkv)[0].double().cpu(), [], 0, self.hq // self.hk
        for s, c in enumerate(self.ctx):
            n = self.q_lens[s]
            k, v = (t.double().repeat_interleave(group, 1) for t in (self.k[s], self.v[s]))
            scores = torch.einsum("lhd,chd->hlc", q[start:start + n], k) * self.d ** -0.5
            pos, keys = torch.arange(c - n, c)[:, None], torch.arange(c)[None, :]
            visible = (keys <= pos) & (keys > pos - (self.window or c + 1))
            outs.append(torch.einsum("hlc,chd->lhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v))
            start += n
        return torch.cat(outs)


def _native_ok():
    return cpu_native.gemv_available()


BACKENDS = {  # name: (make(dtype), runs here)
    "cpu-torch": (lambda dtype: CpuTorchBackend(dtype=dtype), lambda: True),  # one padded decode group here
    "cpu-torch-groups": (lambda dtype: CpuTorchBackend(dtype=dtype, group_overhead_keys=0), lambda: True),
    "cpu-native": (lambda dtype: CpuNativeBackend(dtype=dtype), _native_ok),
    "reference": (lambda dtype: ReferenceBackend(), lambda: True),
    "triton": (lambda dtype: TritonBackend(), lambda: HAS_TRITON),  # interpreted: fp32 only
}
CASES = [(name, dtype) for name in BACKENDS for dtype in (torch.float32, torch.bfloat16)
         if dtype == torch.float32 or name.startswith("cpu")]


@pytest.mark.parametrize("block_size", [5, 3])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name, dtype", CASES, ids=[f"{n}-{str(t)[6:]}" for n, t in CASES])
def test_backend_attention_with_a_window_matches_dense(name, dtype, scenario, window, block_size):
    make, runs = BACKENDS[name]
    if not runs():
        pytest.skip(f"{name} cannot run here")
    case = WindowCase(scenario, window, block_size=block_size, dtype=dtype)
    attn = make(dtype).attention(case.meta, torch.zeros(64, case.d), case.d ** -0.5, block_size, dtype, window=window)
    qkv = case.qkv.clone()
    out = attn.attend(*case.views(qkv), case.cache)
    assert torch.isfinite(out).all(), "a NaN row from before a window reached the output"
    assert_close(out, case.reference(), dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_triton_and_twin_ops_with_a_window_match_dense(device_dtype, scenario, window):
    """The ops themselves (as the Triton kernel's launchers take the window), on CUDA too where there is one."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    device, dtype = device_dtype
    case = WindowCase(scenario, window, block_size=3, dtype=dtype, device=device, seed=1)
    q, k, v, _ = case.views(case.qkv)
    k_cache, v_cache = case.cache[:, :, 0], case.cache[:, :, 1]
    for backend in ("torch", "triton"):
        if scenario == "decode":
            out = paged_attention_decode(q, k_cache, v_cache, case.meta.block_tables, case.meta.context_lens,
                                         case.d ** -0.5, backend=backend, window=window)
        else:
            out = paged_attention_prefill(q, k, v, k_cache, v_cache, case.meta, case.d ** -0.5, backend=backend,
                                          window=window)
        assert torch.isfinite(out).all(), backend
        assert_close(out, case.reference(), dtype)


@pytest.mark.skipif(not _native_ok(), reason="native kernels need a C compiler and an AVX-512 CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, block_size", [(64, 16), (128, 5), (80, 7)])  # the unrolled copies and the generic one
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_native_paged_decode_starts_at_the_window(dtype, d, block_size, window):
    case = WindowCase("decode", window, hq=4, hk=1, d=d, block_size=block_size, dtype=dtype, seed=2)
    q = case.views(case.qkv)[0]
    out = cpu_native.paged_decode(q, case.cache.view(-1, 2 * d), case.tables, case.meta.context_lens, d ** -0.5,
                                  block_size, window=window)
    assert torch.isfinite(out).all()
    assert_close(out, case.reference(), dtype)


def test_a_window_is_a_positive_int():
    case = WindowCase("decode", None)
    q = case.views(case.qkv)[0]
    for window in (0, -3, 2.5):
        with pytest.raises(ValueError, match="window"):
            paged_attention_decode(q, case.cache[:, :, 0], case.cache[:, :, 1], case.tables, case.meta.context_lens,
                                   0.25, backend="torch", window=window)
        with pytest.raises(ValueError, match="window"):
            CpuTorchBackend().attention(case.meta, torch.zeros(64, 16), 0.25, 5, torch.float32, window=window)


@pytest.mark.skipif(not _native_ok(), reason="native kernels need a C compiler and an AVX-512 CPU")
@pytest.mark.parametrize("window", [None, 37, 64, 36, 4])
def test_fused_step_takes_the_window_to_the_native_decode(window):
    """csrc/layer.c calls the same paged decode with the plan's window (whatever the longest context, 37)."""
    case = WindowCase("decode", None)
    attn = NativeCpuAttention(case.meta, torch.zeros(64, 16), 0.25, 5, torch.float32, window=window)
    plan = attn.fused_plan(len(case.ctx), 16, torch.float32)
    assert plan is not None and plan.window == window
