"""`run_quantize`: the quantize stage end to end: load, quantize layer by layer, write, evaluate before/after."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from ..artifact import Artifact, ArtifactWriter, check_destination, safetensors_bytes
from ..calib import resolve_calib
from ..eval.before_after import perplexity, reusable_artifact, store_before_after
from ..model_io import model_info, parse_dtype, save_model_files
from ..profile.machine import HOST, peak_memory, reset_peak_memory
from ..safetensors_io import ShardWriter
from ..source import load, source_record
from .config import QuantizeConfig
from .embeddings import choose_embeddings, quantize_embedding
from .stage import (QuantizeHooks, check_not_quantized, per_layer_table, plan_targets, quantization_config_of,
                    quantize_model, rest_of_state)


def run_quantize(source_ref: str, dest: Path, config: QuantizeConfig, force: bool = False,
                 hooks: QuantizeHooks | None = None) -> Artifact:
    """Quantize `source_ref` into a new artifact at `dest`; returns it with metrics stored."""
    hooks = hooks or QuantizeHooks()
    config.validate()
    check_destination(dest, force)
    reset_peak_memory(HOST)  # the run's peak resident set goes into its metrics
    hooks.status(f"loading {source_ref}")
    loaded = load(source_ref, dtype=parse_dtype(config.dtype))
    check_not_quantized(loaded.model)
    config = replace(config, calib=resolve_calib(config.calib, loaded.tokenizer))  # the manifest says what `auto` took
    choice = choose_embeddings(loaded.model, config.embeddings, config.method)
    config = replace(config, embeddings=choice.chosen)  # the manifest's config says what auto chose
    if choice.requested == "auto" and choice.chosen == "int8":
        hooks.status(f"embeddings: int8 (the embedding is {choice.share:.0%} of the parameters; "
                     f"--embeddings keep leaves it as is)")
    if config.method == "bnb":
        from .bnb import run_bnb

        return run_bnb(loaded, dest, config, force, hooks)
    targets = plan_targets(loaded.model, config)  # bad group sizes / ignore patterns fail before any work
    base = perplexity(loaded.model, loaded.tokenizer, config.eval_windows, hooks, "base",
                      reusable_artifact(loaded, config.dtype))
    info = model_info(loaded.model)
    with ArtifactWriter(dest, force=force) as w:  # layers stream into it; any failure removes it
        w.check_space(expected_bytes(loaded.model, targets, config))  # before the long part, not after
        shards = ShardWriter(w.tmp)
        start = time.perf_counter()
        method, reports = quantize_model(loaded.model, loaded.tokenizer, config, hooks, sink=shards.add)
        embedding = quantize_embedding(loaded.model, config.embeddings)  # None: kept as is
        seconds = time.perf_counter() - start
        hooks.status(f"writing {dest}")
        shards.add(rest_of_state(loaded.model, method, embedding))
        shards.close()
        save_model_files(loaded.model, loaded.tokenizer, w.tmp, quantization_config_of(loaded.model, method, embedding))
        art = w.commit("quantize", config.to_dict(), loaded.artifact, source_record(loaded.source, loaded.artifact),
                       model=info, metrics={"size_bytes": safetensors_bytes(w.tmp), "quantize_seconds": round(seconds, 1),
                                            "peak_rss_bytes": peak_memory(HOST),
                                            "quantization": {**per_layer_table(method, reports, embedding),
                                                             "embeddings_choice": choice.record()}})
    store_before_after(art, config.eval_windows, hooks, base, "quantized")
    return art


def expected_bytes(model, targets: dict, config: QuantizeConfig) -> int:
    """A lower bound on the quantized weights' bytes (scales left out): each target Linear at its bits per
    weight, an int8 embedding at one byte per value, every other tensor as stored."""
    bits = {f"model.layers.{i}.{name}.weight": args.bits
            for i, layer in targets.items() for name, args in layer.items()}
    if config.embeddings == "int8":
        bits["model.embed_tokens.weight"] = 8
    seen, total = set(), 0
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:  # a tied lm_head is stored once
            continue
        seen.add(key)
        total += t.numel() * bits[name] // 8 if name in bits else t.numel() * t.element_size()
    return total
