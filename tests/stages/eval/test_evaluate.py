import math

import pytest
import torch

from llmopt.stages.errors import ConfigError, DataError
from llmopt.stages.eval.config import EvalConfig
from llmopt.stages.eval.measure import evaluate
from llmopt.stages.eval.perplexity import build_text, load_rows, tokenize_windows
from tests.helpers import CORPUS, make_model


def test_rows_follow_the_hf_dataset(tmp_path):
    f = tmp_path / "t.raw"
    f.write_text(" \n = Title = \n \n text line \n")
    assert load_rows(f) == ["", " = Title = \n", "", " text line \n"]
    assert build_text(f) == "\n\n = Title = \n\n\n\n\n text line \n"


def test_windows_drop_the_tail(tiny_hf):
    _, _, tok = tiny_hf
    text = " ".join(CORPUS)
    windows, total = tokenize_windows(tok, text, 16)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert total == len(ids) and windows.shape == (len(ids) // 16, 16)
    assert windows.flatten().tolist() == ids[: windows.numel()]


def _hand_nll(model, window: list[int]) -> float:
    """Next-token NLL by an explicit loop in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([window])).logits[0].double()
    total = 0.0
    for t in range(len(window) - 1):
        row = logits[t]
        total += -(row[window[t + 1]] - torch.logsumexp(row, 0)).item()
    return total / (len(window) - 1)


@pytest.mark.parametrize("chunk_bytes", [16 << 20, 3 * 50 * 4], ids=["one-chunk", "3-rows-a-chunk"])
def test_window_nll_of_a_batch_is_each_windows_mean_next_token_nll(monkeypatch, chunk_bytes):
    from llmopt.stages.eval import perplexity
    from llmopt.stages.eval.perplexity import window_nll

    monkeypatch.setattr(perplexity, "NLL_CHUNK_BYTES", chunk_bytes)  # 27 rows: 9 chunks across the windows

    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(3, 9, 50, generator=g), torch.randint(0, 50, (3, 9), generator=g)
    logp = torch.log_softmax(logits.double(), dim=-1)
    expected = [-sum(logp[b, t, ids[b, t + 1]].item() for t in range(8)) / 8 for b in range(3)]
    assert window_nll(logits, ids).tolist() == pytest.approx(expected, rel=1e-6)


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("\n".join(CORPUS) + "\n")
    return f


def test_perplexity_matches_hand_computation(tiny_hf, text_file):
    _, model, tok = tiny_hf
    cfg = EvalConfig(text=str(text_file), seqlen=24, max_windows=3)
    result = evaluate(model, tok, cfg)
    windows, _ = tokenize_windows(tok, build_text(text_file), 24)
    expected = [_hand_nll(model, w.tolist()) for w in windows[:3]]
    assert result.windows == 3 and result.windows_available == len(windows)
    assert result.window_nll == pytest.approx(expected, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(sum(expected) / 3), rel=1e-5)
    assert result.kl_mean is None


def test_kl_is_zero_against_itself_and_positive_otherwise(tiny_hf, text_file):
    _, model, tok = tiny_hf
    cfg = EvalConfig(text=str(text_file), seqlen=16, max_windows=2)
    assert evaluate(model, tok, cfg, ref_model=model).kl_mean == pytest.approx(0.0, abs=1e-6)
    other = make_model(model.config.vocab_size, seed=1)
    kl = evaluate(model, tok, cfg, ref_model=other).kl_mean
    with torch.no_grad():
        windows, _ = tokenize_windows(tok, build_text(text_file), 16)
        p = torch.log_softmax(model(input_ids=windows[:2]).logits.double(), -1)
        q = torch.log_softmax(other(input_ids=windows[:2]).logits.double(), -1)
        manual = (q.exp() * (q - p)).sum(-1).mean().item()
    assert kl == pytest.approx(manual, rel=1e-4) and kl > 0


def test_bad_inputs(tiny_hf, tmp_path):
    _, model, tok = tiny_hf
    with pytest.raises(ConfigError):
        EvalConfig(seqlen=1).validate()
    with pytest.raises(DataError, match="no such text file"):
        evaluate(model, tok, EvalConfig(text=str(tmp_path / "missing.txt")))
    short = tmp_path / "short.txt"
    short.write_text("a few words\n")
    with pytest.raises(DataError, match="fewer than one window"):
        evaluate(model, tok, EvalConfig(text=str(short), seqlen=512))
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(DataError, match="not UTF-8"):
        evaluate(model, tok, EvalConfig(text=str(binary)))


def test_the_serve_runtime_gives_transformers_perplexity(tiny_hf, text_file):
    """`--runtime serve`: the engine's runner computes each window's logits (one prefill step, every row)."""
    from llmopt.stages.eval.run import run_eval

    path, _, _ = tiny_hf
    base = dict(text=str(text_file), seqlen=24, max_windows=3)
    ours = run_eval(str(path), EvalConfig(**base, runtime="serve"), store=False)
    theirs = run_eval(str(path), EvalConfig(**base), store=False)
    assert ours.window_nll == pytest.approx(theirs.window_nll, rel=1e-5)
    assert EvalConfig(**base, runtime="serve").metric_key().endswith("/serve-runtime")
    with pytest.raises(ConfigError, match="--runtime"):
        EvalConfig(runtime="vllm").validate()
