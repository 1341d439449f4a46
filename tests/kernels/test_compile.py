"""Compiled kernels: every configuration the launchers pick builds for sm_90 and sm_80 (PTX and cubin, compiled on
this CPU) within the resources we rely on; and compiled and interpreted launches never share a process."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import requires_triton, runs_in_this_process

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = requires_triton

# The one-row kernels (a row or a token per program) as they compile now, with headroom: no local memory and at
# most 58 registers. A tile that grew by accident shows here long before it costs.
ONE_ROW_KERNELS = ("_rms_norm_kernel", "_gated_kernel", "_rotary_kernel",
                   "_write_kv_kernel", "_quant_per_token_kernel")
ONE_ROW_REGISTERS = 96


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The configurations compiled for sm_90 and sm_80 by the command line, in a process without the interpreter,
    as all of them take minutes (`python -m llmopt.kernels.compile_check` compiles them all): for sm_90 (H100/H200,
    what users serve on and GPU sessions measure) a pairwise cover (every two choices of a kernel made together
    somewhere: 101 of 365), for sm_80 every choice at least once (32)."""
    out = tmp_path_factory.mktemp("compile") / "configs.json"
    done = subprocess.run([sys.executable, "-m", "llmopt.kernels.compile_check", "--cover", "90=2,80=1", "--json",
                           str(out)],
                          env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.exists(), (done.stdout + done.stderr)[-4000:]
    return SimpleNamespace(returncode=done.returncode, stdout=done.stdout, **json.loads(out.read_text()))


def _configs(results, which) -> str:
    return "\n".join(f"{r['kernel']} sm_{r['arch']} [{r['config']}] ({r['source']}): {which(r)}" for r in results)


def test_every_configuration_compiles_for_sm90_and_sm80(compiled):
    failed = [r for r in compiled.results if not r["ok"]]
    assert not failed, _configs(failed, lambda r: r["error"])
    assert not compiled.missed, f"kernels no op of the sweep launches: {compiled.missed}"
    assert compiled.returncode == 0, compiled.stdout[-3000:]
    assert {r["arch"] for r in compiled.results} == {80, 90}


def test_sliding_window_attention_compiles_for_sm90_and_sm80(compiled):
    """The paged attention kernel's windowed configurations (HAS_WINDOW: the loop starts at the window) build too."""
    windowed = [r for r in compiled.results
                if r["kernel"] == "_paged_attention_kernel" and "HAS_WINDOW=True" in r["config"]]
    assert {r["arch"] for r in windowed} == {80, 90}
    failed = [r for r in windowed if not r["ok"]]
    assert not failed, _configs(failed, lambda r: r["error"])


def test_no_ptx_declares_local_memory(compiled):
    """LLVM kept every array in registers (what ptxas spills is the next test's)."""
    local = [r for r in compiled.results if r["ok"] and r["ptx_local"]]
    assert not local, _configs(local, lambda r: ".local in the PTX")


def _dtype(result) -> str:
    """The element type of the kernel's first argument (the activations): fp16, bf16, fp32, i8."""
    return result["signature"].split(", ")[0].split(":*")[1].split("/")[0]


def test_no_spills_where_there_are_none_now(compiled):
    """No local memory (ptxas' stack frame: spills) in the one-row kernels, the int8 matmul, and 16-bit paged
    attention on sm_90. Where there is some now (`python -m llmopt.kernels.compile_check` lists it): fp32
    W4A16/W8A16 and paged attention tiles (fp32 dots run on FMA units), 16x128 W4A16/W8A16 decode tiles without
    split-K, and 16-bit paged attention of head_dim 128 in 64-row prefill tiles on sm_80 (docs/kernels.md)."""
    def guarded(r):
        return (r["kernel"] in (*ONE_ROW_KERNELS, "_int8_matmul_kernel") or
                r["kernel"] == "_paged_attention_kernel" and r["arch"] == 90 and _dtype(r) in ("fp16", "bf16"))

    spills = [r for r in compiled.results if r["ok"] and guarded(r) and r["local_bytes"]]
    assert not spills, _configs(spills, lambda r: f"{r['local_bytes']} bytes of local memory per thread")
    assert {r["kernel"] for r in compiled.results} >= {*ONE_ROW_KERNELS, "_int8_matmul_kernel"}


def test_one_row_kernels_stay_small_in_registers(compiled):
    big = [r for r in compiled.results if r["kernel"] in ONE_ROW_KERNELS and r["registers"] > ONE_ROW_REGISTERS]
    assert not big, _configs(big, lambda r: f"{r['registers']} registers")


def test_every_configuration_fits_the_gpus_shared_memory(compiled):
    over = [r for r in compiled.results if r["ok"] and r["shared_bytes"] > r["shared_limit"]]
    assert not over, _configs(over, lambda r: f"{r['shared_bytes']} > {r['shared_limit']} bytes of shared memory")


def test_the_sweep_reaches_every_kernel_on_both_gpus():
    """Every Triton kernel of the package is launched by some public op in the sweep, and the simulated GPU's
    properties reach the launchers' choices (the SM count sets W4A16's split-K: H100 and A100 differ)."""
    from llmopt.kernels import compile_check

    h100, a100 = compile_check.sweep(compile_check.GPUS[90]), compile_check.sweep(compile_check.GPUS[80])
    assert {launch.kernel for launch in h100} == {launch.kernel for launch in a100} == set(compile_check.all_kernels())
    keys = {compile_check.config_key(launch) for launch in h100}
    assert keys != {compile_check.config_key(launch) for launch in a100}


def test_cover_per_architecture_plans_each_gpus_own_subset():
    """`--cover 90=2,80=1` (what the fixture runs): a pairwise cover for sm_90 and, for sm_80, a subset in which every
    choice of every kernel is still compiled; a plain T is the same cover for both."""
    from llmopt.kernels import compile_check

    by_arch = {}
    for launch, arch in compile_check.plan((90, 80), strength=compile_check.parse_cover("90=2,80=1")):
        by_arch.setdefault(arch, []).append(launch)
    union = [launch for launch, arch in compile_check.plan((90, 80)) if arch == 90]  # the same for both
    everything = {(launch.kernel, choice) for launch in union for choice in compile_check._choices(launch)}
    for arch, launches in by_arch.items():
        assert {(launch.kernel, choice) for launch in launches for choice in compile_check._choices(launch)} \
            == everything, arch
    assert len(by_arch[80]) < len(by_arch[90]) == len(compile_check.cover(union, 2)) < len(union)
    assert compile_check.parse_cover("2") == 2
    for bad in ("0", "90=x", "90=2,80"):
        with pytest.raises(compile_check.argparse.ArgumentTypeError):
            compile_check.parse_cover(bad)


def test_a_recorded_launch_holds_types_ints_and_constexprs():
    from llmopt.kernels import compile_check, rms_norm

    with compile_check.record_launches() as launches:
        x = torch.empty(5, 2 * 100, dtype=torch.float16, device="cuda")[:, 100:]  # a view 200 bytes in: unaligned
        rms_norm(x, torch.empty(100, dtype=torch.float16, device="cuda"), backend=None)  # CUDA tensors: Triton
    (launch,) = launches
    assert launch.name == "_rms_norm_kernel" and launch.kernel.endswith(".norm:_rms_norm_kernel")
    args = dict(zip(("x", "res", "w", "out", "sxm", "srm", "som", "hidden", "eps"), launch.args))
    assert args["x"] == compile_check.TensorArg(torch.float16, aligned=False)
    assert args["w"] == compile_check.TensorArg(torch.float16, aligned=True)
    assert (args["sxm"], args["hidden"]) == (200, 100)
    assert dict(launch.kwargs) == {"HAS_RESIDUAL": False, "BLOCK": 128}


def test_one_configuration_stands_for_its_int_specializations():
    """The JIT compiles hidden=100 and hidden=112 apart (112 is divisible by 16): one configuration, two kernels."""
    from llmopt.kernels import compile_check, rms_norm

    with compile_check.record_launches() as launches:
        for hidden in (100, 112):
            rms_norm(torch.empty(2, hidden, device="cuda"), torch.empty(hidden, device="cuda"), backend="triton")
    ragged, aligned = launches
    assert compile_check.config_key(ragged) == compile_check.config_key(aligned)
    assert compile_check.config_key(ragged, full=True) != compile_check.config_key(aligned, full=True)


@pytest.mark.parametrize("first, then, interpret", [
    ("interpreted", "compiled", False),  # a recording in between claims nothing
    ("compiled", "interpreted", False),
    (None, "compiled", True),  # triton imported under TRITON_INTERPRET cannot compile
])
def test_interpreted_and_compiled_launches_never_share_a_process(first, then, interpret):
    script = textwrap.dedent("""
        import sys, torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from llmopt.kernels import KernelBackendError, compile_check, rms_norm

        def launch(kind):
            if kind == "interpreted":
                x, w = torch.randn(3, 40), torch.rand(40)
                torch.testing.assert_close(rms_norm(x, w, backend="triton"), rms_norm(x, w, backend="torch"))
                return
            with FakeTensorMode():  # CUDA tensors without a GPU: the launch gets as far as the driver
                rms_norm(torch.empty(3, 40, device="cuda"), torch.empty(40, device="cuda"), backend="triton")

        with compile_check.record_launches() as launches:
            launch("compiled")
        assert len(launches) == 1
        if sys.argv[1] != "None":
            try:
                launch(sys.argv[1])
            except KernelBackendError:
                raise
            except Exception as e:  # no GPU here: the compiled launch stops at the driver, after its claim
                print("driver:", type(e).__name__)
        try:
            launch(sys.argv[2])
        except KernelBackendError as e:
            print("refused:", e)
    """)
    env = _env(TRITON_INTERPRET="1") if interpret else _env()
    done = subprocess.run([sys.executable, "-c", script, str(first), then], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    refusal = done.stdout.splitlines()[-1]
    if interpret:
        assert refusal.startswith("refused: triton was imported with TRITON_INTERPRET set"), done.stdout
    else:
        expected = f"refused: this process already launched Triton kernels {first}; {then} launches"
        assert refusal.startswith(expected), done.stdout


def _item(name, device=None, marked=False):
    params = {} if device is None else {"device_dtype": (device, torch.float32)}
    marker = object() if marked else None
    return SimpleNamespace(name=name, callspec=SimpleNamespace(params=params) if device else None,
                           get_closest_marker=lambda which: marker if which == "with_cuda_cases" else None)


def test_with_cuda_this_process_keeps_only_the_cuda_cases():
    here = [_item("test_norm[cuda-float16]", "cuda"), _item("test_modules_on_cuda_run_triton[float16]"),
            _item("test_in_a_subprocess", marked=True)]
    elsewhere = [_item("test_norm[cpu-float32]", "cpu"), _item("test_cuda_named_but[cpu-float32]", "cpu"),
                 _item("test_backends_by_name")]
    assert all(runs_in_this_process(item, cuda=False) for item in here + elsewhere)
    assert all(runs_in_this_process(item, cuda=True) for item in here)
    assert not any(runs_in_this_process(item, cuda=True) for item in elsewhere)


@pytest.mark.with_cuda_cases
@pytest.mark.skipif(not torch.cuda.is_available(), reason="without CUDA every kernel test runs in this process")
def test_interpreted_cases_in_their_own_process():
    """The tests this process deselected (conftest.py): in a subprocess with the interpreter and no CUDA."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE)],
                          env=_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""), cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]

