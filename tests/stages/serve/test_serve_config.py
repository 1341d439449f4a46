"""Every serve default is defined once: `llmopt serve` / `llmopt generate` build, from their defaults,
exactly ServeConfig()'s config, and their options name no default of their own."""
import ast
import dataclasses
from pathlib import Path

import pytest
import typer

from llmopt.cli.main import app, main
from llmopt.stages.errors import ConfigError
from llmopt.stages.serve.config import DEFAULTS, ServeConfig, TPOptions
from llmopt.stages.serve.engine.config import EngineConfig, SamplingParams
from llmopt.stages.serve.generate import DEFAULT_PARAMS
from llmopt.stages.serve.http.config import ServerConfig

CLI = Path(__file__).parents[3] / "cli"
# options whose default is not a config's: what the command does, not how the engine or server runs
COMMAND_ONLY = {"source", "served_model_name", "prompt", "input", "output", "chat", "stop", "json", "config"}


def cli_defaults(command: str) -> dict:
    params = typer.main.get_command(app).commands[command].params
    return {p.name: p.default for p in params if p.name not in COMMAND_ONLY}


class Built(Exception):
    """Raised by the stand-in for build_engine once it has recorded what it was given."""


@pytest.fixture
def captured(monkeypatch):
    """Records what the serve / generate commands pass to build_engine and serve, loading nothing."""
    import llmopt.stages.serve.build as build
    import llmopt.stages.serve.http.server as server

    calls = {}

    def build_engine(source, config, device="cpu", dtype=None, backend="auto", tp_options=None, **startup):
        calls["engine"] = (config, device, dtype, tp_options)
        calls["backend"] = backend
        raise Built

    def serve(config, loader, startup=None, services=()):
        calls["server"] = config
        with pytest.raises(Built):
            loader()

    monkeypatch.setattr(build, "build_engine", build_engine)
    monkeypatch.setattr(server, "serve", serve)
    return calls


def test_serve_with_no_options_builds_the_default_config(captured, tiny_hf):
    source = str(tiny_hf[0])
    assert main(["serve", source]) == 0
    engine, device, dtype, tp = captured["engine"]
    assert engine == EngineConfig() == DEFAULTS.engine and (device, dtype) == ("cpu", None)
    assert captured["server"] == dataclasses.replace(ServerConfig(), served_model_name=source)  # the name: SOURCE
    assert tp == TPOptions() == DEFAULTS.tp and captured["backend"] == DEFAULTS.backend == "auto"


def test_generate_with_no_engine_options_builds_the_default_engine(captured, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 0, "prompt": "hi"}\n')
    assert main(["generate", "some-model", "-i", str(prompts), "-o", str(tmp_path / "o.jsonl")]) == 1  # stand-in
    engine, device, dtype, _ = captured["engine"]
    assert engine == EngineConfig() == DEFAULTS.engine and (device, dtype) == (DEFAULTS.device, None)
    assert captured["backend"] == DEFAULTS.backend
    # --prompt: the same engine, for its one sequence
    assert main(["generate", "some-model", "--prompt", "hi"]) == 1
    assert captured["engine"][0] == dataclasses.replace(DEFAULTS.engine, max_num_seqs=1)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_commands_defaults_are_serve_configs(command):
    defaults = cli_defaults(command)
    sampling_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    sampling = {k: defaults.pop(k) for k in list(defaults) if k in sampling_fields}
    assert ServeConfig.from_options(defaults) == ServeConfig() == DEFAULTS
    assert command == "serve" or SamplingParams(**sampling) == DEFAULT_PARAMS  # generate's sampling defaults
    if command == "serve":  # every serve option reaches the config; the config's others are library-only
        assert set(defaults) | {"served_model_name"} == set(ServeConfig.options())


@pytest.mark.parametrize("module", ["serve_cmd.py", "generate_cmd.py"])
def test_the_commands_write_no_default_of_their_own(module):
    tree = ast.parse((CLI / module).read_text())
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    args = run.args.args[-len(run.args.defaults):]
    literal = [a.arg for a, d in zip(args, run.args.defaults)
               if a.arg not in COMMAND_ONLY and isinstance(d, ast.Constant)]
    assert not literal, f"{module}: these options repeat a default instead of reading the config: {literal}"


def test_the_parts_hold_their_own_defaults_once():
    assert ServeConfig().engine == EngineConfig() and ServeConfig().server == ServerConfig()
    assert ServeConfig().tp == TPOptions()  # the tensor-parallel launcher reads this same class
    assert EngineConfig().max_num_seqs == 64  # what `llmopt serve` has always used


def test_from_options_maps_cli_names_and_rejects_unknown_ones():
    config = ServeConfig.from_options({"max_num_seqs": 8, "max_num_batched_tokens": 64, "request_timeout": 2.5,
                                       "drain_timeout": 1.0, "port": 9000, "device": "cuda", "dtype": "bf16",
                                       "max_model_len": None, "backend": "triton", "nnodes": 2, "master_port": 29500})
    assert config.engine == EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)
    assert config.server == ServerConfig(request_timeout_s=2.5, drain_timeout_s=1.0, port=9000)
    assert (config.device, config.dtype, config.backend) == ("cuda", "bf16", "triton")
    assert config.tp == TPOptions(nnodes=2, master_port=29500)
    for unknown in ("max_num_seq", "request_timeout_s"):  # the config's field names are not options
        with pytest.raises(ConfigError, match=f"--{unknown.replace('_', '-')}: no such option"):
            ServeConfig.from_options({unknown: 1})


@pytest.mark.parametrize("options, message", [
    ({"max_num_seqs": 64, "max_num_batched_tokens": 8}, "--max-num-batched-tokens"),
    ({"port": 70000}, "--port"),
    ({"dtype": "fp8"}, "--dtype: expected one of auto, fp32, bf16, fp16"),
    ({"backend": "cuda"}, "--backend: expected one of auto, cpu-native"),
])
def test_from_options_validates_on_construction(options, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig.from_options(options)


def test_backend_reaches_the_engine(captured, tiny_hf):
    assert main(["serve", str(tiny_hf[0]), "--backend", "reference"]) == 0
    assert captured["backend"] == "reference"
    assert main(["generate", "some-model", "--prompt", "hi", "--backend", "cpu-torch"]) == 1
    assert captured["backend"] == "cpu-torch"


def test_a_backend_that_cannot_run_here_is_one_line_and_exit_2(tiny_hf, capsys):
    # cpu-native takes fp32 and bf16 only (and needs its native library): the choice fails when the
    # runtime is built, with the reason on one line
    code = main(["generate", str(tiny_hf[0]), "--prompt", "hi", "--dtype", "fp16", "--backend", "cpu-native"])
    err = capsys.readouterr().err
    assert code == 2 and "error: cpu-native: " in " ".join(err.split()), err
    assert "Traceback" not in err
