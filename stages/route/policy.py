"""Which replica takes a request: round-robin, least-load, or cache-aware (longest cached prefix).

Cache-aware keeps, per replica, a prefix tree over the prompt texts it was sent (characters, as SGLang's router
does: the router has no tokenizer, and equal texts make equal token prefixes). A request goes to the replica
whose tree matches the longest prefix of its text, if that covers at least `match_ratio` of it (`cache_hit`).
A request no tree matches so far (`cache_miss`) goes to the least loaded replica: nothing says yet whether its
prefix will come again, and unrelated prompts are best spread by load. The first time a prefix does come again
it has earned a place in a cache, and settles where the caches hold the least reused text (`cache_rebalance`,
one prefill again when that is elsewhere), so recurring prefixes spread evenly whatever the load was when each
first came. Whenever load is skewed (the busiest replica has more than `balance_abs` requests in flight beyond
the idlest's, and more than `balance_rel` times the idlest's + 1) a request goes to the least loaded
(`load_imbalance`): each one sent away from its prefix's replica recomputes the prefix there and evicts another.
SGLang's router instead sends a miss to the smallest tree, which costs throughput when no prefix recurs
(docs/route.md has the measurements behind these rules and the defaults). Each tree keeps its most recent
`tree_chars` characters of prompts (the replica's own cache forgets too).
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from .config import RouteConfig


@dataclass
class Replica:
    """A replica as the router sees it: health, load, and what it was sent (cache-aware)."""

    url: str
    healthy: bool = True
    failed_checks: int = 0
    in_flight: int = 0  # requests the router has open on it
    others: int = 0  # requests not from this router: its /metrics' running + waiting beyond ours, at the last check
    tree: "PrefixTree" = field(default_factory=lambda: PrefixTree(0))

    def report(self, running_and_waiting: int) -> None:
        """The replica's own count from its /metrics: what exceeds ours came from elsewhere (another router)."""
        self.others = max(0, running_and_waiting - self.in_flight)

    @property
    def load(self) -> int:
        """Requests it is working on: the router's own count, exact and current, plus the others' as last read
        (the report alone lags by up to a health interval: requests finished since would still count)."""
        return self.in_flight + self.others


def common_length(label: str, text: str, start: int) -> int:
    """How many leading characters of `label` equal `text` from `start` on (string compares run in C)."""
    if text.startswith(label, start):
        return len(label)
    lo, hi = 0, min(len(label), len(text) - start)  # lo always matches; find the largest that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(label[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """Prompt texts sent to one replica, as a radix tree with counts; the oldest texts leave first.

    A node is [prompts through it, {first character: child}, the edge's characters]: a request costs a few
    string compares per branch, not a Python step per character (a 2,600-character prompt: 0.05 ms, not 2).
    `shared` counts the characters that two or more of its prompts went through: the part of what the replica
    was sent that was sent again, so its cache holds it for a reason (a system prompt, a conversation's earlier
    turns). Unrelated prompts share little more than a first word."""

    def __init__(self, capacity_chars: int):
        self.root: list = [0, {}, ""]
        self.capacity = capacity_chars
        self.texts: OrderedDict[str, int] = OrderedDict()  # text -> times inserted, oldest first
        self.chars = 0  # characters of the distinct texts kept
        self.shared = 0  # characters with two or more prompts through them

    def _descend(self, text: str):
        """Yield (child, matched characters of its edge, position in `text` after them) down `text`'s path."""
        node, i = self.root, 0
        while i < len(text):
            child = node[1].get(text[i])
            if child is None:
                return
            k = common_length(child[2], text, i)
            i += k
            yield child, k, i
            if k < len(child[2]):
                return
            node = child

    def match(self, text: str) -> int:
        """Length of the longest prefix of `text` that some inserted text shares."""
        return max((end for _, _, end in self._descend(text)), default=0)  # the walk only goes deeper

    def through(self, prefix: str) -> int:
        """Prompts inserted that begin with `prefix` (0 if none)."""
        for child, _, end in self._descend(prefix):
            if end == len(prefix):
                return child[0]
        return 0

    def insert(self, text: str) -> None:
        if text in self.texts:
            self.texts.move_to_end(text)
            self.texts[text] += 1
        else:
            self.texts[text] = 1
            self.chars += len(text)
        self._add(text)
        while self.capacity and self.chars > self.capacity and len(self.texts) > 1:
            old, times = self.texts.popitem(last=False)
            self.chars -= len(old)
            self._remove(old, times)

    def forget(self, prefix: str) -> None:
        """Drop the one prompt that begins with `prefix` (its count is 1: a single chain below it)."""
        parts, node = [], self.root
        for node, _, end in self._descend(prefix):
            parts.append(node[2])
        while node[1]:
            (node,) = node[1].values()
            parts.append(node[2])
        text = "".join(parts)
        times = self.texts.pop(text)
        self.chars -= len(text)
        self._remove(text, times)

    def _count(self, node: list, delta: int) -> None:
        before = node[0]
        node[0] += delta
        self.shared += len(node[2]) * ((node[0] >= 2) - (before >= 2))

    def _add(self, text: str) -> None:
        node, i = self.root, 0
        while i < len(text):
            child = node[1].get(text[i])
            if child is None:
                node[1][text[i]] = leaf = [0, {}, text[i:]]
                self._count(leaf, 1)
                return
            k = common_length(child[2], text, i)
            if k < len(child[2]):  # split the edge where the text leaves it
                head = [child[0], {child[2][k]: child}, child[2][:k]]
                child[2] = child[2][k:]
                node[1][text[i]] = child = head
            self._count(child, 1)
            node, i = child, i + k

    def _remove(self, text: str, times: int) -> None:
        """Take `times` prompts off `text`'s path; a node no prompt goes through any more goes, with its subtree."""
        node, i = self.root, 0
        while i < len(text):
            child = node[1][text[i]]
            self._count(child, -times)
            if child[0] == 0:  # the rest of the path below is this text's alone: one chain, `times` each
                del node[1][text[i]]
                while child[1]:
                    (child,) = child[1].values()
                    self._count(child, -times)
                return
            node, i = child, i + len(child[2])


def least_loaded(replicas: list[Replica]) -> Replica:
    return min(replicas, key=lambda r: r.load)


class Router:
    """Picks a healthy replica per request under the configured policy."""

    def __init__(self, replicas: list[Replica], config: RouteConfig):
        self.replicas, self.config = replicas, config
        for r in replicas:
            r.tree = PrefixTree(config.tree_chars)
        self._turn = itertools.count()
        self.last_decision = ""  # why the last pick went where it did (the router's metrics count these)

    def healthy(self, exclude: set[str] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.url not in exclude]

    def pick(self, text: str, exclude: set[str] = frozenset()) -> Replica | None:
        """The replica for a request whose prompt is `text` (None: no healthy one outside `exclude`)."""
        live = self.healthy(exclude)
        if not live:
            return None
        policy = self.config.policy
        if policy == "round-robin":
            choice, why = live[next(self._turn) % len(live)], "round_robin"
        elif policy == "least-load" or self._skewed(live):
            choice, why = least_loaded(live), "least_load" if policy == "least-load" else "load_imbalance"
        else:
            choice, why = self._by_cache(live, text)
        if policy == "cache-aware":
            choice.tree.insert(text)
        self.last_decision = why
        return choice

    def _skewed(self, live: list[Replica]) -> bool:
        busy, idle = max(r.load for r in live), min(r.load for r in live)
        return busy - idle > self.config.balance_abs and busy > self.config.balance_rel * (idle + 1)

    def _by_cache(self, live: list[Replica], text: str) -> tuple[Replica, str]:
        matches = [(r.tree.match(text), -r.load, r) for r in live]
        best, _, replica = max(matches, key=lambda m: (m[0], m[1]))
        needed = math.ceil(self.config.match_ratio * len(text))  # the match that makes a hit
        if not text or best < max(1, needed):
            # A miss goes by load: nothing says yet whether this prompt's prefix will come again.
            return min(live, key=lambda r: (r.load, r.tree.chars)), "cache_miss"
        if replica.tree.through(text[:needed]) == 1:
            # The first time a prefix comes again: it is worth a cache, so it settles where the caches hold the
            # least reused text, unless it is there already (one prefill again, against a replica whose cache
            # takes more than its share of recurring prefixes for the rest of the run).
            home = min(live, key=lambda r: (r.tree.shared, r.load))
            if replica.tree.shared - home.tree.shared >= len(text) / 2:
                replica.tree.forget(text[:needed])
                return home, "cache_rebalance"
        return replica, "cache_hit"
