"""The router's policies, pure bookkeeping: the prefix tree, round-robin, least-load, cache-aware."""
import pytest

from llmopt.stages.errors import ConfigError
from llmopt.stages.route.config import RouteConfig
from llmopt.stages.route.policy import PrefixTree, Replica, Router


def router(policy: str, n: int = 2, **kw) -> Router:
    config = RouteConfig(tuple(f"http://r{i}" for i in range(n)), policy, **kw)
    return Router([Replica(url) for url in config.replicas], config)


def test_prefix_tree_matches_the_longest_shared_prefix_and_forgets_the_oldest():
    tree = PrefixTree(capacity_chars=30)
    tree.insert("system: be brief#question one")
    assert tree.match("system: be brief#question two") == len("system: be brief#question ")
    assert tree.match("other") == 0 and tree.match("") == 0
    tree.insert("zzzzzzzzzzzz")  # over capacity: the oldest text goes, its path with it
    assert tree.match("system") == 0 and tree.match("zzzz") == 4 and tree.chars == 12
    tree.insert("zzzzzzzzzzzz")  # the same text again: counted once
    assert tree.chars == 12


def test_round_robin_cycles_over_the_healthy_replicas():
    r = router("round-robin", 3)
    assert [r.pick("x").url for _ in range(4)] == ["http://r0", "http://r1", "http://r2", "http://r0"]
    r.replicas[1].healthy = False
    assert {r.pick("x").url for _ in range(4)} == {"http://r0", "http://r2"}
    assert r.pick("x", exclude={"http://r0", "http://r2"}) is None


def test_least_load_reads_the_router_count_and_the_replicas_report():
    r = router("least-load")
    r.replicas[0].in_flight = 2
    assert r.pick("x").url == "http://r1"
    r.replicas[1].reported = 5  # another router's requests, read from the replica's /metrics
    assert r.pick("x").url == "http://r0" and r.last_decision == "least_load"


def test_cache_aware_keeps_a_prefix_on_one_replica_and_spreads_new_ones():
    r = router("cache-aware")
    groups = {g: f"system prompt of group {g}, long enough to matter. " * 4 for g in "ab"}
    first = {g: r.pick(groups[g] + "question 0").url for g in "ab"}
    assert first["a"] != first["b"]  # a new prefix goes to the emptier tree
    for i in range(1, 6):
        for g in "ab":
            assert r.pick(groups[g] + f"question {i}").url == first[g] and r.last_decision == "cache_hit"


def test_cache_aware_falls_back_to_least_load_when_load_is_skewed():
    r = router("cache-aware", balance_abs=2, balance_rel=1.5)
    prompt = "a shared prefix " * 10
    home = r.pick(prompt + "1")
    home.in_flight = 5
    other = r.pick(prompt + "2")
    assert other is not home and r.last_decision == "load_imbalance"


@pytest.mark.parametrize("config, message", [
    (RouteConfig(()), "at least one --replica"), (RouteConfig(("r0:8000",)), "give a URL"),
    (RouteConfig(("http://a", "http://a")), "each replica once"),
    (RouteConfig(("http://a",), "random"), "--policy 'random'")])
def test_bad_configs_are_one_line(config, message):
    with pytest.raises(ConfigError, match=message):
        config.validate()
