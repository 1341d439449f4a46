"""A tiny dense Llama (HF directory) and its RTN W4A16 artifact, profiled once per session."""
import warnings

import pytest

from llmopt.stages.profile.config import ProfileConfig
from tests.helpers import write_hf_dir
from tests.stages.serve.conftest import one_thread  # noqa: F401  (autouse: tiny models run faster on one thread)

# Small enough to run in seconds; the 512-token prompt exceeds the tiny model's 256 positions on purpose.
# threads=1: run_profile pins one thread while it measures and restores the caller's count after.
TINY = ProfileConfig(prompt_lens=(8, 32, 512), batch_sizes=(1, 2, 16), context_lens=(8, 64), decode_context=24,
                     repeats=1, decode_steps=2, profile_steps=2, block_size=8, copy_mib=8, top_ops=60, threads=1,
                     memory_budget="64MiB", plan_context=128, target_tpot_ms=1000.0)
PPL = {"protocol": "wikitext2 test, seqlen 2048, first 2 windows", "before": 10.0, "after": 12.5,
       "increase_pct": 25.0}


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory):
    """(dense HF dir, W4A16 artifact dir); hidden 64 so the int4 CPU kernel takes every projection."""
    from llmopt.stages.artifact import Artifact
    from llmopt.stages.quantize.config import QuantizeConfig
    from llmopt.stages.quantize.run import run_quantize

    root = tmp_path_factory.mktemp("profile")
    write_hf_dir(root / "base", hidden=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = run_quantize(str(root / "base"), root / "w4",
                           QuantizeConfig(method="rtn", scheme="W4A16", group_size=32, eval_windows=0))
    Artifact.open(art.path).update_metrics("perplexity_before_after", PPL)
    return str(root / "base"), str(art.path)


@pytest.fixture(scope="session")
def report(tiny_sources):
    from llmopt.stages.profile.run import run_profile

    return run_profile(list(tiny_sources), TINY)
