"""Threads that behave: the usable CPU count (affinity, cgroup quota, --threads), passive OpenMP waiting set
before torch loads libgomp, and --threads validated on every command that takes it."""
import os
import subprocess
import sys

import pytest
import torch

from llmopt.cli.main import main
from llmopt.kernels.threads import (ThreadCount, apply_threads, cgroup_quota, check_threads, describe,
                                    choose_wait_policy, usable_cpus)
from llmopt.stages.errors import ConfigError
from llmopt.stages.serve.config import ServeConfig


def fake_cgroup(tmp_path, proc_lines: list[str], files: dict[str, str]):
    """A cgroup tree under tmp_path/cgroup with `files` (relative path -> text), and a /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    return {"cgroup_root": root, "proc_cgroup": proc}


def test_the_affinity_mask_counts_when_there_is_no_quota(tmp_path):
    paths = fake_cgroup(tmp_path, ["0::/"], {"cpu.max": "max 100000"})
    assert str(usable_cpus(affinity={0, 1}, **paths)) == "2 (affinity)"
    assert str(usable_cpus(affinity={3}, **paths)) == "1 (affinity)"


def test_no_cgroup_files_at_all_is_the_affinity(tmp_path):
    paths = {"cgroup_root": tmp_path / "none", "proc_cgroup": tmp_path / "missing"}
    assert usable_cpus(affinity={0, 1, 2}, **paths) == ThreadCount(3, "affinity")


@pytest.mark.parametrize("quota, expect", [
    ("100000 100000", "1 (cgroup cpu.max 100000/100000)"),
    ("150000 100000", "2 (cgroup cpu.max 150000/100000)"),  # 1.5 CPUs: rounded up
    ("50000 100000", "1 (cgroup cpu.max 50000/100000)"),  # never below one
    ("800000 100000", "4 (affinity)"),  # a quota above the affinity mask limits nothing
    ("max 100000", "4 (affinity)"),
    ("garbage", "4 (affinity)"),
])
def test_cgroup_v2_cpu_max_caps_the_affinity(tmp_path, quota, expect):
    paths = fake_cgroup(tmp_path, ["0::/kubepods/pod1"], {"kubepods/pod1/cpu.max": quota})
    assert str(usable_cpus(affinity={0, 1, 2, 3}, **paths)) == expect


def test_the_tightest_quota_of_the_cgroup_and_its_ancestors_wins(tmp_path):
    paths = fake_cgroup(tmp_path, ["0::/kubepods/pod1/ctr"], {"kubepods/cpu.max": "200000 100000",
                                                              "kubepods/pod1/cpu.max": "max 100000",
                                                              "kubepods/pod1/ctr/cpu.max": "300000 100000"})
    assert cgroup_quota(**paths) == ("cpu.max", 200000, 100000)
    assert str(usable_cpus(affinity=set(range(8)), **paths)) == "2 (cgroup cpu.max 200000/100000)"


def test_a_container_sees_its_own_cgroup_as_the_root(tmp_path):
    # inside a cgroup namespace /proc/self/cgroup says "0::/" and the limit sits in the root's cpu.max
    paths = fake_cgroup(tmp_path, ["0::/"], {"cpu.max": "100000 100000"})
    assert str(usable_cpus(affinity={0, 1}, **paths)) == "1 (cgroup cpu.max 100000/100000)"


@pytest.mark.parametrize("quota, expect", [("200000", "2 (cgroup cpu.cfs_quota_us 200000/100000)"),
                                           ("-1", "8 (affinity)")])
def test_cgroup_v1_cfs_quota(tmp_path, quota, expect):
    paths = fake_cgroup(tmp_path, ["4:memory:/docker/abc", "3:cpu,cpuacct:/docker/abc", "0::/"],
                        {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": quota,
                         "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"})
    assert str(usable_cpus(affinity=set(range(8)), **paths)) == expect


def test_threads_given_wins_over_what_is_detected(tmp_path):
    paths = fake_cgroup(tmp_path, ["0::/"], {"cpu.max": "100000 100000"})
    assert str(usable_cpus(4, affinity={0, 1}, **paths)) == "4 (--threads)"


def test_this_machine_gives_a_count_with_a_reason():
    count = usable_cpus()
    assert 1 <= count.count <= (os.cpu_count() or 1) and count.reason


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_threads_below_one_or_not_whole_is_refused(bad):
    with pytest.raises(ValueError, match="--threads must be a whole number of at least 1"):
        check_threads(bad)
    with pytest.raises(ConfigError, match="--threads must be a whole number of at least 1"):
        ServeConfig(threads=bad)


@pytest.mark.parametrize("argv", [["serve", "some-model", "--threads", "0"],
                                  ["generate", "some-model", "--prompt", "hi", "--threads", "-1"],
                                  ["profile", "some-model", "--threads", "0"],
                                  ["bench", "--offline", "some-model", "--threads", "0"]])
def test_the_commands_refuse_threads_below_one_in_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--threads" in err and "at least 1" in err and len(err.splitlines()) == 1, err


def test_passive_waiting_under_a_quota_unless_the_user_chose():
    quota = ThreadCount(1, "cgroup cpu.max 100000/100000")
    environ = {}
    assert choose_wait_policy(environ, quota) == {"OMP_WAIT_POLICY": "PASSIVE"} == environ
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert choose_wait_policy(mine, quota) == {} and mine == {"OMP_WAIT_POLICY": "ACTIVE"}
    alone = {}  # cores of our own by affinity: libgomp keeps spinning, the governor handles a neighbour
    assert choose_wait_policy(alone, ThreadCount(2, "affinity")) == {} == alone
    assert choose_wait_policy({}, ThreadCount(4, "--threads")) == {}
    assert describe(ThreadCount(2, "affinity"), environ) == "threads: 2 (affinity), OpenMP waits PASSIVE"


# how the CLI starts: the module `python -m llmopt.cli.main` runs, and the console script running `llmopt --help`
CLI_STARTS = {"main": "import llmopt.cli.main",
              "entry": "sys.argv = ['llmopt', '--help']; from llmopt.cli.entry import main; main()"}
# a process under a 1-CPU cgroup quota on 2 CPUs, from fake cgroup files (the module's default paths)
FAKE_QUOTA = ("import llmopt.kernels.threads as t; from pathlib import Path; t.CGROUP_ROOT = Path({root!r}); "
              "t.PROC_SELF_CGROUP = Path({proc!r}); t._affinity = lambda: {{0, 1}}")


@pytest.mark.parametrize("start", CLI_STARTS)
@pytest.mark.parametrize("quota, given, expect", [(True, None, "PASSIVE False"), (True, "active", "active False"),
                                                  (False, None, "None False")])
def test_the_cli_sets_the_wait_policy_before_torch_loads(tmp_path, start, quota, given, expect):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    paths = fake_cgroup(tmp_path, ["0::/"], {"cpu.max": "100000 100000" if quota else "max 100000"})
    setup = FAKE_QUOTA.format(root=str(paths["cgroup_root"]), proc=str(paths["proc_cgroup"]))
    code = (f"import os, sys; {setup}; {CLI_STARTS[start]}; "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == expect, done.stderr


@pytest.fixture
def torch_threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_apply_threads_sets_torchs_pool(torch_threads_kept):
    assert apply_threads(ThreadCount(1, "--threads")) == ThreadCount(1, "--threads")
    assert torch.get_num_threads() == 1
    apply_threads(ThreadCount(2, "affinity"))  # the inter-op pool is fixed by now: no error either way
    assert torch.get_num_threads() == 2


def test_profile_and_offline_bench_use_the_detected_count_by_default(monkeypatch, torch_threads_kept):
    from llmopt.stages.profile import machine

    before = torch.get_num_threads()
    monkeypatch.setattr(machine, "usable_cpus", lambda threads=None: ThreadCount(threads or 1, "affinity"))
    with machine.torch_threads(None) as count:
        assert count == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with machine.torch_threads(2) as count:
        assert count == 2


class FakeProc:
    """A clock and the /proc counters the governor reads, advanced by hand (100 ticks a second)."""

    def __init__(self):
        self.now, self.busy_ticks, self.own_ticks = 0.0, 0, 0

    def advance(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass with `ours` and `others` CPUs' worth of work on our CPUs."""
        self.now += seconds
        self.own_ticks += round(ours * seconds * 100)
        self.busy_ticks += round((ours + others) * seconds * 100)

    def governor(self, count=ThreadCount(2, "affinity")):
        from llmopt.kernels.threads import ThreadGovernor

        self.changes = []
        return ThreadGovernor(count, {0, 1}, interval_s=0.5, clock=lambda: self.now,
                              busy=lambda cpus: self.busy_ticks, own=lambda: self.own_ticks, hz=100,
                              on_change=lambda threads, others: self.changes.append((threads, round(others, 2))))


def test_the_governor_drops_a_thread_while_a_neighbour_holds_a_core_and_comes_back(torch_threads_kept):
    proc = FakeProc()
    governor = proc.governor()
    proc.advance(0.2, ours=2.0, others=0.0)
    assert governor.tick() is None and governor.others() is None  # not a whole interval yet
    proc.advance(0.5, ours=1.0, others=1.0)  # a neighbour starts: one sample is not enough
    assert governor.tick() is None and governor.threads == 2
    proc.advance(0.5, ours=1.0, others=1.0)
    assert governor.tick() == 1 and governor.threads == 1 == torch.get_num_threads()
    proc.advance(0.5, ours=1.0, others=1.0)
    assert governor.tick() is None and governor.threads == 1  # no change, nothing set
    proc.advance(0.5, ours=1.0, others=0.0)
    proc.advance(0.5, ours=1.0, others=0.0)
    assert governor.tick() is None  # the neighbour left: seen once so far (the two advances are one sample)
    proc.advance(0.5, ours=1.0, others=0.0)
    assert governor.tick() == 2 and torch.get_num_threads() == 2
    assert proc.changes == [(1, 1.0), (2, 0.0)]


def test_the_governor_ignores_a_blip_and_light_load(torch_threads_kept):
    proc = FakeProc()
    governor = proc.governor()
    for others in (0.3, 1.0, 0.2, 0.4, 1.2, 0.0):  # never two busy samples in a row
        proc.advance(0.5, ours=2.0, others=others)
        assert governor.tick() is None and governor.threads == 2


def test_a_governor_only_where_our_threads_fill_every_cpu_we_may_use(monkeypatch, torch_threads_kept):
    from llmopt.kernels import threads

    monkeypatch.setattr(threads, "_affinity", lambda: {0, 1})
    torch.set_num_threads(2)
    assert threads.governor_for(ThreadCount(2, "affinity")) is not None
    torch.set_num_threads(1)  # a tensor-parallel rank: the CPUs are shared among the ranks
    assert threads.governor_for(ThreadCount(2, "affinity")) is None
    torch.set_num_threads(2)
    for count in (ThreadCount(1, "affinity"), ThreadCount(2, "--threads"),
                  ThreadCount(1, "cgroup cpu.max 100000/100000")):
        assert threads.governor_for(count) is None


def test_busy_ticks_of_the_cpus_we_may_use(tmp_path):
    from llmopt.kernels.threads import cpu_busy_ticks, own_ticks

    stat = tmp_path / "stat"  # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  30 0 6 900 9 0 0 3 0 0\ncpu0 10 0 2 500 4 0 0 1 0 0\ncpu1 20 0 4 400 5 0 0 2 0 0\n"
                    "intr 5 6\n")
    assert cpu_busy_ticks({0}, stat) == 13 and cpu_busy_ticks({0, 1}, stat) == 39 and cpu_busy_ticks({7}, stat) == 0
    self_stat = tmp_path / "self_stat"
    self_stat.write_text("42 (a (b) c) R 1 42 42 0 -1 4194304 100 0 0 0 250 17 0 0 20 0 3 0 1 1 1\n")
    assert own_ticks(self_stat) == 267
    assert cpu_busy_ticks(set(range(os.cpu_count() or 1))) >= own_ticks() >= 0  # this machine's files parse
