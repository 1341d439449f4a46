"""scripts/bench_ctpack.py: every arm is checked against compressed-tensors before it is timed."""
import importlib.util
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ctpack.py"
spec = importlib.util.spec_from_file_location("bench_ctpack", SCRIPT)
bench_ctpack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_ctpack)


def test_measure_times_every_arm():
    ms = bench_ctpack.measure(bench_ctpack.arms(None), (9, 40, 4, 1), rounds=1)
    assert set(ms) == {"llmopt", "library"} and all(p >= 0 and u >= 0 for p, u in ms.values())


def test_an_arm_that_disagrees_with_the_library_is_refused():
    modules = bench_ctpack.arms(None)
    modules["wrong"] = types.SimpleNamespace(pack_to_int32=lambda q, b, d: modules["library"].pack_to_int32(q, b, d) + 1,
                                             unpack_from_int32=modules["library"].unpack_from_int32)
    with pytest.raises(SystemExit, match="wrong disagrees"):
        bench_ctpack.measure(modules, (9, 40, 4, 1), rounds=1)
