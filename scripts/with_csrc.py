"""Run an llmopt command, or a Python script, with the native CPU kernels built from another C source folder:
the A/B of a kernel change in one process layout, everything else the same tree.

    git show a6cd0b1:kernels/csrc/layer.c > /tmp/old/layer.c ...   (every file of kernels/csrc)
    python scripts/with_csrc.py /tmp/old -- profile out/bench/w4a16e8 --quick --dtype bf16 --threads 2
    python scripts/with_csrc.py /tmp/old -- scripts/bench_speculative.py out/bench/w4a16e8 --arms none ngram

The library is built, as always, into the native cache under a hash of its sources, so both sides stay built.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


def use_sources(folder: Path) -> None:
    """Point the native build at `folder`'s copies of kernels/csrc's files (all of them must be there)."""
    from llmopt.kernels import cpu_native

    missing = [p.name for p in [*cpu_native.SOURCES, *cpu_native.HEADERS] if not (folder / p.name).is_file()]
    if missing:
        raise SystemExit(f"{folder}: missing {', '.join(missing)}")
    cpu_native.SOURCES = [folder / p.name for p in cpu_native.SOURCES]
    cpu_native.HEADERS = [folder / p.name for p in cpu_native.HEADERS]


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: with_csrc.py CSRC_FOLDER -- (LLMOPT ARGS... | SCRIPT.py ARGS...)")
    use_sources(Path(argv[0]))
    rest = argv[2:]
    if rest[0].endswith(".py"):
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")
        return
    from llmopt.cli.main import main as llmopt

    sys.exit(llmopt(rest))


if __name__ == "__main__":
    main(sys.argv[1:])
