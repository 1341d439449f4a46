"""`llmopt profile SOURCE --memory`: where every byte of a serving process goes.

The process is built as `llmopt serve` builds it (the HTTP server's modules imported, the runtime loaded
on its backend, the KV cache sized by `serve.build.kv_cache_plan`, the matmul prebuild run, one short
request served), reading RSS between the phases. The bytes are then put in categories:

- torch + Python + libraries: RSS before the model is loaded; the tokenizer: what loading it took;
- weights as loaded, per format: the tensors the artifact's layout keeps (compressed-tensors buffers,
  dense weights, embeddings, norms, the rotary table);
- kernel copies, per layout: what the backend made from them (the native GEMV's tiled layouts, torch's
  int4/int8 packed layouts, oneDNN's reordered weights, MKL's transposed ones, dequantized dense fallbacks);
- the KV cache;
- oneDNN primitives: the RSS the prebuild took;
- unaccounted: RSS after the request minus the sum of the above (allocator pools, activations kept by
  the allocator, the tokenizer, native libraries' own state).

Tensors are found by walking the runtime's modules and counted once per storage (a tied lm_head that
shares the embedding's codes, a packed layout that is the loaded tensor itself, count once, under the
first category that meets them: weights as loaded before kernel copies).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from ..progress import StageHooks
from .config import ProfileConfig
from .tables import TableData, human_bytes

PROMPT_TOKENS, NEW_TOKENS = 32, 16  # the request that brings the process to its serving state
LOADED, COPIES = "weights as loaded", "kernel copies"


def process_memory() -> dict:
    """{"rss": VmRSS, "peak": VmHWM} of this process in bytes (Linux /proc; zeros elsewhere)."""
    out = {"rss": 0, "peak": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = {"VmRSS:": "rss", "VmHWM:": "peak"}.get(line.split(":")[0] + ":")
                if key:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


@dataclass
class Ledger:
    """Bytes per (category, detail), each byte counted once: the first `add` that meets it wins. Bytes are
    tracked per storage as ranges, so tensors that are slices of one storage (a memory-mapped weight file)
    count their own bytes, and views of bytes already counted add nothing."""

    bytes: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)  # storage identity -> [(start, end)] byte ranges counted

    def add(self, category: str, detail: str, *tensors) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key, start, end = byte_range(t)
            ranges = self.seen.get(key, [])  # disjoint, merged
            new = (end - start) - sum(max(0, min(end, e) - max(start, s)) for s, e in ranges)
            self.seen[key] = _merged(ranges + [(start, end)])
            if new > 0:
                self.bytes[(category, detail)] = self.bytes.get((category, detail), 0) + new

    def total(self, category: str | None = None) -> int:
        return sum(b for (c, _), b in self.bytes.items() if category is None or c == category)


def _merged(ranges: list) -> list:
    out = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def byte_range(t: torch.Tensor) -> tuple[object, int, int]:
    """(storage identity, first byte, end byte) of the memory a tensor spans: its extent in its storage, or
    for oneDNN's opaque tensors (which have no storage to ask), the tensor itself."""
    size = t.element_size()
    if t.is_mkldnn:
        return ("mkldnn", id(t)), 0, t.numel() * size
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    start = t.storage_offset() * size
    return ("storage", t.untyped_storage().data_ptr()), start, start + span * size


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype)[6:])


def _layout_tensors(layout) -> list:
    """The tensors a kernel layout object holds (cpu_native's Int4Weight / Int8Weight / DenseWeight,
    cpu_quant's Int4CpuWeight / Int8CpuWeight): its tensor attributes, including the fields of dataclasses."""
    values = vars(layout).values() if hasattr(layout, "__dict__") else \
        [getattr(layout, f) for f in getattr(layout, "__dataclass_fields__", ())]
    return [v for v in values if isinstance(v, torch.Tensor)]


def account_linear(ledger: Ledger, module) -> None:
    """A RoutedLinear's tensors: its own buffers as loaded, then the layouts its backend attached."""
    from llmopt.kernels.cpu_linear import DenseLinear
    from llmopt.kernels.linear import QuantLinear

    if isinstance(module, QuantLinear):
        fmt = type(module).__name__.removesuffix("Linear").lower()
        ledger.add(LOADED, f"{fmt} (compressed-tensors)", *module.buffers(recurse=False))
        if module.cpu_weight is not None:
            ledger.add(COPIES, f"torch {type(module.cpu_weight).__name__} ({fmt})", *_layout_tensors(module.cpu_weight))
        if module.native is not None:
            ledger.add(COPIES, f"native GEMV tiles ({fmt})", *_layout_tensors(module.native.weight), module.native.bias)
        if module.dense is not None:
            ledger.add(COPIES, f"dequantized dense fallback ({fmt})", *_dense_tensors(module.dense))
    elif isinstance(module, DenseLinear):
        w = module.weight
        ledger.add(LOADED, f"dense {_dtype_name(w.dtype)}", w, module.bias)
        ledger.add(COPIES, "oneDNN reordered weights", module.packed)
        ledger.add(COPIES, "MKL transposed weights", module.weight_t)
        if module.native is not None:
            ledger.add(COPIES, f"native GEMV tiles (dense {_dtype_name(w.dtype)})",
                       *_layout_tensors(module.native.weight), module.native.bias)


def _dense_tensors(dense) -> list:
    native = [] if dense.native is None else [*_layout_tensors(dense.native.weight), dense.native.bias]
    return [dense.weight, dense.bias, dense.packed, dense.weight_t, *native]


def account_runtime(runtime, kv_cache: torch.Tensor | None = None) -> Ledger:
    """The ledger of a loaded runtime (and its runner's KV cache): every linear's tensors by layout, the
    embedding, then every other buffer and parameter (norms, the rotary table)."""
    from llmopt.kernels.linear import RoutedLinear

    ledger = Ledger()
    ledger.add("KV cache", "paged blocks", kv_cache)
    embed_scale = getattr(runtime, "embed_scale", None)
    kind = "int8 codes + scales" if embed_scale is not None else _dtype_name(runtime.embed_tokens.dtype)
    ledger.add(LOADED, f"embedding ({kind})", runtime.embed_tokens, embed_scale)
    for module in runtime.modules():
        if isinstance(module, RoutedLinear):
            account_linear(ledger, module)
    ledger.add(LOADED, "norms, rotary table", *runtime.buffers(), *runtime.parameters(),
               getattr(runtime, "cos_sin_cache", None))
    return ledger


def run_memory(source: str, config: ProfileConfig, hooks: StageHooks | None = None) -> dict:
    """Build `source`'s serving process here, phase by phase, and account for its RSS."""
    from ..model_io import parse_dtype
    from ..serve.build import kv_cache_plan, release_free_heap
    from ..serve.engine.config import EngineConfig, SamplingParams
    from ..serve.engine.engine import LLMEngine
    from ..model_io import load_tokenizer
    from ..safetensors_io import load_dir
    from ..serve.http import server  # noqa: F401  (the server's libraries are part of a serving process)
    from ..serve.loader import build_runtime, locate, read_config
    from ..serve.runner import ModelRunner

    hooks = hooks or StageHooks()
    engine_config = EngineConfig(max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                                 kv_cache_memory=config.kv_cache_memory, block_size=config.block_size)
    gc.collect()
    phases = {"libraries": process_memory()}
    hooks.status(f"loading {source}")
    directory, files = locate(source)  # what `serve.loader.load_runtime` does, with a reading between
    tokenizer = load_tokenizer(directory)
    phases["tokenizer"] = process_memory()
    runtime = build_runtime(read_config(directory), load_dir(directory, files), torch.device(config.device),
                            parse_dtype(config.dtype), config.backend)
    gc.collect()
    release_free_heap()  # as `serve.build.build_engine` does
    phases["loaded"] = process_memory()
    plan = kv_cache_plan(engine_config, runtime.spec, runtime, announce=False)
    runner = ModelRunner(runtime, plan.num_blocks, plan.block_size)
    phases["kv_cache"] = process_memory()
    hooks.status("prebuilding the matmul primitives")
    calls = runner.prebuild_matmuls(engine_config.max_num_batched_tokens, engine_config.seqs_per_step)
    phases["prebuilt"] = process_memory()
    runner.prebuild = False  # done above, measured
    engine = LLMEngine(runner, tokenizer, engine_config)
    hooks.status("serving one request")
    engine.add_request("memory", prompt_token_ids=list(range(1, PROMPT_TOKENS + 1)),
                       params=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    gc.collect()
    phases["served"] = process_memory()
    ledger = account_runtime(runtime, runner.kv_cache)
    return memory_report(source, config, phases, ledger, plan, calls, runtime)


def memory_report(source: str, config: ProfileConfig, phases: dict, ledger: Ledger, plan, calls: int,
                  runtime) -> dict:
    """The categories (name, detail, bytes) summing to the RSS after the request, and the phases."""
    rss = phases["served"]["rss"]
    rows = [["torch + Python + libraries", "RSS before loading the model", phases["libraries"]["rss"]],
            ["tokenizer", "RSS its loading took (transformers included)",
             phases["tokenizer"]["rss"] - phases["libraries"]["rss"]]]
    rows += [[c, d, b] for (c, d), b in ledger.bytes.items() if b]
    rows.append(["oneDNN primitives", f"RSS the prebuild took ({calls} calls)",
                 phases["prebuilt"]["rss"] - phases["kv_cache"]["rss"]])
    rows.append(["unaccounted", "RSS minus the above", rss - sum(r[2] for r in rows)])
    return {"tool": "llmopt profile --memory", "source": source, "backend": runtime.backend.name,
            "dtype": _dtype_name(runtime.dtype), "kv_cache": plan.describe(), "rss": rss,
            "peak": phases["served"]["peak"], "categories": rows, "phases": phases,
            "weights_bytes": ledger.total(LOADED), "kernel_copy_bytes": ledger.total(COPIES),
            "config": config.to_dict()}


def memory_tables(report: dict) -> list[TableData]:
    rss = report["rss"]
    t = TableData("memory", f"memory of a serving process: {report['source']} ({report['backend']}, "
                            f"{report['dtype']} activations)", ["category", "detail", "bytes", "share of RSS"])
    t.rows = [[c, d, human_bytes(b), f"{b / rss:.1%}" if rss else "-"] for c, d, b in report["categories"]]
    t.rows.append(["RSS", "after one request", human_bytes(rss), "100.0%"])
    t.note = (f"{report['kv_cache']}; peak RSS (VmHWM) {human_bytes(report['peak'])}; weights as loaded "
              f"{human_bytes(report['weights_bytes'])}, kernel copies {human_bytes(report['kernel_copy_bytes'])}")
    phases = TableData("memory_phases", "RSS after each phase of start-up", ["phase", "RSS", "peak (VmHWM)"])
    phases.rows = [[name, human_bytes(p["rss"]), human_bytes(p["peak"])] for name, p in report["phases"].items()]
    return [t, phases]
