"""The `llmopt` console script: Ctrl-C while the CLI's modules are still importing exits like any
other interrupt (one line, code 130) instead of printing Python's traceback. Nothing here may
import more than the standard library before the guard; the command's own module imports later,
inside main(), which handles the interrupt itself."""
from __future__ import annotations

import sys


def main() -> int:
    try:
        from llmopt.cli.main import main as run
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    return run()
