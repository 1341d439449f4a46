"""`llmopt run`: a recipe's stages in order, each under WORKDIR/<stage name>, skipped when done.

A stage is done when its record (WORKDIR/.llmopt-run/<name>.json) holds the same key and its output
is intact. The key hashes the stage's kind, its options (defaults filled in) and the content hashes
of its inputs, so editing an option, or a change upstream that alters an artifact's bytes, reruns
exactly the stages it affects; a stage that reproduces the same bytes leaves its followers skipped.
Records are written only after a stage finishes and artifacts are committed atomically, so an
interrupted run resumes at the stage that did not finish.
"""
from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from llmopt.stages.artifact import Artifact, is_artifact, now_iso, sha256_file
from llmopt.stages.errors import ArtifactError, LlmoptError

from .spec import SOURCE, Recipe, RecipeError, StageSpec

RECORDS = ".llmopt-run"
SUMMARY = "summary.json"


class StageFailed(LlmoptError):
    """A stage ran and reported failure (e.g. a bench --fail-on bound); later stages did not run."""


@dataclass
class Planned:
    spec: StageSpec
    action: str  # run | skip
    why: str
    key: str | None = None


@dataclass
class Outcome:
    spec: StageSpec
    action: str  # ran | skipped
    seconds: float
    outputs: list[str] = field(default_factory=list)


def _silent(*args) -> None:
    return None


class View:
    """What the runner tells the person watching; the CLI's ConsoleView renders it. This default says
    nothing (library use, tests). Calls: stage_start(index, total, spec, refs), stage_skip(index, total,
    spec, why), stage_done(spec, seconds), note(message), artifact(spec, art), evaluated(ref, result),
    profiled(report), benched(report)."""

    stage_start = stage_skip = stage_done = note = staticmethod(_silent)
    artifact = evaluated = profiled = benched = staticmethod(_silent)

    @contextmanager
    def hooks(self, spec: StageSpec):
        from llmopt.stages.progress import StageHooks

        yield StageHooks()

    @contextmanager
    def bench_progress(self, total: int):
        yield None


class RecipeRunner:
    def __init__(self, recipe: Recipe, workdir: Path, view: View | None = None):
        self.recipe = recipe
        self.workdir = workdir
        self.view = view or View()
        self._hashes: dict[str, str | None] = {}

    # -- where things live -------------------------------------------------------------------
    def output(self, spec: StageSpec) -> Path:
        return self.workdir / spec.name

    def ref(self, name: str) -> str:
        """What a stage passes to the subcommand for an input name."""
        return self.recipe.source if name == SOURCE else str(self.workdir / name)

    def _record_path(self, spec: StageSpec) -> Path:
        return self.workdir / RECORDS / f"{spec.name}.json"

    # -- planning ----------------------------------------------------------------------------
    def source_hash(self, materialize: bool) -> str | None:
        """The content hash of the source: an artifact's own; a GGUF's cached import (made here when
        `materialize`); for a Hugging Face directory, a hash of its files' names, sizes and mtimes."""
        if SOURCE in self._hashes:
            return self._hashes[SOURCE]
        from llmopt.stages import source as sources

        src = sources.resolve(self.recipe.source)
        if src.kind == "artifact":
            value = Artifact.open(src.path, verify=False).content_hash
        elif src.kind in ("alias", "gguf"):
            cached = sources.import_cache_path(src)
            if is_artifact(cached):
                value = Artifact.open(cached, verify=False).content_hash
            elif materialize:
                self.view.note(f"importing {self.recipe.source} once (cached for later runs)")
                value = sources.as_artifact(src).content_hash
            else:
                return None  # not cached for later: the dry run does not import
        else:
            listing = "".join(f"{p.relative_to(src.path)}\0{p.stat().st_size}\0{p.stat().st_mtime_ns}\n"
                              for p in sorted(src.path.rglob("*")) if p.is_file())
            value = hashlib.sha256(listing.encode()).hexdigest()
        self._hashes[SOURCE] = value
        return value

    def input_hash(self, name: str, materialize: bool) -> str | None:
        if name == SOURCE:
            return self.source_hash(materialize)
        return self._hashes.get(name)

    def key(self, spec: StageSpec, materialize: bool) -> str | None:
        hashes = {n: self.input_hash(n, materialize) for n in spec.inputs}
        if any(h is None for h in hashes.values()):
            return None
        payload = {"kind": spec.kind, "options": spec.options, "inputs": hashes}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    def done(self, spec: StageSpec, key: str | None) -> tuple[bool, str]:
        """Whether the stage's finished output for this key is on disk, and why not."""
        path = self._record_path(spec)
        if key is None:
            return False, "an input is made by this run"
        if not path.is_file():
            return False, "not run yet"
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return False, "its record is unreadable"
        if record.get("key") != key:
            return False, "its options or inputs changed"
        out = self.output(spec)
        if spec.writes_artifact:
            try:
                if Artifact.open(out, verify=False).content_hash != record.get("output_hash"):
                    return False, "its artifact was replaced"
            except (ArtifactError, OSError):
                return False, "its artifact is missing or damaged"
            self._hashes[spec.name] = record["output_hash"]
            return True, "up to date"
        for name, digest in record.get("files", {}).items():
            f = out / name
            if not f.is_file() or sha256_file(f) != digest:
                return False, f"its result {name} is missing or changed"
        return True, "up to date"

    def plan(self, start: str | None = None) -> list[Planned]:
        """What a run would do, without running or importing anything (the dry run)."""
        forced = self._forced(start)
        plan = []
        for spec in self.recipe.stages:
            key = self.key(spec, materialize=False)
            if spec.name in forced:
                ok, why = False, f"--from {start}"
            else:
                ok, why = self.done(spec, key)
            plan.append(Planned(spec, "skip" if ok else "run", why, key))
            if not ok and spec.writes_artifact:
                self._hashes[spec.name] = None  # made by this run: its hash is not known yet
        self._hashes.clear()
        return plan

    def _forced(self, start: str | None) -> set[str]:
        if start is None:
            return set()
        names = [s.name for s in self.recipe.stages]
        if start not in names:
            raise RecipeError(f"--from {start}: no such stage in {self.recipe.path} (stages: {', '.join(names)})")
        return set(names[names.index(start):])

    # -- running -----------------------------------------------------------------------------
    def run(self, start: str | None = None) -> list[Outcome]:
        """Run every stage that is not done (and, with `start`, that stage and all after it)."""
        forced = self._forced(start)
        self.workdir.mkdir(parents=True, exist_ok=True)
        outcomes = []
        total = len(self.recipe.stages)
        for i, spec in enumerate(self.recipe.stages, 1):
            key = self.key(spec, materialize=True)
            if spec.name not in forced:
                ok, why = self.done(spec, key)
                if ok:
                    self.view.stage_skip(i, total, spec, why)
                    outcomes.append(Outcome(spec, "skipped", 0.0))
                    continue
            refs = [self.ref(n) for n in spec.inputs]
            self.view.stage_start(i, total, spec, refs)
            began = time.perf_counter()
            record = self._run_stage(spec, refs)
            seconds = time.perf_counter() - began
            self._write_record(spec, key, record, seconds)
            self.view.stage_done(spec, seconds)
            outcomes.append(Outcome(spec, "ran", seconds, sorted(record.get("files", {}))))
        return outcomes

    def _write_record(self, spec: StageSpec, key: str, record: dict, seconds: float) -> None:
        path = self._record_path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"stage": spec.kind, "name": spec.name, "key": key, "inputs": list(spec.inputs),
                "options": spec.given, "finished": now_iso(), "seconds": round(seconds, 1), **record}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str))
        tmp.replace(path)

    def _run_stage(self, spec: StageSpec, refs: list[str]) -> dict:
        runner = {"quantize": self._quantize, "prune": self._prune, "shard": self._shard, "eval": self._eval,
                  "profile": self._profile, "bench": self._bench}[spec.kind]
        return runner(spec, refs)

    def _artifact_stage(self, spec: StageSpec, make) -> dict:
        with self.view.hooks(spec) as hooks:
            art = make(self.output(spec), hooks)
        self._hashes[spec.name] = art.content_hash
        self.view.artifact(spec, art)
        return {"output_hash": art.content_hash}

    def _quantize(self, spec: StageSpec, refs: list[str]) -> dict:
        from llmopt.stages.model_io import parse_dtype
        from llmopt.stages.quantize.run import run_quantize

        dtype = parse_dtype(spec.options["dtype"])
        return self._artifact_stage(spec, lambda dest, hooks: run_quantize(refs[0], dest, spec.built, dtype=dtype,
                                                                            force=True, hooks=hooks))

    def _prune(self, spec: StageSpec, refs: list[str]) -> dict:
        from llmopt.stages.model_io import parse_dtype
        from llmopt.stages.prune.run import run_prune

        dtype = parse_dtype(spec.options["dtype"])
        return self._artifact_stage(spec, lambda dest, hooks: run_prune(refs[0], dest, spec.built, dtype=dtype,
                                                                         force=True, hooks=hooks))

    def _shard(self, spec: StageSpec, refs: list[str]) -> dict:
        from llmopt.stages.shard.run import run_shard

        return self._artifact_stage(spec, lambda dest, hooks: run_shard(refs[0], dest, spec.built, force=True,
                                                                         hooks=hooks))

    def _eval(self, spec: StageSpec, refs: list[str]) -> dict:
        from llmopt.cli.eval_cmd import stored
        from llmopt.stages import source as sources
        from llmopt.stages.evaluate import evaluate, metric_key
        from llmopt.stages.model_io import parse_dtype

        config, dtype = spec.built, parse_dtype(spec.options["dtype"])
        ref_model = sources.load(config.ref, dtype=dtype).model if config.ref else None
        results = {}
        for name, ref in zip(spec.inputs, refs):
            with self.view.hooks(spec) as hooks:
                hooks.status(f"loading {ref}")
                loaded = sources.load(ref, dtype=dtype)
                result = evaluate(loaded.model, loaded.tokenizer, config, ref_model=ref_model, on_window=hooks.window)
            if loaded.artifact is not None:
                loaded.artifact.update_metrics(metric_key(config), stored(result))
            results[name] = stored(result)
            self.view.evaluated(ref, result)
            del loaded
        return self._write_results(spec, {"eval.json": {"metric": metric_key(config), "results": results}})

    def _profile(self, spec: StageSpec, refs: list[str]) -> dict:
        from llmopt.stages.profile.html import write_report
        from llmopt.stages.profile.run import preflight, run_profile

        preflight(refs, spec.built)
        with self.view.hooks(spec) as hooks:
            report = run_profile(refs, spec.built, hooks)
        report["inputs"] = list(spec.inputs)
        out = self.output(spec)
        out.mkdir(parents=True, exist_ok=True)
        write_report(report, out / "profile.json", out / "profile.html")
        self.view.profiled(report)
        return self._file_record(spec, ["profile.json", "profile.html"])

    def _bench(self, spec: StageSpec, refs: list[str]) -> dict:
        from dataclasses import replace

        from llmopt.cli.bench_cmd import server_spec
        from llmopt.stages.bench.dataset import load_requests, load_tokenizer
        from llmopt.stages.bench.gate import broken_bounds
        from llmopt.stages.bench.report import build_report
        from llmopt.stages.bench.runner import run_bench
        from llmopt.stages.bench.server import running_server

        config, data, bounds = spec.built
        tokenizer = spec.options["tokenizer"]
        requests = load_requests(data, load_tokenizer(tokenizer) if tokenizer else None)
        reports, broken = {}, []
        for name, ref in zip(spec.inputs, refs):
            server = server_spec(ref, spec.options)
            with running_server(server, self.view.note) as base:
                run_config = replace(config, url=base)
                with self.view.bench_progress(len(requests)) as on_result:
                    result = run_bench(run_config, requests, on_result=on_result)
            report = build_report(run_config, data, result, server=server.describe())
            if report["interrupted"]:
                raise KeyboardInterrupt
            reports[f"{name}.json"] = report
            self.view.benched(report)
            broken += [f"{name}: {why}" for why in broken_bounds(bounds, report)]
            if report["completed"] == 0:
                broken.append(f"{name}: no request completed")
        record = self._write_results(spec, reports)
        if broken:
            raise StageFailed(f"stage {spec.name}: " + "; ".join(broken))
        return record

    def _write_results(self, spec: StageSpec, files: dict[str, dict]) -> dict:
        out = self.output(spec)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            tmp = out / f".{name}.tmp"
            tmp.write_text(json.dumps(data, indent=2, default=str))
            tmp.replace(out / name)
        return self._file_record(spec, list(files))

    def _file_record(self, spec: StageSpec, names: list[str]) -> dict:
        out = self.output(spec)
        return {"files": {n: sha256_file(out / n) for n in names}}

    # -- the comparison ----------------------------------------------------------------------
    def summary(self) -> dict:
        """One row per model (the source and every artifact the recipe wrote) with what was measured
        on it: size, perplexity, decode tok/s, bench throughput and p99 latencies."""
        rows = {SOURCE: _model_row(SOURCE, self.recipe.source, "source", self._source_artifact())}
        if rows[SOURCE]["size_bytes"] is None:  # a Hugging Face directory: its safetensors files
            path = Path(self.recipe.source).expanduser()
            rows[SOURCE]["size_bytes"] = sum(f.stat().st_size for f in path.glob("*.safetensors")) or None
        for spec in self.recipe.stages:
            if spec.writes_artifact:
                art = _open(self.output(spec))
                rows[spec.name] = _model_row(spec.name, str(self.output(spec)), _made_by(spec, art), art)
        notes = []
        for spec in self.recipe.stages:
            if spec.writes_artifact:
                continue
            try:
                self._fold(spec, rows, notes)
            except (OSError, json.JSONDecodeError, KeyError):
                notes.append(f"{spec.name}: no results yet")
        return {"recipe": str(self.recipe.path), "workdir": str(self.workdir), "rows": list(rows.values()),
                "notes": notes}

    def _source_artifact(self) -> Artifact | None:
        from llmopt.stages import source as sources

        try:
            src = sources.resolve(self.recipe.source)
            cached = src.path if src.kind == "artifact" else sources.import_cache_path(src)
            return _open(cached) if src.kind != "hf" else None
        except LlmoptError:
            return None

    def _fold(self, spec: StageSpec, rows: dict, notes: list[str]) -> None:
        out = self.output(spec)
        if spec.kind == "eval":
            data = json.loads((out / "eval.json").read_text())
            for name, r in data["results"].items():
                rows[name]["perplexity"] = r["perplexity"]
                p = r["protocol"]
                scope = "all" if r["windows"] == r["windows_available"] else "a subset:"
                rows[name]["perplexity_note"] = (f"{p['name']}, {scope} {r['windows']} of {r['windows_available']} "
                                                 f"windows of {p['seqlen']} tokens")
        elif spec.kind == "profile":
            report = json.loads((out / "profile.json").read_text())
            for name, r in zip(report["inputs"], report["comparison"]):
                rows[name]["decode_tok_s"] = r["decode_tokens_per_s_b1"]
                rows[name]["decode_note"] = "profile: batch 1 decode step"
                if rows[name].get("perplexity") is None and r.get("perplexity") is not None:
                    rows[name]["perplexity"] = r["perplexity"]
                    rows[name]["perplexity_note"] = r.get("perplexity_protocol")
        elif spec.kind == "bench":
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
            "decode_tok_s": None, "output_tok_s": None, "p99_ttft_ms": None, "p99_tpot_ms": None}


def _made_by(spec: StageSpec, art: Artifact | None) -> str:
    o = spec.options
    if spec.kind == "quantize":
        group = "" if o["group_size"] == "auto" else f" g{o['group_size']}"
        return f"{o['method']} {o['scheme']}{group}"
    if spec.kind == "prune":
        if o["structured"]:
            return f"structured {o['structured']} " + (f"ratio {o['ratio']}" if o["ratio"] else f"drop {o['drop']}")
        return f"{o['method'] or 'wanda'} {o['pattern']}"
    return f"shard --tp {o['tp']}"
