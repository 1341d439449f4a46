"""Reading /metrics in tests with prometheus_client's own parser."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> list:
    """Every sample of the exposition text (prometheus_client Sample tuples: name, labels, value)."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels`."""
    found = [s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{len(found)} samples {name}{labels}"
    return found[0]
