"""quantize and prune record the run's peak resident set (`peak_rss_bytes`) in their artifact's metrics."""
import warnings

from llmopt.stages.artifact import Artifact
from llmopt.stages.prune.config import PruneConfig
from llmopt.stages.prune.run import run_prune
from llmopt.stages.quantize.config import QuantizeConfig
from llmopt.stages.quantize.run import run_quantize


def test_quantize_and_prune_store_their_peak_rss(tiny_hf, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = run_quantize(str(tiny_hf[0]), tmp_path / "q", QuantizeConfig(method="rtn", group_size=16,
                                                                                  eval_windows=0))
    pruned = run_prune(str(tiny_hf[0]), tmp_path / "p", PruneConfig(method="magnitude", sparsity=0.5, eval_windows=0))
    for art in (quantized, pruned):
        metrics = Artifact.open(art.path).manifest["metrics"]
        # at least the process's own footprint (torch alone is far more than the tiny model)
        assert metrics["peak_rss_bytes"] > 50 * 2**20
