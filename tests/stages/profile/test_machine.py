"""The machine's own ceilings: the GEMM measurement stops at its time budget (a CPU without a bf16 GEMM takes
seconds a call there) but always times at least one call, and stops at `repeats` on a fast one."""
import torch

from llmopt.stages.profile import machine


def _count_timed(monkeypatch, seconds: float) -> list:
    calls = []

    def fake_timed(fn, device):
        calls.append(fn())
        return seconds

    monkeypatch.setattr(machine, "timed", fake_timed)
    return calls


def test_gemm_throughput_times_repeats_calls_within_its_budget(monkeypatch):
    calls = _count_timed(monkeypatch, 0.5)
    flops = machine.gemm_throughput(torch.device("cpu"), torch.float32, n=32, repeats=3, budget_s=60.0)
    assert len(calls) == 3 and flops == 2 * 32 ** 3 / 0.5


def test_gemm_throughput_stops_at_its_budget_after_one_call(monkeypatch):
    calls = _count_timed(monkeypatch, 2.0)
    flops = machine.gemm_throughput(torch.device("cpu"), torch.float32, n=32, repeats=7, budget_s=0.0)
    assert len(calls) == 1 and flops == 2 * 32 ** 3 / 2.0
    assert tuple(calls[0].shape) == (32, 32)  # the call timed is the n x n x n matmul
