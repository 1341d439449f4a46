"""The router's policies, pure bookkeeping: the prefix tree, round-robin, least-load, cache-aware."""
import random
from collections import Counter

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
    tree.insert("zzzzzzzzzzzz")  # the same text again: its characters counted once, its path now reused
    assert tree.chars == 12 and tree.shared == 12


def test_prefix_tree_counts_reused_characters_and_forgets_one_prompt():
    tree = PrefixTree(capacity_chars=0)
    tree.insert("sys prompt|q1")
    assert tree.shared == 0 and tree.through("sys") == 1
    tree.insert("sys prompt|q2")
    assert tree.shared == len("sys prompt|q") and tree.through("sys prompt|") == 2
    tree.insert("other")
    tree.forget("oth")  # the one prompt beginning with it: gone, nothing else touched
    assert tree.match("other") == 0 and tree.chars == 2 * len("sys prompt|q1") and tree.shared == 12
    tree.forget("sys prompt|q2")
    assert tree.shared == 0 and tree.through("sys prompt|") == 1 and tree.match("sys prompt|q2") == 12


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
    r.replicas[1].report(5)  # another router's requests, read from the replica's /metrics
    assert r.pick("x").url == "http://r0" and r.last_decision == "least_load"
    r.replicas[0].report(2)  # only ours: nothing added, and a stale report never outlives our own count
    assert r.replicas[0].load == 2
    r.replicas[0].in_flight = 0
    assert r.replicas[0].load == 0


def test_cache_aware_keeps_a_prefix_on_one_replica_and_spreads_new_ones():
    r = router("cache-aware")
    groups = {g: f"system prompt of group {g}, long enough to matter. " * 4 for g in "ab"}
    first = {g: r.pick(groups[g] + "question 0").url for g in "ab"}
    assert first["a"] != first["b"]  # equal load: a new prefix goes to the emptier tree
    for i in range(1, 6):
        for g in "ab":
            assert r.pick(groups[g] + f"question {i}").url == first[g] and r.last_decision == "cache_hit"


def test_a_cache_miss_goes_by_load():
    r = router("cache-aware")
    r.replicas[0].in_flight = 1
    for i in range(4):  # unrelated prompts: the idler replica, whatever the trees hold
        assert r.pick(f"{i} unrelated prompt number {i}").url == "http://r1" and r.last_decision == "cache_miss"


def test_a_prefix_settles_where_the_least_reused_text_is_cached_when_it_first_comes_again():
    r = router("cache-aware")
    groups = {g: f"system prompt of group {g}, long enough to matter. " * 4 for g in "abc"}
    r0 = r.replicas[0]
    r.replicas[1].in_flight = 3  # busy: every new prefix lands on r0 at first
    for g in "abc":
        assert r.pick(groups[g] + "question 0") is r0
    assert r.pick(groups["a"] + "question 1") is r0 and r.last_decision == "cache_hit"  # caches even so far: stays
    # b comes again: r0 already holds a's reused prefix, r1 nothing reused: b moves (its one prompt forgotten on r0)
    moved = r.pick(groups["b"] + "question 1")
    assert moved is r.replicas[1] and r.last_decision == "cache_rebalance"
    assert r0.tree.match(groups["b"]) == len("system prompt of group ")  # what a and c share with it
    assert r.pick(groups["b"] + "question 2") is moved and r.last_decision == "cache_hit"  # and stays there
    assert r.pick(groups["c"] + "question 1") is r0  # even again (a on r0, b on r1): c stays where it is
    assert r.pick(groups["a"] + "question 2") is r0 and r.last_decision == "cache_hit"  # settled: never moved again


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


def test_prefix_tree_agrees_with_a_brute_force_model():
    """Random inserts (repeats too), evictions and forgets on a two-letter alphabet (many splits and shared
    edges): match, through, chars and shared equal what the kept texts give when counted character by character."""
    rng = random.Random(0)
    for _ in range(200):
        tree = PrefixTree(rng.choice([0, 20, 60]))
        pool = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for _ in range(8)]
        for _ in range(30):
            once = [t for t in tree.texts if tree.through(t[:max(1, len(t) // 2)]) == 1]
            if once and rng.random() < 0.2:
                t = rng.choice(once)
                tree.forget(t[:max(1, len(t) // 2)])
            else:
                tree.insert(rng.choice(pool))
            through = Counter()
            for text, times in tree.texts.items():
                for k in range(1, len(text) + 1):
                    through[text[:k]] += times
            assert tree.shared == sum(n >= 2 for n in through.values())
            assert tree.chars == sum(map(len, tree.texts))
            for q in [*pool, "abab", "b"]:
                assert tree.through(q) == through[q]
                assert tree.match(q) == max(k for k in range(len(q) + 1) if k == 0 or through[q[:k]])
