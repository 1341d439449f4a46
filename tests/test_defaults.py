"""Every default is defined once, in the stage's config: the command line and a recipe build the same
config from their defaults, and each command's options are exactly its stage's, named, typed and
defaulted alike, so the two can never drift apart."""
import inspect
import typing
from enum import Enum
from pathlib import Path

import pytest

from llmopt.cli import bench_cmd, eval_cmd, profile_cmd, prune_cmd, quantize_cmd, serve_cmd, shard_cmd
from llmopt.cli.main import main
from llmopt.recipes.spec import parse_recipe
from llmopt.stages import registry
from llmopt.stages.bench.stage import BenchStageConfig
from llmopt.stages.eval.config import EvalConfig
from llmopt.stages.offline.config import SHARED, OfflineConfig
from llmopt.stages.options import Options, flag
from llmopt.stages.profile.config import ProfileConfig
from llmopt.stages.prune.config import PruneConfig
from llmopt.stages.quantize.config import QuantizeConfig
from llmopt.stages.serve.config import ServeConfig
from llmopt.stages.shard.config import ShardConfig

# kind: (the command, its entry point a run reaches, the command line with only what it requires, the
# recipe stage with only what it requires, the config's own defaults)
CASES = {
    "quantize": (quantize_cmd.run, "llmopt.stages.quantize.run.run_quantize", ["quantize", "SRC", "-o", "OUT"],
                 "quantize:", QuantizeConfig()),
    "prune": (prune_cmd.run, "llmopt.stages.prune.run.run_prune", ["prune", "SRC", "-o", "OUT"], "prune:",
              PruneConfig()),
    "shard": (shard_cmd.run, "llmopt.stages.shard.run.run_shard", ["shard", "SRC", "-o", "OUT"], "shard:",
              ShardConfig()),
    "eval": (eval_cmd.run, "llmopt.stages.eval.run.run_evals", ["eval", "SRC"], "eval:", EvalConfig()),
    "profile": (profile_cmd.run, "llmopt.stages.profile.run.run_profile", ["profile", "SRC"], "profile:",
                ProfileConfig()),
    "bench": (bench_cmd.run, "llmopt.stages.bench.run.bench_source", ["bench", "--server", "SRC"], "bench:",
              BenchStageConfig()),
}
# What a command takes that is no part of what its stage computes: sources, output, display.
CLI_ONLY = {
    "quantize": {"source", "output", "force", "json"},
    "prune": {"source", "output", "force", "json"},
    "shard": {"source", "output", "force", "json"},
    "eval": {"source", "store", "json"},
    "profile": {"sources", "json_file", "html_file", "per_layer"},
    "bench": {"ctx", "url", "grpc", "server", "offline", "model", "api_key", "json", "plot", "quiet",
              # vLLM's spellings, folded into --dataset and --slo, and where --save-result writes
              "dataset_path", "goodput", "save_result", "result_dir", "result_filename"},
    "serve": {"ctx", "source", "config"},  # --config FILE: values for the other options
}


def command_schema(kind: str) -> Options:
    """The options a command takes: its stage's; `llmopt bench` also takes --offline's own (after them)."""
    schema = registry.stage(kind).options
    if kind != "bench":
        return schema
    return Options(*schema.values(), *(o for o in OfflineConfig.options().values() if o.name not in schema))


# Each command and the options it takes. serve is no recipe stage: tests/stages/serve/test_serve_config.py
# checks that the config it builds from its defaults is ServeConfig's own.
COMMANDS = {kind: (case[0], command_schema(kind)) for kind, case in CASES.items()}
COMMANDS["serve"] = (serve_cmd.run, ServeConfig.options())


class Captured(Exception):
    """Raised by a stand-in entry point, carrying the config the command built."""


def _capture(config_class):
    def entry_point(*args, **kwargs):
        raise Captured(next(a for a in (*args, *kwargs.values()) if isinstance(a, config_class)))
    return entry_point


def _cli_config(kind: str, source: str, tmp_path: Path, monkeypatch):
    import importlib

    _, target, argv, _, defaults = CASES[kind]
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(module), name, _capture(type(defaults)))
    monkeypatch.setattr("llmopt.stages.profile.run.preflight", lambda sources, config: None)
    monkeypatch.setattr("llmopt.stages.bench.run.load_bench_requests", lambda config: [])
    argv = [source if a == "SRC" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(Captured) as caught:
        main(["--debug", *argv])
    return caught.value.args[0]


@pytest.mark.parametrize("kind", list(CASES))
def test_the_command_line_a_recipe_and_the_config_default_alike(kind, tiny_hf, tmp_path, monkeypatch):
    *_, body, defaults = CASES[kind]
    recipe = parse_recipe(f"source: {tiny_hf[0]}\nstages:\n  - {body}\n", tmp_path / "r.yaml")
    assert recipe.stages[0].built == defaults
    assert _cli_config(kind, str(tiny_hf[0]), tmp_path, monkeypatch) == defaults


def _base_type(hint) -> tuple[type, bool]:
    """(the type a command's parameter holds, whether it may be None)."""
    hint = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) is typing.Union and len(args) < len(typing.get_args(hint))
    hint = args[0] if optional else hint
    return (list if typing.get_origin(hint) is list else hint), optional


@pytest.mark.parametrize("kind", list(COMMANDS))
def test_each_commands_options_are_its_stages(kind):
    command, schema = COMMANDS[kind]
    params = inspect.signature(command).parameters
    hints = typing.get_type_hints(command, include_extras=True)
    assert CLI_ONLY[kind] <= set(params)
    assert [n for n in params if n not in CLI_ONLY[kind]] == list(schema)  # the same options, in the same order
    for option in schema.values():
        name = option.name
        kind_, optional = _base_type(hints[name])
        default = params[name].default
        if isinstance(default, Enum):
            default = default.value
        assert default == (inspect.Parameter.empty if option.required else option.default), name
        if isinstance(kind_, type) and issubclass(kind_, Enum):
            assert option.kind is str and tuple(e.value for e in kind_) == option.choices, name
        else:
            assert kind_ is option.kind, name
        assert optional == option.optional, name
        assert flag(name) in _spellings(kind)[name], (name, _spellings(kind)[name])


def test_bench_offline_builds_the_offline_configs_defaults(tiny_hf, monkeypatch):
    monkeypatch.setattr("llmopt.stages.offline.run.run_offline", _capture(OfflineConfig))
    with pytest.raises(Captured) as caught:
        main(["--debug", "bench", "--offline", str(tiny_hf[0])])
    assert caught.value.args[0] == OfflineConfig()
    for name in SHARED:  # the prompt and sampling options are the online bench's own, defaults and all
        assert OfflineConfig.options()[name] is BenchStageConfig.options()[name]


def _spellings(kind: str) -> dict[str, list[str]]:
    """How the command line spells each parameter of `llmopt KIND` (as click parses it)."""
    import typer

    from llmopt.cli.main import app

    command = typer.main.get_command(app).commands[kind]
    return {p.name: p.opts for p in command.params}


def test_shard_needs_no_option():
    """--tp and --pp default to 1, once, in ShardConfig: `llmopt shard SRC -o OUT` writes one rank, as --tp 1 does."""
    assert not any(o.required for o in registry.stage("shard").options.values())
    assert (ShardConfig().tp, ShardConfig().pp, ShardConfig().to_dict()) == (1, 1, {"tp": 1})
    assert inspect.signature(shard_cmd.run).parameters["tp"].default == ShardConfig().tp
