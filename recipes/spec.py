"""Recipe files: YAML -> a validated Recipe whose stages carry their subcommand's config objects.

A recipe names a source and an ordered list of stages. Each stage is a one-key mapping from the
stage kind to its options, spelled as on the command line (`group-size` or `group_size`):

    source: smollm2-135m
    stages:
      - quantize: {method: gptq, scheme: W4A16, nsamples: 64}
      - eval: {input: [source, quantize], max-windows: 4}

The options a stage accepts, their types and defaults are read from the subcommand itself, and the
subcommand's own builder turns them into its config dataclass, so a recipe and the command line can
never disagree. Every error names the file, the line and the key.
"""
from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import yaml

from llmopt.stages.errors import ConfigError

ARTIFACT_KINDS = ("prune", "quantize", "shard")  # stages that write a new model artifact
KINDS = (*ARTIFACT_KINDS, "eval", "profile", "bench")
MULTI_INPUT = ("eval", "profile", "bench")  # measurement stages may take several inputs
TOP_KEYS = ("name", "description", "source", "workdir", "stages")
STAGE_KEYS = ("name", "input")  # every stage: its name (default: the kind) and what it reads
SOURCE = "source"  # the input name of the recipe's source
# Command-line parameters that a recipe sets itself (paths, display) and so does not take.
EXCLUDED = {
    "quantize": {"source", "output", "force", "json"},
    "prune": {"source", "output", "force", "json"},
    "shard": {"source", "output", "force", "json"},
    "eval": {"source", "store", "json"},
    "profile": {"sources", "json_file", "html_file", "per_layer"},
    "bench": {"ctx", "url", "server", "model", "api_key", "json", "plot", "quiet"},
}
BUILTIN_DIR = Path(__file__).resolve().parent


REQUIRED = inspect.Parameter.empty  # an option the subcommand cannot do without (shard --tp)


class RecipeError(ConfigError):
    """A recipe that cannot run as written; the message starts with file:line."""


@dataclass(frozen=True)
class Option:
    name: str  # python name, e.g. group_size
    kind: type  # bool | int | float | str | list | an Enum
    optional: bool
    default: object


@dataclass
class StageSpec:
    kind: str
    name: str
    inputs: tuple[str, ...]
    options: dict  # every option of the subcommand, defaults filled in
    given: dict  # what the recipe wrote (normalized names), for display and hashing
    line: int
    built: object = None  # the subcommand's config object(s)

    @property
    def writes_artifact(self) -> bool:
        return self.kind in ARTIFACT_KINDS


@dataclass
class Recipe:
    path: Path
    name: str
    description: str
    source: str
    workdir: str | None
    stages: list[StageSpec] = field(default_factory=list)

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise RecipeError(f"{self.path}: no stage named {name!r} (stages: {', '.join(s.name for s in self.stages)})")


def resolve_path(ref: str) -> Path:
    """A recipe file, or the name of a built-in recipe (`smollm2-w4a16-gptq`)."""
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    builtin = BUILTIN_DIR / f"{ref.removesuffix('.yaml')}.yaml"
    if "/" not in ref and builtin.is_file():
        return builtin
    known = ", ".join(sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml")))
    raise RecipeError(f"{ref}: no such recipe file, and not a built-in recipe (built-in: {known})")


def load_recipe(ref: str | Path) -> Recipe:
    """Read and validate a recipe: every stage's options are checked and built into config objects."""
    path = resolve_path(str(ref))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read the recipe ({e.__class__.__name__}: {e})") from None
    return parse_recipe(text, path)


def parse_recipe(text: str, path: Path) -> Recipe:
    loader = _Loader(text)
    loader.name = str(path)
    try:
        doc = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}{line}: not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from None
    finally:
        loader.dispose()
    if not isinstance(doc, _Map):
        raise RecipeError(f"{path}:1: a recipe is a mapping with source: and stages:")
    where = _Where(path)
    where.unknown(doc, TOP_KEYS, "recipe")
    for key in ("source", "stages"):
        if key not in doc:
            raise RecipeError(f"{path}:{doc.line}: the recipe needs a {key}: key")
    source = where.typed(doc, "source", str, "recipe")
    stages = doc["stages"]
    if not isinstance(stages, list) or not stages:
        raise RecipeError(f"{path}:{doc.lines['stages']}: stages: must be a non-empty list of stages")
    recipe = Recipe(path=path, name=str(doc.get("name") or path.stem), description=str(doc.get("description") or ""),
                    source=source, workdir=where.typed(doc, "workdir", str, "recipe") if "workdir" in doc else None)
    names, producers = {SOURCE}, [SOURCE]
    for i, item in enumerate(stages):
        spec = _stage(item, i, doc.lines["stages"], where, names, producers)
        names.add(spec.name)
        if spec.writes_artifact:
            producers.append(spec.name)
        recipe.stages.append(spec)
    return recipe


def _stage(item, index: int, list_line: int, where: "_Where", seen: set[str], producers: list[str]) -> StageSpec:
    if not isinstance(item, _Map) or len(item) != 1:
        line = item.line if isinstance(item, _Map) else list_line
        raise RecipeError(f"{where.path}:{line}: stage {index + 1}: write one stage as `- KIND: {{options}}` "
                          f"with KIND one of {', '.join(KINDS)}")
    kind = next(iter(item))
    line = item.lines[kind]
    if kind not in KINDS:
        raise RecipeError(f"{where.path}:{line}: unknown stage {kind!r}; choose one of {', '.join(KINDS)}")
    body = item[kind]
    if body is None:
        body = _Map()
        body.line = line
    if not isinstance(body, _Map):
        raise RecipeError(f"{where.path}:{line}: stage {kind}: its options must be a mapping (key: value)")
    body = where.normalized(body)
    label = f"stage {kind}"
    name = where.typed(body, "name", str, label) if "name" in body else kind
    label = f"stage {name}"
    if name in seen:
        raise RecipeError(f"{where.path}:{line}: {label}: the name is taken; give this stage a name: key")
    inputs = _inputs(body, kind, label, where, producers)
    schema = options_of(kind)
    where.unknown(body, (*STAGE_KEYS, *schema), label, hint=f"see llmopt {kind} --help")
    given = {k: where.coerce(body, k, schema[k], label) for k in body if k not in STAGE_KEYS}
    options = {k: o.default for k, o in schema.items()} | given
    missing = [k.replace("_", "-") for k, v in options.items() if v is REQUIRED]
    if missing:
        raise RecipeError(f"{where.path}:{line}: {label}: needs {', '.join(f'{m}:' for m in missing)}")
    spec = StageSpec(kind=kind, name=name, inputs=inputs, options=options, given=given, line=line)
    try:
        spec.built = build(kind, options)
    except RecipeError:
        raise
    except ConfigError as e:  # the subcommand's own validation, e.g. "--group-size must be ..."
        raise RecipeError(f"{where.path}:{_line_of(str(e), body, line)}: {label}: {e}") from None
    return spec


def _line_of(message: str, body: "_Map", default: int) -> int:
    """The line of the first option the message names as --flag, else the stage's line."""
    for key in body:
        if f"--{key.replace('_', '-')}" in message:
            return body.lines[key]
    return default


def _inputs(body: "_Map", kind: str, label: str, where: "_Where", producers: list[str]) -> tuple[str, ...]:
    if "input" not in body:
        return (producers[-1],)  # the latest artifact, or the source
    raw = body["input"]
    names = [raw] if isinstance(raw, str) else raw
    line = body.lines["input"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise RecipeError(f"{where.path}:{line}: {label}: input must be a stage name or a list of them")
    if len(names) > 1 and kind not in MULTI_INPUT:
        raise RecipeError(f"{where.path}:{line}: {label}: a {kind} stage reads one input (got {len(names)})")
    for n in names:
        if n not in producers:
            raise RecipeError(f"{where.path}:{line}: {label}: input {n!r} is neither the source nor an earlier "
                              f"stage that writes a model (known: {', '.join(producers)})")
    if len(set(names)) != len(names):
        raise RecipeError(f"{where.path}:{line}: {label}: an input is listed twice")
    return tuple(names)


def options_of(kind: str) -> dict[str, Option]:
    """The options of `llmopt KIND` as a recipe takes them: names, types and defaults from the command."""
    func = _command(kind)
    hints = typing.get_type_hints(func, include_extras=True)
    result = {}
    for name, param in inspect.signature(func).parameters.items():
        if name in EXCLUDED[kind]:
            continue
        kind_, optional = _base_type(hints[name])
        default = param.default.value if isinstance(param.default, Enum) else param.default
        if default is inspect.Parameter.empty:
            default = REQUIRED
        result[name] = Option(name, kind_, optional, default)
    return result


def build(kind: str, options: dict):
    """The subcommand's validated config object(s) for these options."""
    module = _module(kind)
    built = module.build_config(options)
    if kind == "bench":  # the server is started on each input; check its options now
        module.server_spec("placeholder", options)
    return built


def _command(kind: str):
    return _module(kind).run


def _module(kind: str):
    from llmopt.cli import bench_cmd, eval_cmd, profile_cmd, prune_cmd, quantize_cmd, shard_cmd

    return {"quantize": quantize_cmd, "prune": prune_cmd, "shard": shard_cmd, "eval": eval_cmd,
            "profile": profile_cmd, "bench": bench_cmd}[kind]


def _base_type(hint) -> tuple[type, bool]:
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is list:
        return list, optional
    return hint, optional


class _Where:
    """Error messages with file and line, and the type checks behind them."""

    def __init__(self, path: Path):
        self.path = path

    def normalized(self, body: "_Map") -> "_Map":
        out = _Map()
        out.line = body.line
        for key, value in body.items():
            if not isinstance(key, str):
                raise RecipeError(f"{self.path}:{body.lines[key]}: option names are words, not {key!r}")
            name = key.replace("-", "_")
            if name in out:
                raise RecipeError(f"{self.path}:{body.lines[key]}: {key} is given twice")
            out[name] = value
            out.lines[name] = body.lines[key]
        return out

    def unknown(self, body: "_Map", known, label: str, hint: str = "") -> None:
        for key in body:
            if key not in known:
                shown = ", ".join(k.replace("_", "-") for k in known)
                raise RecipeError(f"{self.path}:{body.lines[key]}: {label}: unknown key "
                                  f"{str(key).replace('_', '-')!r} (known: {shown}{'; ' + hint if hint else ''})")

    def typed(self, body: "_Map", key: str, kind: type, label: str):
        return self.coerce(body, key, Option(key, kind, False, None), label)

    def coerce(self, body: "_Map", key: str, opt: Option, label: str):
        value, line = body[key], body.lines[key]
        where = f"{self.path}:{line}: {label}: {key.replace('_', '-')}"
        if value is None:
            if opt.optional:
                return None
            raise RecipeError(f"{where}: needs a value")
        k = opt.kind
        if isinstance(k, type) and issubclass(k, Enum):
            allowed = [e.value for e in k]
            if value not in allowed:
                raise RecipeError(f"{where}: expected one of {', '.join(allowed)} (got {value!r})")
            return value
        if k is bool:
            if isinstance(value, bool):
                return value
            raise RecipeError(f"{where}: expected true or false (got {value!r})")
        if k is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise RecipeError(f"{where}: expected a whole number (got {value!r})")
        if k is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise RecipeError(f"{where}: expected a number (got {value!r})")
        if k is list:
            items = [value] if isinstance(value, str) else value
            if isinstance(items, list) and all(isinstance(v, str) for v in items):
                return list(items)
            raise RecipeError(f"{where}: expected a string or a list of strings (got {value!r})")
        if k is str:
            if isinstance(value, str):
                return value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)  # group-size: 64, request-rate: 2.5
            if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return ",".join(map(str, value))  # prompt-lens: [128, 512]
            if isinstance(value, _Map) and value and all(isinstance(v, (int, float)) for v in value.values()):
                return ",".join(f"{a}={b}" for a, b in value.items())  # slo: {ttft_ms: 500}
            raise RecipeError(f"{where}: expected a string (got {value!r})")
        raise RecipeError(f"{where}: unsupported option type {k!r}")  # pragma: no cover - a new CLI option type


class _Map(dict):
    """A YAML mapping that remembers the line of each key (1-based)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.lines: dict = {}
        self.line = 1


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Map:
    loader.flatten_mapping(node)
    result = _Map()
    result.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            hash(key)
        except TypeError:
            raise RecipeError(f"{loader.name}:{line}: a key must be a plain word") from None
        if key in result:
            raise RecipeError(f"{loader.name}:{line}: {key} is given twice")
        result[key] = loader.construct_object(value_node, deep=True)
        result.lines[key] = line
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
