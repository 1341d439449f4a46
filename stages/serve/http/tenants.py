"""Tenants: the keys of `llmopt serve --api-keys-file`, each with its own limits.

The file is YAML (JSON, being YAML, reads as well): a mapping with one key, `keys`, a list of entries

    keys:
      - key: sk-team-a-...          # required: the bearer token
        name: team-a                # optional: the `tenant` label; default key-<8 hex of its sha256>
        max_concurrency: 4          # optional: requests in flight at once
        tokens_per_minute: 100000   # optional: prompt + generated tokens, refilled evenly over a minute

Light on purpose (no FastAPI): the CLI reads it while it builds ServeConfig. The key never appears in a
repr, a message or a label.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ...errors import ConfigError

FIELDS = ("key", "name", "max_concurrency", "tokens_per_minute")


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str = field(repr=False)
    max_concurrency: int | None = None
    tokens_per_minute: int | None = None


def default_name(key: str) -> str:
    """A stable name that does not reveal the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def read_tenants(path: str) -> tuple[Tenant, ...]:
    """The tenants of --api-keys-file `path`; a one-line ConfigError naming the file and entry otherwise."""
    import yaml

    where = f"--api-keys-file {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e.__class__.__name__
        raise ConfigError(f"{where}: cannot read it ({reason})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(e).split())})") from None
    entries = data.get("keys") if isinstance(data, dict) and set(data) == {"keys"} else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: expected a mapping with one key, 'keys', holding a non-empty list of entries")
    tenants = tuple(_tenant(entry, f"{where}: entry {i}") for i, entry in enumerate(entries, 1))
    _check_unique(tenants, where)
    return tenants


def _tenant(entry, where: str) -> Tenant:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with 'key' and optional {', '.join(FIELDS[1:])}")
    unknown = [str(k) for k in entry if k not in FIELDS]
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}")
    key = entry.get("key")
    if not isinstance(key, str) or not key.strip() or any(c.isspace() for c in key):
        raise ConfigError(f"{where}: 'key' must be a non-empty string without whitespace")
    name = entry.get("name", default_name(key))
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: 'name' must be a non-empty string")
    limits = {f: entry.get(f) for f in FIELDS[2:]}
    for f, value in limits.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where} ({name}): {f!r} must be a whole number >= 1 (got {value!r})")
    return Tenant(name, key, **limits)


def _check_unique(tenants: tuple[Tenant, ...], where: str) -> None:
    keys, names = set(), set()
    for i, tenant in enumerate(tenants, 1):
        if tenant.key in keys:
            raise ConfigError(f"{where}: entry {i} ({tenant.name}) repeats the key of an earlier entry")
        if tenant.name in names:
            raise ConfigError(f"{where}: entry {i} repeats the name {tenant.name!r}; give each tenant its own")
        keys.add(tenant.key)
        names.add(tenant.name)
