"""ProfileConfig: validation of what users type, round trips, the --quick preset."""
import pytest

from llmopt.stages.errors import ConfigError
from llmopt.stages.profile.config import QUICK, ProfileConfig, parse_int_list


@pytest.mark.parametrize("options, message", [
    (dict(prompt_lens=()), "--prompt-lens"),
    (dict(prompt_lens=(128, 0)), "--prompt-lens"),
    (dict(batch_sizes=(4, 8)), "must include 1"),
    (dict(context_lens=(-5,)), "--context-lens"),
    (dict(decode_steps=0), "--decode-steps"),
    (dict(copy_mib=0), "--copy-mib"),
    (dict(device="tpu"), "--device"),
    (dict(dtype="int3"), "--dtype"),
    (dict(threads=0), "--threads"),
    (dict(target_tpot_ms=-1.0), "--target-tpot-ms"),
    (dict(memory_budget="lots"), "--memory-budget"),
])
def test_bad_options_raise_config_errors_that_name_the_option(options, message):
    with pytest.raises(ConfigError, match=message):
        ProfileConfig(**options).validate()


def test_round_trip_and_defaults_validate():
    config = ProfileConfig(prompt_lens=(16, 64), memory_budget="8GiB", target_tpot_ms=50.0)
    config.validate()
    assert ProfileConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="unknown profile option"):
        ProfileConfig.from_dict({**config.to_dict(), "batch": 3})


def test_quick_preset_and_explicit_options_win():
    quick = ProfileConfig.quick(prompt_lens=(64,), threads=None)
    assert quick.prompt_lens == (64,) and quick.batch_sizes == QUICK["batch_sizes"]
    assert quick.copy_mib < ProfileConfig().copy_mib and quick.decode_steps < ProfileConfig().decode_steps
    assert ProfileConfig().with_options(decode_context=None, repeats=7).repeats == 7


@pytest.mark.parametrize("text, expected", [("1,4,16", (1, 4, 16)), ("128 512", (128, 512)), (None, None),
                                            (" 2048 ", (2048,))])
def test_parse_int_list(text, expected):
    assert parse_int_list(text, "--x") == expected


@pytest.mark.parametrize("text", ["", "a,b", "1,-2", "0", "1.5"])
def test_parse_int_list_rejects_garbage(text):
    with pytest.raises(ConfigError, match="--batch-sizes"):
        parse_int_list(text, "--batch-sizes")
