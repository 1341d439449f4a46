"""Mask selection (unstructured, N:M), Wanda's score, and the prune config's validation."""
import pytest
import torch

from llmopt.stages.calib import CalibConfig
from llmopt.stages.errors import ConfigError
from llmopt.stages.prune.config import PruneConfig, parse_pattern
from llmopt.stages.prune.masks import InputNorms, magnitude_mask, nm_mask, prune_count, unstructured_mask, wanda_mask


def test_unstructured_counts_are_exact():
    scores = torch.rand(7, 40, generator=torch.Generator().manual_seed(0))
    for sparsity in (0.0, 0.29, 0.5, 0.9):
        rows = unstructured_mask(scores, sparsity, per_row=True)
        assert (rows.sum(1) == prune_count(sparsity, 40)).all()
        whole = unstructured_mask(scores, sparsity, per_row=False)
        assert whole.sum() == prune_count(sparsity, 280)
        if whole.any():
            assert scores[whole].max() <= scores[~whole].min()  # the lowest scores go
    assert prune_count(0.29, 100) == 29  # not 28 from 28.999999999999996


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (1, 4)])
def test_nm_keeps_the_n_largest_in_each_group(n, m):
    scores = torch.rand(5, 32, generator=torch.Generator().manual_seed(1))
    mask = nm_mask(scores, n, m)
    groups, kept = scores.reshape(5, -1, m), (~mask).reshape(5, -1, m)
    assert (kept.sum(-1) == n).all()
    lowest_kept = groups.masked_fill(~kept, float("inf")).amin(-1)
    highest_pruned = groups.masked_fill(kept, float("-inf")).amax(-1)
    assert (lowest_kept > highest_pruned).all()


def test_wanda_picks_weights_by_weight_times_input_norm():
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                      [-4.0, 3.0, -2.0, 1.0]])
    norms = InputNorms(4)
    # inputs with column norms 10, 1, 1, 0.1 (sum of squares over 4 tokens: 100, 1, 1, 0.01)
    norms.add(torch.tensor([[5.0, 0.5, 0.5, 0.05]]).expand(4, 4))
    assert torch.allclose(norms.norm, torch.tensor([10.0, 1.0, 1.0, 0.1]))
    # scores: row 0 = 10, 2, 3, 0.4 -> prune columns 3 and 1; row 1 = 40, 3, 2, 0.1 -> columns 3 and 2
    mask = wanda_mask(w, norms.norm, 0.5, None)
    assert mask.tolist() == [[False, True, False, True], [False, False, True, True]]
    # magnitude alone would prune the small weights next to the loud input instead
    assert magnitude_mask(w, 0.5, None)[0, 0]
    # 1:2 groups of columns (0, 1) and (2, 3): row 0 keeps 0 and 2, row 1 keeps 0 and 2
    assert wanda_mask(w, norms.norm, 0.5, (1, 2)).tolist() == [[False, True, False, True], [False, True, False, True]]


def test_input_norms_accumulate_over_batches():
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    acc = InputNorms(8)
    acc.add(x[:1])
    acc.add(x[1:])
    assert torch.allclose(acc.norm, x.reshape(-1, 8).norm(dim=0), atol=1e-5)
    assert acc.tokens == 15


@pytest.mark.parametrize("kw, message", [
    (dict(sparsity=1.0), r"\[0, 1\)"),
    (dict(sparsity=-0.1), r"\[0, 1\)"),
    (dict(method="random"), "unknown --method"),
    (dict(pattern="4:2"), "0 < N < M"),
    (dict(pattern="two:four"), "unstructured or N:M"),
    (dict(pattern="2:4", sparsity=0.6), "prunes 0.5"),
    (dict(structured="mlp"), "needs --ratio"),
    (dict(structured="mlp", ratio=1.0), "needs --ratio"),
    (dict(structured="layers", drop=0), "--drop K >= 1"),
    (dict(structured="layers", drop=1, method="wanda"), "drop --method"),
    (dict(structured="heads", ratio=0.5), "unknown --structured"),
    (dict(ratio=0.5), "go with --structured"),
    (dict(method="sparsegpt", calib=CalibConfig("wikitext2")), "test split"),
])
def test_bad_config_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        PruneConfig(**kw).validate()


def test_config_defaults_and_record():
    assert PruneConfig().method_name == "wanda" and PruneConfig().target_sparsity == 0.5
    assert PruneConfig(pattern="1:4").target_sparsity == 0.75
    assert parse_pattern("unstructured") is None and parse_pattern("4:8") == (4, 8)
    PruneConfig(method="magnitude", calib=CalibConfig("wikitext2")).validate()  # magnitude ignores calibration
    record = PruneConfig(method="magnitude", ignore=("down_proj",)).to_dict()
    assert "calib" not in record and record["ignore"] == ["down_proj"] and record["sparsity"] == 0.5
    assert PruneConfig(structured="layers", drop=2).to_dict()["method"] == "structured-layers"
