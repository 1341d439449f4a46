"""Per-layer accounting and the interleaved decode sweep on synthetic timings: no model, no clock."""
import pytest
import torch

from llmopt.stages.profile.breakdown import account_parts
from llmopt.stages.profile.sweeps import interleaved_seconds, spread_ms
from llmopt.stages.profile.tables import breakdown_table

MS = 1e-3


def _parts(*steps):
    return [{"layer 0": a * MS, "layer 1": b * MS, "lm_head": c * MS} for a, b, c in steps]


def test_parts_are_shares_of_their_own_steps_so_they_never_exceed_the_plain_step():
    # Hooks make a step slower (14 ms against 10 ms plain) and one hooked step was hit by load (40 ms):
    # the medians of the parts (5 + 5 + 3 ms) are 130 % of the plain step; their shares are 13 / 14.
    parts = _parts((5, 5, 3), (5, 5, 3), (5, 25, 3))
    b = account_parts(parts, [14 * MS, 14 * MS, 40 * MS], [10 * MS, 10 * MS, 11 * MS])
    assert b["step_ms"] == pytest.approx(10.0) and b["hooked_step_ms"] == pytest.approx(14.0)
    assert b["ratio"] == pytest.approx(13 / 14) and b["sum_ms"] == pytest.approx(10 * 13 / 14)
    assert b["unattributed_ms"] == pytest.approx(10 / 14) and b["note"] == ""
    assert [r["ms"] for r in b["rows"]] == pytest.approx([50 / 14, 50 / 14, 30 / 14])
    assert [r["hooked_median_ms"] for r in b["rows"]] == pytest.approx([5.0, 5.0, 3.0])
    assert b["hook_overhead_ms"] == pytest.approx(4.0)


def test_overlapping_parts_are_said_to_overlap():
    # A part timed inside another (16 ms of parts in a 14 ms step) counts twice: the report says so.
    b = account_parts(_parts((8, 5, 3), (8, 5, 3)), [14 * MS, 14 * MS], [10 * MS, 10 * MS])
    assert b["ratio"] == pytest.approx(16 / 14) and b["unattributed_ms"] < 0
    assert "overlap" in b["note"]
    table = breakdown_table({"source": "m", "breakdown": {"decode": {**b, "what": "decode"}}}, "decode", True)
    assert "overlap" in table.note


class _Runner:
    """Records which step each call runs; `timed` reads the clock around it."""

    def __init__(self):
        self.kv_cache, self.calls = torch.zeros(1), []

    def execute(self, step):
        self.calls.append(step)


def test_decode_points_are_timed_in_interleaved_passes():
    runner = _Runner()
    seconds = interleaved_seconds(runner, {1: "b1", 4: "b4"}, count=5, rounds=3)
    assert {k: len(v) for k, v in seconds.items()} == {1: 5, 4: 5}
    # a warm-up call then 2 timed per point in the first pass, then 2 and 1 in the others
    assert runner.calls == ["b1"] * 3 + ["b4"] * 3 + ["b1", "b1", "b4", "b4", "b1", "b4"]
    assert spread_ms([0.003, 0.001, 0.002]) == pytest.approx(
        {"ms": 2.0, "ms_min": 1.0, "ms_median": 2.0, "ms_max": 3.0})


def test_latency_plot_bars_span_each_points_spread():
    from llmopt.stages.profile.plots import spread_bars

    assert spread_bars([{"ms": 2.0, "ms_min": 1.0, "ms_max": 5.0}]) == [[1.0], [3.0]]
    assert spread_bars([{"ms": 2.0}]) is None  # a report written before points kept their spread
