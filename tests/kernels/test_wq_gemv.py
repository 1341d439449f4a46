"""The decode GEMV (`wq_gemv`): equal to the torch twins over rows, ragged shapes, group modes, zero points,
stacking and split-K; its plan as a pure function of the SM count; the route from w4a16/w8a16_matmul."""
import pytest
import torch

from llmopt.kernels import w4a16_matmul, w8a16_matmul
from llmopt.kernels.wq_gemv import ELEMENT, ONE, STEP, WORD, plan_gemv, wq_gemv
from llmopt.kernels.wq_matmul import choose_split_k, w4a16_matmul_ref, w8a16_matmul_ref
from tests.kernels.helpers import quantize_int4, quantize_int8, requires_triton, to

H200_SMS = 132


def _int4(n, k, group_size, symmetric, device):
    t = to(quantize_int4(torch.randn(n, k), group_size, symmetric), device)
    return t["weight_packed"], t["weight_scale"], t.get("weight_zero_point")


def _int8(n, k, group_size, symmetric, device):
    """int8 codes [N, K] with [N, G] scales (G = 1: channel-wise) and, if asymmetric, int8 zero points."""
    if group_size is None:
        t = to(quantize_int8(torch.randn(n, k), symmetric), device)
        return t["weight"], t["weight_scale"], t.get("weight_zero_point")
    groups = -(-k // group_size)
    zero = None if symmetric else torch.randint(-20, 20, (n, groups), dtype=torch.int8, device=device)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device)
    return codes, torch.rand(n, groups, device=device) / 100 + 1e-3, zero


def _check(device_dtype, bits, m, k, n, group_size, symmetric, sms=None, split_k=None):
    device, dtype = device_dtype
    make, ref = (_int4, w4a16_matmul_ref) if bits == 4 else (_int8, w8a16_matmul_ref)
    weight, scale, zero = make(n, k, group_size, symmetric, device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    y = wq_gemv(x, weight, scale, zero, n, group_size or k, bits, split_k=split_k, sms=sms)
    assert y.shape == (m, n) and y.dtype == dtype
    expected = ref(x, weight, scale, zero, group_size or k)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # as test_quant_matmul; fp16/bf16 round the weight once
    torch.testing.assert_close(y.float(), expected.float(), atol=tol * max(1.0, expected.abs().max().item()), rtol=tol)


@requires_triton
@pytest.mark.parametrize("m, k, n", [(1, 256, 64), (3, 100, 24), (16, 264, 70), (7, 1000, 130)])
@pytest.mark.parametrize("group_size", [32, 64, 128, None, 20])  # 20: not a whole number of words (ELEMENT)
@pytest.mark.parametrize("symmetric", [True, False])
def test_w4_gemv_matches_reference(device_dtype, m, k, n, group_size, symmetric):
    _check(device_dtype, 4, m, k, n, group_size, symmetric)


@requires_triton
@pytest.mark.parametrize("m, k, n", [(1, 256, 64), (5, 132, 70), (2, 130, 33), (16, 102, 24)])  # 130, 102: K % 4 != 0
@pytest.mark.parametrize("group_size", [32, 128, None, 17])
@pytest.mark.parametrize("symmetric", [True, False])
def test_w8_gemv_matches_reference(device_dtype, m, k, n, group_size, symmetric):
    _check(device_dtype, 8, m, k, n, group_size, symmetric)


@requires_triton
@pytest.mark.parametrize("bits, m, k, n, group_size, symmetric", [
    (4, 2, 2048, 40, 128, False),  # stacks 4 (16 rows a program), splits K in 2
    (4, 1, 1024, 130, None, True),  # ragged N
    (4, 4, 4096, 24, 64, False),  # per-word scales
    (8, 3, 1024, 70, 128, False),
    (8, 1, 2050, 40, None, True),  # int8 rows that are not whole words
])
def test_stacking_and_split_k_match_reference(device_dtype, bits, m, k, n, group_size, symmetric):
    """A small SM count makes `plan_gemv` stack K slices and split K even for these tiny shapes."""
    groups = 1 if group_size is None else -(-k // group_size)
    plan = plan_gemv(n, k, bits, group_size or k, groups, sm_count=8)
    assert plan.stack > 1
    _check(device_dtype, bits, m, k, n, group_size, symmetric, sms=8)


@requires_triton
@pytest.mark.parametrize("split_k", [2, 3])
def test_forced_split_k_matches_reference(device_dtype, split_k):
    _check(device_dtype, 4, 3, 330, 40, 64, False, split_k=split_k)  # 330 columns: a ragged last step
    _check(device_dtype, 8, 3, 330, 40, None, True, split_k=split_k)


def test_plan_fills_an_h200():
    # Llama-3-8B's MLP up projection at batch 1: 224 row blocks of 64, stacked twice to 448 programs.
    plan = plan_gemv(14336, 4096, 4, 128, 32, H200_SMS)
    assert (plan.groups, plan.block_kw, plan.stack, plan.split, plan.programs) == (STEP, 16, 2, 1, 448)
    assert plan.kw_per_slice == 256 and plan.kw_per_slice % plan.group_words == 0  # slices start on a group
    # q/o projections stack 4 slices; the 1024-row k/v projections also split K (fp32 atomics).
    square = plan_gemv(4096, 4096, 4, 128, 32, H200_SMS)
    assert (square.stack, square.split) == (4, 1)
    small = plan_gemv(1024, 4096, 4, 128, 32, H200_SMS)
    assert (small.stack, small.split, small.programs * small.split) == (4, 4, 256)
    assert plan_gemv(1024, 4096, 4, 128, 32, H200_SMS, max_stack=2).stack == 2  # fp32's cap


def test_plan_modes_and_cpu():
    cpu = plan_gemv(4096, 4096, 4, 128, 32, None)
    assert (cpu.stack, cpu.split, cpu.programs) == (1, 1, 64)
    assert plan_gemv(64, 4096, 4, 4096, 1, None).groups == ONE
    assert plan_gemv(64, 4096, 4, 64, 64, None).groups == WORD  # 8 words a group, 16 a step
    assert plan_gemv(64, 4096, 8, 128, 32, None).groups == STEP  # W8: 32 words a group and a step
    element = plan_gemv(64, 100, 4, 20, 5, None)
    assert (element.groups, element.block_kw, element.num_stages) == (ELEMENT, 8, 2)  # half steps for the gathers
    bytewise = plan_gemv(64, 4098, 8, 32, 129, None, bytewise=True)  # int8 rows that are not whole words
    assert (bytewise.groups, bytewise.block_kw, bytewise.num_stages) == (WORD, 16, 2)
    assert plan_gemv(64, 256, 4, 128, 2, H200_SMS).stack == 1  # two steps: nothing to stack
    assert plan_gemv(64, 330, 4, 64, 6, None, split_k=3).split == 3


def test_choose_split_k_fills_twice_the_sms():
    assert choose_split_k(tiles=112, k_steps=32, sm_count=H200_SMS) == 2
    assert choose_split_k(tiles=8, k_steps=32, sm_count=H200_SMS) == 8  # four steps a split at least
    assert choose_split_k(tiles=500, k_steps=32, sm_count=H200_SMS) == 1
    assert choose_split_k(tiles=8, k_steps=32, sm_count=None) == 1  # CPU


@requires_triton
@pytest.mark.parametrize("m, expect_gemv", [(1, True), (16, True), (17, False)])
def test_matmuls_route_up_to_16_rows_to_the_gemv(monkeypatch, m, expect_gemv):
    import llmopt.kernels.wq_matmul as wq_matmul

    calls = []
    real = wq_matmul.wq_gemv
    monkeypatch.setattr(wq_matmul, "wq_gemv", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    packed, scale, zero = _int4(24, 64, 32, False, "cpu")
    x = torch.randn(m, 64)
    y = w4a16_matmul(x, packed, scale, zero, 32, backend="triton")
    torch.testing.assert_close(y, w4a16_matmul(x, packed, scale, zero, 32, backend="torch"), atol=1e-4, rtol=1e-4)
    codes, s8, _ = _int8(24, 64, None, True, "cpu")
    w8a16_matmul(x, codes, s8, backend="triton")
    assert len(calls) == (2 if expect_gemv else 0)


_SM90_BUILD = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from llmopt.kernels.wq_gemv import BLOCK_N, _wq_gemv_kernel, plan_gemv

_wq_gemv_kernel = _wq_gemv_kernel.materialize()  # the JITFunction (the kernel modules import triton lazily)
plan = plan_gemv(14336, 4096, 4, 128, 32, 132)
ints = ("M", "N", "K", "KW", "group_size", "kw_per_split", "kw_per_slice", "stride_xm", "stride_wn", "stride_sn",
        "stride_zn", "stride_om")
constexprs = {"BITS": 4, "HAS_ZP": False, "GROUPS": plan.groups, "GROUP_WORDS": plan.group_words, "BYTES": False,
              "IEEE": False, "SPLIT_K": 1, "STACK": plan.stack, "BLOCK_N": BLOCK_N, "BLOCK_KW": plan.block_kw}
signature = {"x_ptr": "*fp16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*i32", "out_ptr": "*fp16",
             **{name: "i32" for name in ints}, **{name: "constexpr" for name in constexprs}}
aligned = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "K", "KW", "kw_per_split", "kw_per_slice",
           "stride_xm", "stride_wn", "stride_om")  # what a launch on these shapes specialises as 16-divisible
attrs = {(_wq_gemv_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
kernel = compile(ASTSource(_wq_gemv_kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                 options={"num_warps": 4, "num_stages": plan.num_stages})
print(kernel.asm["ptx"])
"""


@requires_triton
def test_sm90_build_streams_words_with_16_byte_copies():
    """The decode build for an H100/H200 (fp16, 4096 x 14336, groups of 128): threads copy 16-byte runs of
    packed words (cp.async, pipelined), the dot runs on wgmma, nothing goes to local memory. Compiled for
    sm_90 without a GPU, in a fresh process (the tests run Triton interpreted)."""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", _SM90_BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    copies = [line for line in done.stdout.splitlines() if "cp.async.cg.shared.global" in line]
    assert copies and all(line.rstrip(";").split(",")[-2].strip() == "0x10" for line in copies), copies[:4]
    assert not re.search(r"ld\.global(\.nc)?\.(v\d\.)?b32", done.stdout)  # the words come only by cp.async
    assert "wgmma.mma_async" in done.stdout
    assert ".local" not in done.stdout


@requires_triton
@pytest.mark.parametrize("m", [2, 20])
def test_strided_weights_and_1d_scales(m):
    """Transposed copies (last-dim stride != 1) and channel-wise scales given as [N] reach the kernels right."""
    packed, scale, zero = _int4(24, 64, None, False, "cpu")
    x = torch.randn(64, m).t()  # [m, 64], K not contiguous
    expected = w4a16_matmul(x, packed, scale, zero, backend="torch")
    y = w4a16_matmul(x, packed.t().contiguous().t(), scale.reshape(-1), zero.t().contiguous().t(), backend="triton")
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    codes, s8, z8 = _int8(24, 64, 32, False, "cpu")
    expected = w8a16_matmul(x, codes, s8, z8, 32, backend="torch")
    y = w8a16_matmul(x, codes.t().contiguous().t(), s8.t().contiguous().t(), z8, 32, backend="triton")
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
