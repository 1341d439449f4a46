"""Recipe files: YAML -> a validated Recipe whose stages carry their stage's config objects.

A recipe names a source and an ordered list of stages. Each stage is a one-key mapping from the
stage kind to its options, spelled as on the command line (`group-size` or `group_size`):

    source: smollm2-135m
    stages:
      - quantize: {method: gptq, scheme: W4A16, nsamples: 64}
      - eval: {input: [source, quantize], max-windows: 4}

The options a stage accepts, their types and defaults are the stage's own (stages.registry), and the
stage builds its config from them, as it does for the command line, so a recipe and the command
line can never disagree. Every error names the file, the line and the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llmopt.stages import registry
from llmopt.stages.errors import ConfigError
from llmopt.stages.options import Option, OptionError

KINDS = registry.KINDS
TOP_KEYS = ("name", "description", "source", "workdir", "stages")
STAGE_KEYS = ("name", "input")  # every stage: its name (default: the kind) and what it reads
SOURCE = "source"  # the input name of the recipe's source
BUILTIN_DIR = Path(__file__).resolve().parent


class RecipeError(ConfigError):
    """A recipe that cannot run as written; the message starts with file:line."""


@dataclass
class StageSpec:
    kind: str
    name: str
    inputs: tuple[str, ...]
    options: dict  # every option of the stage, defaults filled in
    given: dict  # what the recipe wrote (normalized names), for display and hashing
    line: int
    built: object = None  # the stage's config

    @property
    def writes_artifact(self) -> bool:
        return registry.stage(self.kind).writes_artifact


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


def default_workdir(recipe: Recipe) -> Path:
    """Where `llmopt run` works without -o: the recipe's workdir:, else out/<recipe name> (make demo too)."""
    return Path(recipe.workdir or Path("out") / recipe.name)


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
    """The validated recipe in `text` (`path` names it in errors)."""
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
    stage = registry.stage(kind)
    schema = stage.options
    where.unknown(body, (*STAGE_KEYS, *schema), label, hint=f"see llmopt {kind} --help")
    given = {k: where.coerce(body, k, schema[k], label) for k in body if k not in STAGE_KEYS}
    missing = [k.replace("_", "-") for k in schema if schema[k].required and k not in given]
    if missing:
        raise RecipeError(f"{where.path}:{line}: {label}: needs {', '.join(f'{m}:' for m in missing)}")
    try:
        built = stage.build(given)
    except ConfigError as e:  # the stage's own validation, e.g. "--group-size must be ..."
        raise RecipeError(f"{where.path}:{_line_of(str(e), body, line)}: {label}: {e}") from None
    return StageSpec(kind=kind, name=name, inputs=inputs, options=schema.complete(given), given=given, line=line,
                     built=built)


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
    if len(names) > 1 and not registry.stage(kind).multi_input:
        raise RecipeError(f"{where.path}:{line}: {label}: a {kind} stage reads one input (got {len(names)})")
    for n in names:
        if n not in producers:
            raise RecipeError(f"{where.path}:{line}: {label}: input {n!r} is neither the source nor an earlier "
                              f"stage that writes a model (known: {', '.join(producers)})")
    if len(set(names)) != len(names):
        raise RecipeError(f"{where.path}:{line}: {label}: an input is listed twice")
    return tuple(names)


def _as_given(value, option: Option):
    """YAML's conveniences, spelled as the command line gives the option."""
    if option.kind is list and isinstance(value, str):
        return [value]  # serve-args: "--max-num-seqs 8"
    if option.kind is not str or option.choices:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # group-size: 64, request-rate: 2.5
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return ",".join(map(str, value))  # prompt-lens: [128, 512]
    if isinstance(value, _Map) and value and all(isinstance(v, (int, float)) for v in value.values()):
        return ",".join(f"{a}={b}" for a, b in value.items())  # slo: {ttft_ms: 500}
    return value


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
        return self.coerce(body, key, Option(key, kind), label)

    def coerce(self, body: "_Map", key: str, option: Option, label: str):
        """The value of `key` as the stage's option takes it; the error names file, line and key."""
        try:
            return option.check(_as_given(body[key], option))
        except OptionError as e:
            raise RecipeError(f"{self.path}:{body.lines[key]}: {label}: {key.replace('_', '-')}: {e.problem}") from None


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
