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

from llmopt.stages import registry
from llmopt.stages.artifact import Artifact, is_artifact, now_iso, sha256_file
from llmopt.stages.errors import ArtifactError, LlmoptError

from .spec import SOURCE, Recipe, RecipeError, StageSpec
from .summary import summarize

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
    nothing (library use, tests). Calls: stage_start(index, total, spec, refs, output), stage_skip(index, total,
    spec, why), stage_done(spec, seconds), note(message), artifact(spec, art), evaluated(ref, {text: result}),
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
            if all(self._hashes.get(n) is not None for n in spec.inputs if n != SOURCE):
                return False, "its source is not imported yet (the run imports it once, cached)"
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
            self.view.stage_start(i, total, spec, refs, self.output(spec))
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
        stage = registry.stage(spec.kind)
        if stage.writes_artifact:
            return self._artifact_stage(spec, stage.run, refs[0])
        return {"eval": self._eval, "profile": self._profile, "bench": self._bench}[spec.kind](spec, stage.run, refs)

    def _artifact_stage(self, spec: StageSpec, run, ref: str) -> dict:
        with self.view.hooks(spec) as hooks:
            art = run(ref, self.output(spec), spec.built, force=True, hooks=hooks)
        self._hashes[spec.name] = art.content_hash
        self.view.artifact(spec, art)
        return {"output_hash": art.content_hash}

    def _eval(self, spec: StageSpec, run_evals, refs: list[str]) -> dict:
        """eval.json: {"metrics": {text: metric key}, "results": {input: {text: result record}}}."""
        from llmopt.stages.eval.run import load_reference

        config = spec.built
        reference, results = load_reference(config), {}
        for name, ref in zip(spec.inputs, refs):
            with self.view.hooks(spec) as hooks:
                measured = run_evals(ref, config, hooks, reference=reference)
            results[name] = {text: result.record() for text, result in measured.items()}
            self.view.evaluated(ref, measured)
        metrics = {one.text: one.metric_key() for one in config.split()}
        return self._write_results(spec, {"eval.json": {"metrics": metrics, "results": results}})

    def _profile(self, spec: StageSpec, run_profile, refs: list[str]) -> dict:
        from llmopt.stages.profile.html import write_report
        from llmopt.stages.profile.run import preflight

        preflight(refs, spec.built)  # a source the sweep cannot run fails before the progress display
        with self.view.hooks(spec) as hooks:
            report = run_profile(refs, spec.built, hooks)
        report["inputs"] = list(spec.inputs)
        out = self.output(spec)
        out.mkdir(parents=True, exist_ok=True)
        write_report(report, out / "profile.json", out / "profile.html")
        self.view.profiled(report)
        return self._file_record(spec, ["profile.json", "profile.html"])

    def _bench(self, spec: StageSpec, bench_source, refs: list[str]) -> dict:
        from llmopt.stages.bench.run import BenchHooks, load_bench_requests

        requests = load_bench_requests(spec.built)
        hooks = BenchHooks(status=self.view.note, progress=self.view.bench_progress)
        reports, failures = {}, []
        for name, ref in zip(spec.inputs, refs):
            outcome = bench_source(spec.built, requests, ref, hooks)
            if outcome.report["interrupted"]:
                raise KeyboardInterrupt
            reports[f"{name}.json"] = outcome.report
            self.view.benched(outcome.report)
            failures += [f"{name}: {why}" for why in outcome.failures]
        record = self._write_results(spec, reports)
        if failures:
            raise StageFailed(f"stage {spec.name}: " + "; ".join(failures))
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
        return summarize(self.recipe, self.workdir)
