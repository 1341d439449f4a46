"""Packing A/B: how the figures in docs/quantize.md ("Packing") were made.

Times pack and unpack of random codes at the shapes quantize and serve meet (smollm2-135m's Linears and its
embedding), one thread, the arms interleaved (each first in turn), medians over rounds, and the ratio of each arm to the
first. Arms: `llmopt` (stages/ctpack.py: compressed-tensors' helpers plus our range check and row slices),
`library` (compressed-tensors' helpers alone) and, with --old FILE, a former ctpack.py to compare against:

    git show ea266d3:stages/ctpack.py > /tmp/old_ctpack.py
    python scripts/bench_ctpack.py --old /tmp/old_ctpack.py --rounds 5
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

# (rows, cols, bits, packed_dim): a W4A16 MLP projection both ways, the 8-bit and 4-bit embedding table,
# an asymmetric zero point (packed over the output dim), a 3-bit width that straddles words
SHAPES = [(1536, 576, 4, 1), (576, 1536, 4, 1), (49152, 576, 8, 1), (49152, 576, 4, 1), (1536, 9, 4, 0),
          (1536, 576, 3, 1)]


def arms(old: str | None) -> dict:
    from compressed_tensors.compressors.pack_quantized import helpers

    from llmopt.stages import ctpack

    found = {"llmopt": ctpack, "library": helpers}
    if old:
        spec = importlib.util.spec_from_file_location("old_ctpack", old)
        found["old"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(found["old"])
    return found


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(modules: dict, shape: tuple, rounds: int) -> dict[str, tuple[float, float]]:
    """{arm: (pack ms, unpack ms)}, medians over rounds; every arm's words and codes equal the library's."""
    rows, cols, bits, dim = shape
    low = -(1 << (bits - 1))
    q = torch.randint(low, -low, (rows, cols), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    words = modules["library"].pack_to_int32(q, bits, dim)
    for name, m in modules.items():
        if not (torch.equal(m.pack_to_int32(q, bits, dim), words)
                and torch.equal(m.unpack_from_int32(words, bits, q.shape, dim), q)):
            raise SystemExit(f"{name} disagrees with compressed-tensors at {shape}")
    times: dict[str, list] = {name: [] for name in modules}
    names = list(modules)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each arm first in turn
            m = modules[name]
            times[name].append((_ms(lambda: m.pack_to_int32(q, bits, dim)),
                                _ms(lambda: m.unpack_from_int32(words, bits, q.shape, dim).contiguous())))
    return {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
            for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="a former stages/ctpack.py to time beside the library")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    modules = arms(args.old)
    first = next(iter(modules))
    print("| shape | bits | dim | " + " | ".join(f"{n} pack / unpack ms" for n in modules) + " |")
    print("|---|---|---|" + "---|" * len(modules))
    for shape in SHAPES:
        ms = measure(modules, shape, args.rounds)
        cells = [f"{p:.2f} / {u:.2f}" + ("" if n == first else f" ({p / ms[first][0]:.2f}x / {u / ms[first][1]:.2f}x)")
                 for n, (p, u) in ms.items()]
        print(f"| {shape[0]}x{shape[1]} | {shape[2]} | {shape[3]} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
