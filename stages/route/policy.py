"""Which replica takes a request: round-robin, least-load, or cache-aware (longest cached prefix).

Cache-aware keeps, per replica, a prefix tree over the prompt texts it was sent (characters, as SGLang's router
does: the router has no tokenizer, and equal texts make equal token prefixes). A request goes to the replica
whose tree matches the longest prefix of its text, if that covers at least `match_ratio` of it; else to the
least loaded replica, the one whose tree holds the least among equals (spreading new prefixes); and whenever load is skewed (the busiest replica
has `balance_abs` more requests in flight than the idlest and `balance_rel` times as many) to the least loaded.
Each tree keeps its most recent `tree_chars` characters of prompts (the replica's own cache forgets too).
"""
from __future__ import annotations

import itertools
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
    reported: int = 0  # running + waiting requests in its own /metrics at the last health check
    tree: "PrefixTree" = field(default_factory=lambda: PrefixTree(0))

    @property
    def load(self) -> int:
        """Requests it is working on: the router's own count, or what it reports (other routers' too)."""
        return max(self.in_flight, self.reported)


class PrefixTree:
    """Prompt texts sent to one replica, as a character trie with counts; the oldest texts leave first."""

    def __init__(self, capacity_chars: int):
        self.root: list = [0, {}]  # a node: [texts through it, {character: child node}]
        self.capacity = capacity_chars
        self.texts: OrderedDict[str, int] = OrderedDict()  # text -> times inserted, oldest first
        self.chars = 0

    def match(self, text: str) -> int:
        """Length of the longest prefix of `text` that some inserted text shares."""
        node, n = self.root, 0
        for ch in text:
            node = node[1].get(ch)
            if node is None:
                break
            n += 1
        return n

    def insert(self, text: str) -> None:
        if text in self.texts:
            self.texts.move_to_end(text)
            self.texts[text] += 1
            return
        self.texts[text] = 1
        self.chars += len(text)
        self._walk(text, +1)
        while self.capacity and self.chars > self.capacity and len(self.texts) > 1:
            old, _ = self.texts.popitem(last=False)
            self.chars -= len(old)
            self._walk(old, -1)

    def _walk(self, text: str, delta: int) -> None:
        """Add or remove one text's path; a node no text passes through any more goes, with its subtree."""
        node = self.root
        for ch in text:
            child = node[1].setdefault(ch, [0, {}]) if delta > 0 else node[1][ch]
            child[0] += delta
            if child[0] == 0:
                del node[1][ch]
                return
            node = child


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
        if text and best >= self.config.match_ratio * len(text):
            return replica, "cache_hit"
        return min(live, key=lambda r: (r.load, r.tree.chars)), "cache_miss"  # load first, then the emptier tree
