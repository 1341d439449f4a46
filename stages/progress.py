"""Progress callbacks from a stage to whoever renders it (the CLI); stages know no UI."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _ignore(*args) -> None:
    return None


@dataclass
class StageHooks:
    status: Callable[[str], None] = _ignore  # a line of narration: "loading ...", "writing ..."
    layer: Callable[[object, int], None] = _ignore  # (LayerReport, number of layers) after each layer
    window: Callable[[int, int], None] = _ignore  # (done, total) evaluation windows
