"""Compile checks: every Triton kernel, in every configuration its launcher picks, compiled for real GPUs on any
machine (Triton compiles for a GPU it does not have; it only cannot launch there).

No configuration is listed here. `record_launches` (`launch_recording`) runs the public ops on a simulated GPU
(fake CUDA tensors: shapes, no data; `torch.cuda.get_device_properties` answers for the simulated card), where a
launch records what it would compile (kernel, argument types, the ints it passes, constexprs, launch options)
instead of running. `sweep` drives every op that launches Triton over representative shapes and dtypes and keeps
one launch per configuration (`config_key`), `cover` a pairwise covering subset of them if asked; `compile_launch`
builds a launch as the JIT would (Triton's own binder computes the signature, the specialized ints and pointer
alignments) for an architecture and reads its resources back from the PTX and the cubin: registers, local memory
(ptxas' stack frame: spills), shared memory against the card's limit.

    python -m llmopt.kernels.compile_check [--arch 90 80] [--jobs N] [--cover T|90=T,80=T] [--full] [--json PATH]
                                           [--list]

A process that compiles must not have imported triton under TRITON_INTERPRET (see `_backend`): the command line
refuses to run there; tests run it in a subprocess.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import itertools
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from .launch_recording import GPUS, Launch, SimulatedGPU, TensorArg, record_launches

__all__ = ["GPUS", "Launch", "SimulatedGPU", "TensorArg", "record_launches", "sweep", "config_key", "cover",
           "all_kernels", "compile_launch", "plan", "check", "Compiled", "parse_cover", "main"]
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- the sweep: every public op that launches Triton, over representative shapes -------------------------------

ROWS = (1, 2, 4, 8, 16, 17, 64, 100)  # tokens per call: decode batches, prefill chunks, ragged counts
MATMUL_KN = ((4096, 4096), (100, 48))  # (K, N): a model's projection, and a ragged one
GROUPS = (32, 128, -1)  # group sizes; -1: one group per output channel
HIDDEN = (100, 576, 4096)
INTER = (100, 14336)
HEAD_DIMS = (64, 128)
GQA = ((4, 4), (9, 3), (32, 8))  # (q heads, kv heads): MHA, SmolLM2, Llama-3-8B
BLOCK_SIZE = 16  # KV-cache block size (the engine's default)
WINDOWS = (None, 4096)  # full causal; a sliding window (Gemma 3, Phi-3 and Mistral-style layers)


def _t(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="cuda")


def _elementwise(ops, dtype, note):
    for hidden in HIDDEN:
        note(f"rms_norm hidden={hidden}")
        x, w = _t(3, hidden, dtype=dtype), _t(hidden, dtype=dtype)
        ops.rms_norm(x, w, backend="triton")
        ops.rms_norm(x, w, residual=_t(3, hidden, dtype=dtype), backend="triton")
    for inter in INTER:
        note(f"silu_and_mul inter={inter}")
        ops.silu_and_mul(_t(3, 2 * inter, dtype=dtype), backend="triton")
        note(f"gelu_tanh_and_mul inter={inter}")
        ops.gelu_tanh_and_mul(_t(3, 2 * inter, dtype=dtype), backend="triton")


def _quantized(ops, dtype, note):
    for k, n in MATMUL_KN:
        for group in GROUPS:
            g = k if group == -1 else group
            groups = -(-k // g)
            w4 = {"weight_packed": _t(n, -(-k // 8), dtype=torch.int32), "weight_scale": _t(n, groups, dtype=dtype)}
            w8 = {"weight": _t(n, k, dtype=torch.int8), "weight_scale": _t(n, groups, dtype=dtype)}
            for m in ROWS:
                x = _t(m, k, dtype=dtype)
                for zp in (False, True):
                    note(f"w4a16_matmul M={m} K={k} N={n} group={group} zp={zp}")
                    z4 = _t(-(-n // 8), groups, dtype=torch.int32) if zp else None
                    ops.w4a16_matmul(x, **w4, weight_zero_point=z4, group_size=group, backend="triton")
                    note(f"w8a16_matmul M={m} K={k} N={n} group={group} zp={zp}")
                    z8 = _t(n, groups, dtype=torch.int8) if zp else None
                    ops.w8a16_matmul(x, **w8, weight_zero_point=z8, group_size=group, backend="triton")
    for k, n in MATMUL_KN:
        for m in ROWS:
            note(f"w8a8_matmul M={m} K={k} N={n}")
            ops.w8a8_matmul(_t(m, k, dtype=dtype), _t(n, k, dtype=torch.int8), _t(n, 1, dtype=dtype), backend="triton")


def _attention(ops, dtype, note):
    for d in HEAD_DIMS:
        for hq, hk in GQA:
            qkv = _t(64, (hq + 2 * hk) * d, dtype=dtype)  # [T, (Hq + 2 Hk) D]: q, k, v are views of one projection
            kv_cache = _t(8, BLOCK_SIZE, 2, hk, d, dtype=dtype)  # the engine's layout: [blocks, size, K|V, Hk, D]
            k_cache, v_cache = kv_cache[:, :, 0], kv_cache[:, :, 1]
            for t, seqs in ((4, 4), (5, 1), (64, 2)):  # decode; a short prefill chunk; a long one
                rows = qkv[:t]
                q = rows[:, : hq * d].view(t, hq, d)
                k = rows[:, hq * d: (hq + hk) * d].view(t, hk, d)
                v = rows[:, (hq + hk) * d:].view(t, hk, d)
                for neox in (True, False):
                    note(f"apply_rotary T={t} heads={hq}/{hk} head_dim={d} neox={neox}")
                    ops.apply_rotary(q, k, _t(t, dtype=torch.int64), _t(4096, d), is_neox=neox, backend="triton")
                tables = _t(seqs, 5, dtype=torch.int32)
                ctx = _t(seqs, dtype=torch.int32)
                for window in WINDOWS:
                    if t == seqs:
                        note(f"write_kv_cache + paged_attention_decode S={seqs} heads={hq}/{hk} head_dim={d} "
                             f"window={window}")
                        ops.write_kv_cache(k, v, k_cache, v_cache, _t(t, dtype=torch.int64), backend="triton")
                        ops.paged_attention_decode(q, k_cache, v_cache, tables, ctx, 0.125, backend="triton",
                                                   window=window)
                        continue
                    note(f"paged_attention_prefill T={t} S={seqs} heads={hq}/{hk} head_dim={d} window={window}")
                    meta = ops.StepMetadata(_t(t, dtype=torch.int64), _t(seqs + 1, dtype=torch.int32), ctx, tables,
                                            _t(t, dtype=torch.int64), max_query_len=t // seqs)
                    ops.paged_attention_prefill(q, k, v, k_cache, v_cache, meta, 0.125, backend="triton",
                                                window=window)


SWEEPS = (_elementwise, _quantized, _attention)


def config_key(launch: Launch, full: bool = False) -> str:
    """Which launches count as one configuration: same kernel, argument types, constexprs and launch options.
    `full`: also the same specialized ints and pointer alignments, i.e. one compiled kernel of the JIT's cache
    (the JIT compiles M=1, M=32 and M=33 apart; with `full=False` the first of them stands for all three)."""
    fn, _, _, specialization, options = _bind(launch, 90)
    if not full:
        specialization = [value if p.is_constexpr else ("i32" if kind == "constexpr" else kind)
                          for p, (kind, value) in zip(fn.params, specialization)]
    return repr((launch.kernel, specialization, sorted(options.items())))


def sweep(gpu: SimulatedGPU = GPUS[90], full: bool = False) -> list[Launch]:
    """The launches of every op that launches Triton, over representative shapes in fp16, bf16 and fp32 on the
    simulated `gpu`: the first of each configuration (`config_key`)."""
    ops = importlib.import_module(__package__)  # the public ops, as callers reach them
    with record_launches(gpu) as launches:

        def note(text):  # what the launches that follow come from
            launches.source = f"{text} dtype={str(dtype)[6:]} on {gpu.name}"

        try:
            for dtype in DTYPES:
                for part in SWEEPS:
                    part(ops, dtype, note)
        except Exception as e:
            raise RuntimeError(f"compile_check.sweep: {launches.source}: {type(e).__name__}: {e}") from e
    unique: dict[str, Launch] = {}
    for launch in launches:
        unique.setdefault(config_key(launch, full), launch)
    return list(unique.values())


def _choices(launch: Launch) -> tuple:
    """What a launch chose: its constexprs, pointer element types and launch options, as (name, value) pairs."""
    fn, _, _, specialization, options = _bind(launch, 90)
    return tuple((p.name, value if p.is_constexpr else kind) for p, (kind, value) in zip(fn.params, specialization)
                 if p.is_constexpr or kind.startswith("*")) + tuple(sorted(options.items()))


def cover(launches: list[Launch], strength: int = 2) -> list[Launch]:
    """A subset of `launches` in which every combination of `strength` choices (see `_choices`) that some launch of
    a kernel makes is made by a chosen launch of that kernel: a greedy covering array, deterministic for the same
    launches. Strength 2 keeps about a quarter of the configurations; it misses faults that need three or more
    choices together (the full set finds those)."""
    by_kernel: dict[str, list[Launch]] = {}
    for launch in launches:
        by_kernel.setdefault(launch.kernel, []).append(launch)
    chosen = []
    for group in by_kernel.values():
        combos = [set(itertools.combinations(_choices(launch), strength)) for launch in group]
        needed = set().union(*combos)
        while needed:
            best = max(range(len(group)), key=lambda i: len(combos[i] & needed))
            chosen.append(group[best])
            needed -= combos[best]
    return chosen


def all_kernels() -> list[str]:
    """Every Triton kernel defined in this package ("module:name"): what the sweep must reach. A @jit
    function that another one calls is a device function, compiled into its callers, not launched."""
    import pkgutil
    import re

    from triton.runtime.jit import KernelInterface

    from ._triton import LazyKernel

    package = importlib.import_module(__package__)
    jitted = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{__package__}.{info.name}")
        jitted.update({f"{module.__name__}:{value.fn.__name__}": value for value in vars(module).values()
                       if isinstance(value, (LazyKernel, KernelInterface)) and value.fn.__module__ == module.__name__})
    sources = {key: inspect.getsource(value.fn) for key, value in jitted.items()}

    def called(key: str) -> bool:
        pattern = re.compile(rf"(?<![\w.]){re.escape(key.split(':')[1])}\s*\(")
        return any(pattern.search(src) for other, src in sources.items() if other != key)

    return sorted(key for key in jitted if not called(key))


# ---- compiling a launch as the JIT would ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _jit_function(kernel: str):
    from triton.runtime.jit import JITFunction

    from ._triton import LazyKernel

    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    fn = fn.materialize() if isinstance(fn, LazyKernel) else fn  # the module's helpers and `tl` made real too
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)


@functools.lru_cache(maxsize=None)
def _binder(kernel: str, arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = _jit_function(kernel)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    return fn, backend, create_function_from_signature(fn.signature, fn.params, backend)


def _bind(launch: Launch, arch: int):
    fn, backend, binder = _binder(launch.kernel, arch)
    bound, specialization, options = binder(*launch.args, **dict(launch.kwargs))
    return fn, backend, bound, specialization, options


@dataclass
class Compiled:
    """One launch compiled for one architecture: whether it built, and what the PTX and cubin say."""

    kernel: str
    arch: int
    config: str  # constexprs and the non-default launch options
    signature: str  # argument types, specialized ints/alignments marked
    source: str
    ok: bool = False
    error: str = ""
    registers: int = -1  # per thread
    local_bytes: int = -1  # local memory (or stack frame) per thread: register spills, arrays
    shared_bytes: int = -1  # shared memory per program
    shared_limit: int = 0
    ptx_local: bool = False  # the PTX declares .local memory
    num_warps: int = 0
    cpu_seconds: float = 0.0  # this process's and its children's (ptxas): not slowed by a busy machine


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _describe(fn, specialization, constexprs: dict, attrs: dict) -> tuple[str, str]:
    names = [p.name for p in fn.params]
    config = ", ".join(f"{names[path[0]]}={value}" for path, value in constexprs.items())
    marks = {path[0] for path in attrs if attrs[path]}
    sig = ", ".join(f"{name}:{kind}{'/16' if i in marks else ''}" for i, (name, (kind, _)) in
                    enumerate(zip(names, specialization)) if kind != "constexpr")
    return config, sig


def _resources(cubin: bytes) -> dict:
    """REG, LOCAL, ... of the cubin's one function, as cuobjdump reports them."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    return {k: int(v) for k, v in (field.split(":")[-2:] for field in line.split() if field.count(":") >= 1)
            if v.isdigit()}


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile `launch` for sm_`arch` (PTX and cubin) as the JIT would on that GPU; never raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = _cpu_seconds()
    done = Compiled(launch.name, arch, "", "", launch.source, shared_limit=GPUS[arch].shared_memory_per_block_optin)
    try:
        fn, backend, bound, specialization, options = _bind(launch, arch)
        kwargs = dict(launch.kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        done.config, done.signature = _describe(fn, specialization, constexprs, attrs)
        launch_options = {k: v for k, v in kwargs.items() if k not in signature}  # num_warps, num_stages, ...
        done.config += "".join(f", {k}={v}" for k, v in launch_options.items())
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                options=options.__dict__)
        usage = _resources(kernel.asm["cubin"])
    except Exception as e:  # noqa: BLE001 - a failed build is the result, reported by the caller
        lines = str(e).strip().splitlines() or [""]
        done.error = f"{type(e).__name__}: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")
    else:
        done.ok = True
        done.registers, done.local_bytes = usage["REG"], max(usage["LOCAL"], usage.get("STACK", 0))
        done.shared_bytes, done.num_warps = kernel.metadata.shared, kernel.metadata.num_warps
        done.ptx_local = ".local" in kernel.asm["ptx"]
    done.cpu_seconds = round(_cpu_seconds() - start, 3)
    return done


def _compile_job(job):
    return compile_launch(*job)


def plan(archs=(90, 80), full: bool = False, strength: int | dict[int, int] | None = None) -> list[tuple]:
    """(launch, arch) to compile: sweep on each architecture's simulated GPU, then the union of configurations (or a
    `cover` of them of `strength`: one for every architecture, or {arch: strength}, an architecture left out
    getting them all) for every architecture."""
    seen: dict[str, Launch] = {}
    for arch in archs:
        for launch in sweep(GPUS[arch], full):
            seen.setdefault(config_key(launch, full), launch)
    strengths = strength if isinstance(strength, dict) else dict.fromkeys(archs, strength)
    covers = {s: cover(list(seen.values()), s) if s else list(seen.values()) for s in {strengths.get(a) for a in archs}}
    return [(launch, arch) for arch in archs for launch in covers[strengths.get(arch)]]


def check(archs=(90, 80), jobs: int | None = None, full: bool = False,
          strength: int | dict[int, int] | None = None) -> list[Compiled]:
    """Compile `plan(archs, full, strength)` in `jobs` processes (spawned afresh, with a fresh Triton cache: nothing
    is reused across runs)."""
    work = plan(archs, full, strength)
    with tempfile.TemporaryDirectory(prefix="llmopt-compile-check-") as cache, _worker_environment(cache):
        with ProcessPoolExecutor(jobs or os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
            return list(pool.map(_compile_job, work))


@contextlib.contextmanager
def _worker_environment(cache: str):
    """The environment compile workers start with: a fresh Triton cache, and no interpreter."""
    saved = dict(os.environ)
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def summary(results: list[Compiled]) -> list[dict]:
    """Per (kernel, arch): configurations, failures, and the largest registers/local/shared use."""
    rows: dict[tuple, dict] = {}
    for r in results:
        row = rows.setdefault((r.kernel, r.arch), {"kernel": r.kernel, "arch": r.arch, "configs": 0, "failed": 0,
                                                   "max_registers": 0, "max_local_bytes": 0, "max_shared_bytes": 0,
                                                   "over_shared": 0, "spilling": 0, "ptx_local": 0,
                                                   "cpu_seconds": 0.0})
        row["configs"] += 1
        row["failed"] += not r.ok
        row["max_registers"] = max(row["max_registers"], r.registers)
        row["max_local_bytes"] = max(row["max_local_bytes"], r.local_bytes)
        row["max_shared_bytes"] = max(row["max_shared_bytes"], r.shared_bytes)
        row["ptx_local"] += r.ptx_local
        row["over_shared"] += r.shared_bytes > r.shared_limit
        row["spilling"] += r.local_bytes > 0
        row["cpu_seconds"] = round(row["cpu_seconds"] + r.cpu_seconds, 2)
    return list(rows.values())


def parse_cover(text: str) -> int | dict[int, int]:
    """--cover's value: T for every architecture, or ARCH=T pairs ("90=2,80=1")."""
    try:
        if "=" not in text:
            return _strength(int(text))
        pairs = dict(item.split("=") for item in text.split(","))
        return {int(arch): _strength(int(t)) for arch, t in pairs.items()}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: expected T or ARCH=T,... with T >= 1 ({e})") from None


def _strength(t: int) -> int:
    if t < 1:
        raise ValueError(f"strength {t}")
    return t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmopt.kernels.compile_check", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(GPUS))
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: one per CPU)")
    parser.add_argument("--json", help="write every compiled configuration here")
    parser.add_argument("--full", action="store_true",
                        help="every specialization the JIT compiles apart (ints equal to 1 or divisible by 16, "
                             "aligned pointers), not one per configuration: several times slower")
    parser.add_argument("--cover", type=parse_cover, metavar="T|ARCH=T,...", help="compile only a T-way covering "
                        "subset: every combination of T choices (constexprs, dtypes) is still compiled; per "
                        "architecture as 90=2,80=1 (tests use that; an architecture left out gets every one)")
    parser.add_argument("--list", action="store_true", help="only list the recorded launches")
    args = parser.parse_args(argv)
    if isinstance(args.cover, dict) and set(args.cover) - set(GPUS):
        parser.error(f"--cover: no simulated GPU of architecture {sorted(set(args.cover) - set(GPUS))} "
                     f"(known: {sorted(GPUS)})")
    from ._triton import stdlib_interpreted

    if stdlib_interpreted():
        print("compile_check: unset TRITON_INTERPRET (an interpreted process cannot compile)", file=sys.stderr)
        return 2
    if args.list:
        for launch in sweep(GPUS[args.arch[0]], args.full):
            print(f"{launch.name}: {launch.source}")
        return 0
    start = time.perf_counter()
    results = check(tuple(args.arch), args.jobs, args.full, args.cover)
    elapsed = time.perf_counter() - start
    missed = sorted({kernel.split(":")[1] for kernel in all_kernels()} - {r.kernel for r in results})
    for row in summary(results):
        print("{kernel:24} sm_{arch}  {configs:3} configs  {failed} failed  registers <= {max_registers:3}  "
              "local <= {max_local_bytes:5} ({spilling} spill)  shared <= {max_shared_bytes:6} ({over_shared} over "
              "the limit)  cpu {cpu_seconds}s".format(**row))
    for r in results:
        if not r.ok:
            print(f"FAILED {r.kernel} sm_{r.arch} [{r.config}] from {r.source}: {r.error}")
    for name in missed:
        print(f"MISSED {name}: no op in the sweep launches it (add the op or the shapes that reach it to SWEEPS)")
    print(f"{len(results)} compiles in {elapsed:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": round(elapsed, 2), "missed": missed,
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    return 0 if all(r.ok for r in results) and not missed else 1


if __name__ == "__main__":
    # Run as the imported module, so that what the workers unpickle (`Launch`, `_compile_job`) resolves by name.
    sys.exit(importlib.import_module(__spec__.name).main())
