"""A recipe's comparison: one row per model (the source and every artifact the recipe wrote) with what
its stages measured on it, read back from the work directory: size, perplexity, decode tok/s, bench
throughput and p99 latencies."""
from __future__ import annotations

import json
from pathlib import Path

from llmopt.stages.artifact import Artifact, safetensors_bytes
from llmopt.stages.errors import ArtifactError, LlmoptError

from .spec import SOURCE, Recipe, StageSpec

MAIN_TEXT = "wikitext2"  # the text whose perplexity a row shows first; the others' follow it (perplexity_sets)


def summarize(recipe: Recipe, workdir: Path) -> dict:
    """The comparison of every model of `recipe` run under `workdir` (stages not run yet are noted)."""
    rows = {SOURCE: _model_row(SOURCE, recipe.source, "source", _source_artifact(recipe.source))}
    if rows[SOURCE]["size_bytes"] is None:  # a Hugging Face directory: its safetensors files
        rows[SOURCE]["size_bytes"] = safetensors_bytes(Path(recipe.source).expanduser()) or None
    for spec in recipe.stages:
        if spec.writes_artifact:
            path = workdir / spec.name
            rows[spec.name] = _model_row(spec.name, str(path), made_by(spec), _open(path))
    notes = []
    for spec in recipe.stages:
        if spec.writes_artifact:
            continue
        try:
            FOLD[spec.kind](spec, workdir / spec.name, rows)
        except (OSError, json.JSONDecodeError, KeyError):
            notes.append(f"{spec.name}: no results yet")
    return {"recipe": str(recipe.path), "workdir": str(workdir), "rows": list(rows.values()), "notes": notes}


def made_by(spec: StageSpec) -> str:
    """The stage that made an artifact, in a few words (`gptq W4A16 g64`, `shard --tp 2`)."""
    c = spec.built
    if spec.kind == "quantize":
        return f"{c.method} {c.scheme}" + ("" if c.group_size is None else f" g{c.group_size}")
    if spec.kind == "prune" and c.structured:
        return f"structured {c.structured} " + (f"ratio {c.ratio}" if c.ratio else f"drop {c.drop}")
    if spec.kind == "prune":
        return f"{c.method_name} {c.pattern}"
    return f"shard --tp {c.tp}" + (f" --pp {c.pp}" if c.pp > 1 else "")


def _source_artifact(ref: str) -> Artifact | None:
    from llmopt.stages import source as sources

    try:
        src = sources.resolve(ref)
        cached = src.path if src.kind == "artifact" else sources.import_cache_path(src)
        return _open(cached) if src.kind != "hf" else None
    except LlmoptError:
        return None


def _fold_eval(spec: StageSpec, out: Path, rows: dict) -> None:
    """Each input's perplexity on the first text (WikiText-2 where it was measured) and on the others."""
    data = json.loads((out / "eval.json").read_text())
    for name, found in data["results"].items():
        # {text: record}; an eval.json written before eval took several texts holds one record per input
        by_text = found if "metrics" in data else {data["metric"].split("/")[1]: found}
        main = MAIN_TEXT if MAIN_TEXT in by_text else next(iter(by_text))
        r, p = by_text[main], by_text[main]["protocol"]
        rows[name]["perplexity"] = r["perplexity"]
        scope = "all" if r["windows"] == r["windows_available"] else "a subset:"
        of = "" if main == MAIN_TEXT else f" of {main}"
        rows[name]["perplexity_note"] = (f"{p['name']}, {scope} {r['windows']} of {r['windows_available']} "
                                         f"windows of {p['seqlen']} tokens{of}")
        rows[name]["perplexity_sets"] = {text: v["perplexity"] for text, v in by_text.items() if text != main}


def _fold_profile(spec: StageSpec, out: Path, rows: dict) -> None:
    report = json.loads((out / "profile.json").read_text())
    for name, r in zip(report["inputs"], report["comparison"]):
        rows[name]["decode_tok_s"] = r["decode_tokens_per_s_b1"]
        rows[name]["decode_note"] = "profile: batch 1 decode step"
        if rows[name].get("perplexity") is None and r.get("perplexity") is not None:
            rows[name]["perplexity"] = r["perplexity"]
            rows[name]["perplexity_note"] = r.get("perplexity_protocol")
            rows[name]["perplexity_sets"] = r.get("perplexity_sets") or {}


def _fold_bench(spec: StageSpec, out: Path, rows: dict) -> None:
    for name in spec.inputs:
        report = json.loads((out / f"{name}.json").read_text())
        row = rows[name]
        row["bench"] = spec.name
        row["output_tok_s"] = report["output_throughput"]
        row["p99_ttft_ms"] = report["p99_ttft_ms"]
        row["p99_tpot_ms"] = report["p99_tpot_ms"]
        row["bench_note"] = (f"{report['completed']} requests, {report['dataset']}, concurrency "
                             f"{report.get('max_concurrency') or 'unlimited'}")
        if row.get("decode_tok_s") is None and report.get("median_tpot_ms"):
            row["decode_tok_s"] = 1000.0 / report["median_tpot_ms"]
            row["decode_note"] = "bench: 1000 / median TPOT, per stream under load"


FOLD = {"eval": _fold_eval, "profile": _fold_profile, "bench": _fold_bench}  # each measuring stage's results


def _open(path: Path) -> Artifact | None:
    try:
        return Artifact.open(path, verify=False)
    except (ArtifactError, OSError):
        return None


def _model_row(name: str, ref: str, made_by: str, art: Artifact | None) -> dict:
    size = None
    if art is not None:
        size = sum(e["bytes"] for f, e in art.manifest["files"].items() if f.endswith(".safetensors"))
    return {"name": name, "ref": ref, "made_by": made_by, "size_bytes": size, "perplexity": None,
            "perplexity_sets": {}, "decode_tok_s": None, "output_tok_s": None, "p99_ttft_ms": None, "p99_tpot_ms": None}
