"""A stage's options: unknown names rejected with the known ones listed, values type-checked, the
config's defaults for what is not given, and each config built back from its options (round trip)."""
import pytest

from llmopt.stages import registry
from llmopt.stages.errors import ConfigError
from llmopt.stages.options import Option, OptionError, Options
from llmopt.stages.prune.config import PruneConfig
from llmopt.stages.quantize.config import QuantizeConfig

SCHEMA = Options(Option("tp", int), Option("rate", float, 1.0), Option("name", str, None, optional=True),
                 Option("fast", bool, False), Option("args", list, None, optional=True),
                 Option("dtype", str, "auto", choices=("auto", "fp32")))


def test_missing_options_take_the_defaults_and_required_ones_are_named():
    assert SCHEMA.complete({"tp": 2}) == {"tp": 2, "rate": 1.0, "name": None, "fast": False, "args": None,
                                          "dtype": "auto"}
    with pytest.raises(ConfigError, match="--tp is required"):
        SCHEMA.complete({})
    assert SCHEMA.defaults.rate == 1.0 and SCHEMA["tp"].required and not SCHEMA["rate"].required


def test_unknown_options_are_named_with_the_known_ones():
    with pytest.raises(OptionError, match=r"--nsampels: no such option \(known: tp, rate, name, fast, args, dtype\)"):
        SCHEMA.complete({"tp": 1, "nsampels": 3})


@pytest.mark.parametrize("given, expect", [
    ({"tp": "2"}, "--tp: expected a whole number (got '2')"),
    ({"tp": True}, "--tp: expected a whole number (got True)"),
    ({"tp": 1, "rate": "fast"}, "--rate: expected a number (got 'fast')"),
    ({"tp": 1, "fast": 1}, "--fast: expected true or false (got 1)"),
    ({"tp": 1, "name": 3}, "--name: expected a string (got 3)"),
    ({"tp": 1, "args": [1]}, "--args: expected a string or a list of strings (got [1])"),
    ({"tp": 1, "dtype": "fp64"}, "--dtype: expected one of auto, fp32 (got 'fp64')"),
    ({"tp": None}, "--tp: needs a value"),
])
def test_values_are_type_checked(given, expect):
    with pytest.raises(OptionError) as e:
        SCHEMA.complete(given)
    assert str(e.value) == expect


def test_values_are_held_as_the_option_holds_them():
    values = SCHEMA.complete({"tp": 1, "rate": 2, "args": ("a", "b"), "name": None})
    assert values["rate"] == 2.0 and isinstance(values["rate"], float) and values["args"] == ["a", "b"]


def test_an_option_kind_is_one_the_command_line_and_recipes_share():
    with pytest.raises(TypeError):
        Option("x", dict)


@pytest.mark.parametrize("kind", registry.KINDS)
def test_every_config_builds_from_its_defaults(kind):
    stage = registry.stage(kind)
    given = {"tp": 2} if kind == "shard" else {}
    config = stage.build(given)
    assert type(config) is stage.config
    assert stage.build(stage.options.complete(given)) == config  # every option given as its default: the same


def test_from_options_maps_the_command_line_names_onto_the_config():
    config = QuantizeConfig.from_options({"group_size": "64", "asym": True, "alpha": 0.7, "nsamples": 16,
                                          "ignore": ["lm_head"], "scheme": "w4a16"})
    assert (config.group_size, config.symmetric, config.smoothing_alpha, config.calib.nsamples) == (64, False, 0.7, 16)
    assert config.ignore == ("lm_head",) and config.scheme == "W4A16"
    assert QuantizeConfig.from_options({"group_size": "auto"}).group_size is None
    assert QuantizeConfig.from_options({"group_size": "-1"}).group_size == -1
    with pytest.raises(ConfigError, match="--group-size must be auto, -1 or a power of two"):
        QuantizeConfig.from_options({"group_size": "48"})
    assert PruneConfig.from_options({"structured": "layers", "drop": 2}).drop == 2
    with pytest.raises(ConfigError, match="--structured layers needs --drop"):
        PruneConfig.from_options({"structured": "layers"})


def test_the_registry_knows_each_stage_and_refuses_others():
    assert registry.KINDS == ("prune", "quantize", "shard", "eval", "profile", "bench")
    assert [k for k in registry.KINDS if registry.stage(k).writes_artifact] == ["prune", "quantize", "shard"]
    assert registry.stage("eval").run.__name__ == "run_evals"
    with pytest.raises(ConfigError, match="unknown stage 'serve'; choose one of prune, quantize"):
        registry.stage("serve")
