"""scripts/calib_domains.py: its runs, the share of RTN's increase it reports per set, and how it reads
`llmopt eval --json`. The comparison itself quantizes once per calibration and takes an hour at 128 x 2048:
`make quality-domains`."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "calib_domains.py"
spec = importlib.util.spec_from_file_location("calib_domains", SCRIPT)
calib_domains = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calib_domains)


def test_the_old_default_runs_first_and_each_mix_once():
    args = calib_domains.parse_args(["base", "--calib", "wikitext2-valid:0.3,sharegpt:0.5,code:0.2",
                                     "--calib", "wikitext2-valid", "--nsamples", "32"])
    names = [name for name, _ in calib_domains.runs(args)]
    assert names == ["rtn", "gptq-wikitext2-valid", "gptq-wikitext2-valid-0.3_sharegpt-0.5_code-0.2"]
    options = dict(calib_domains.runs(args))["gptq-wikitext2-valid-0.3_sharegpt-0.5_code-0.2"]
    assert options[options.index("--calib") + 1] == "wikitext2-valid:0.3,sharegpt:0.5,code:0.2"
    assert options[options.index("--nsamples") + 1] == "32"


def test_table_gives_each_sets_share_of_rtns_increase_and_the_worst():
    scores = {"base": {"wikitext2": 10.0, "code": 4.0, "chat": 8.0},
              "rtn": {"wikitext2": 14.0, "code": 6.0, "chat": 12.0},
              "gptq-a": {"wikitext2": 11.0, "code": 5.0, "chat": 10.0}}
    lines = calib_domains.table(scores, {"rtn": "none", "gptq-a": "a"}, {"gptq-a": 60}).splitlines()
    assert lines[2].startswith("| base |") and lines[3].startswith("| rtn | none |")
    assert lines[4] == "| gptq-a | a | 11.0000 | 75% | 5.0000 | 50% | 10.0000 | 50% | 50% | 60 |"
    assert calib_domains.removed(10.0, 10.0, 11.0) is None  # RTN added nothing: no share to give


def test_eval_output_is_read_per_set_and_a_missing_set_is_named():
    out = {s: {"perplexity": p, "windows": 1} for s, p in zip(calib_domains.SETS, (12.5, 3.25, 9.0))}
    assert calib_domains.parse_perplexities(json.dumps(out)) == {"wikitext2": 12.5, "code": 3.25, "chat": 9.0}
    del out["chat"]
    with pytest.raises(SystemExit, match="no result for chat"):
        calib_domains.parse_perplexities(json.dumps(out))


def test_a_score_is_reused_only_for_the_same_artifact_and_windows(tmp_path, monkeypatch):
    calls = []

    def measure(path, windows):
        calls.append(windows)
        return {s: float(len(calls)) for s in calib_domains.SETS}

    monkeypatch.setattr(calib_domains, "perplexities", measure)
    art = tmp_path / "a"
    art.mkdir()
    (art / "llmopt.json").write_text('{"stage": "quantize"}')
    cache = art / "eval-w4.json"
    first = calib_domains.cached_perplexities(art, 4, cache)
    assert calib_domains.cached_perplexities(art, 4, cache) == first and calls == [4]
    assert calib_domains.cached_perplexities(art, 8, cache)["code"] == 2.0  # other windows: measured again
    (art / "llmopt.json").write_text('{"stage": "quantize", "method": "gptq"}')  # re-quantized: measured again
    assert calib_domains.cached_perplexities(art, 8, cache)["code"] == 3.0 and calls == [4, 8, 8]
    cache.write_text("{not json")
    assert calib_domains.cached_perplexities(art, 8, cache)["code"] == 4.0
