"""The report as titled tables of strings: one source of truth for the terminal and the HTML."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TableData:
    key: str  # stable id (HTML anchor, tests)
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _num(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def gbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def comparison_table(report: dict) -> TableData:
    # a column for each other evaluation set a stage measured (code, chat; none in older reports)
    sets = list(dict.fromkeys(s for r in report["comparison"] for s in r.get("perplexity_sets") or {}))
    t = TableData("comparison", "sources side by side",
                  ["source", "weights", "perplexity", *(f"perplexity {s}" for s in sets), "decode tok/s b1",
                   "decode tok/s b16", "bandwidth share b1", "prefill tok/s"])
    for r in report["comparison"]:
        prefill = _num(r["prefill_tokens_per_s"], ".0f") + (f" @{r['prefill_len']}" if r["prefill_len"] else "")
        by_set = r.get("perplexity_sets") or {}
        t.rows.append([r["source"], human_bytes(r["size_bytes"]), _num(r["perplexity"], ".3f"),
                       *(_num(by_set.get(s), ".3f") for s in sets), _num(r["decode_tokens_per_s_b1"]),
                       _num(r["decode_tokens_per_s_b16"]), f"{r['bandwidth_share']:.1%}", prefill])
    protocols = sorted({r["perplexity_protocol"] for r in report["comparison"] if r["perplexity_protocol"]})
    t.note = "perplexity from the artifacts' manifests: " + "; ".join(protocols) if protocols else \
        "no perplexity in the manifests (run llmopt eval, or quantize/prune with --eval-windows)"
    return t


def machine_table(report: dict) -> TableData:
    m = report["machine"]
    copy = m["copy"]
    t = TableData("machine", "machine limits (measured in this run)", ["what", "value"])
    t.rows = [["device", f"{m['device']} ({m.get('gpu') or m['cpu']}), {m['threads']} thread(s), torch {m['torch']}"],
              ["copy bandwidth", f"{gbps(copy['bytes_per_s'])} ({human_bytes(copy['buffer_bytes'])} buffer, "
                                 f"best of {copy['repeats']}; read + written)"]]
    t.rows += [[f"GEMM {name}", f"{flops / 1e9:.0f} GFLOP/s ({m['gemm_size']}^3 matmul)"]
               for name, flops in m["gemm_flops_per_s"].items()]
    return t


def spread(point: dict, spec: str) -> str:
    """A point's fastest-slowest timing ("-" in reports written before they kept it)."""
    return f"{point['ms_min']:{spec}}-{point['ms_max']:{spec}}" if "ms_min" in point else "-"


def prefill_table(s: dict) -> TableData:
    t = TableData("prefill", f"{s['source']}: prefill (one sequence, one step)",
                  ["prompt tokens", "ms", "min-max ms", "tok/s", "GFLOP", "GFLOP/s"])
    t.rows = [[str(p["prompt_len"]), f"{p['ms']:.1f}", spread(p, ".1f"), f"{p['tokens_per_s']:.0f}",
               f"{p['flops'] / 1e9:.1f}", f"{p['flops_per_s'] / 1e9:.1f}"] for p in s["prefill"]]
    t.note = "ms: median of the timings, min-max: their spread"
    return t


def decode_table(s: dict) -> TableData:
    t = TableData("decode", f"{s['source']}: decode step", ["batch", "context", "ms/step", "min-max ms", "tok/s",
                                                            "weights GB/s", "bandwidth share", "KV read", "GFLOP/s"])
    for p in s["decode"] + s["decode_context"]:
        t.rows.append([str(p["batch"]), str(p["context"]), f"{p['ms']:.2f}", spread(p, ".2f"),
                       f"{p['tokens_per_s']:.1f}", f"{p['weight_bytes_per_s'] / 1e9:.2f}",
                       f"{p['bandwidth_share']:.1%}", human_bytes(p["kv_bytes_read"]), f"{p['flops_per_s'] / 1e9:.1f}"])
    problems = s["capacity"].get("sweep_problems") or []
    flag = ["NOT MONOTONE beyond its noise: " + "; ".join(problems)] if problems else []
    t.note = "; ".join([*flag, f"weight bytes per step {s['weights']['total']:,}", *s["skipped"]])
    return t


def roofline_table(s: dict) -> TableData:
    r = s["roofline"]
    t = TableData("roofline", f"{s['source']}: decode roofline (batch {r['batch']}, context {r['context']})",
                  ["term", "value"])
    t.rows = [["weight bytes per step", f"{r['weight_bytes']:,} B ({human_bytes(r['weight_bytes'])})"],
              ["step time", f"{r['step_ms']:.3f} ms"],
              ["achieved = bytes / time", gbps(r["achieved_bytes_per_s"])],
              ["copy bandwidth", gbps(r["copy_bytes_per_s"])],
              ["bandwidth share", f"{r['achieved_bytes_per_s'] / 1e9:.3f} / {r['copy_bytes_per_s'] / 1e9:.3f} = "
                                  f"{r['bandwidth_share']:.1%}"],
              ["step time at copy bandwidth", f"{r['ideal_step_ms']:.2f} ms"]]
    if "read_share" in r:  # reports written before it lack the per-token figures
        t.rows += [["bytes read per token (weights + KV)",
                    f"{human_bytes(r['bytes_read_per_token'])} ({human_bytes(r['kv_bytes_read'])} of KV)"],
                   ["ms per token", f"{r['ms_per_token']:.3f} ms"],
                   ["read share of copy bandwidth", f"{r['read_bytes_per_s'] / 1e9:.3f} / "
                                                    f"{r['copy_bytes_per_s'] / 1e9:.3f} = {r['read_share']:.1%}"]]
    if "sweep_step_ms" in r:  # reports written before it timed the sweep's point only
        t.rows += [["in the interleaved sweep: ms per token, read share",
                    f"{r['sweep_step_ms']:.3f} ms, {r['sweep_read_share']:.1%}"]]
    t.note = r["formula"] + ("; " + r["read_formula"] if "read_formula" in r else "")
    if "timing" in r:
        t.note += (f". Step time: {r['timing']}, as a server at concurrency 1 runs them; the sweep's batch-1 "
                   "point follows larger batches' steps, which slow the next few")
    return t


def breakdown_table(s: dict, which: str, per_layer: bool) -> TableData:
    b = s["breakdown"][which]
    t = TableData(f"breakdown-{which}", f"{s['source']}: per-layer time, {b['what']}", ["part", "ms", "share"])
    if per_layer:
        t.rows = [[r["name"], f"{r['ms']:.3f}", f"{r['share_of_step']:.1%}"] for r in b["rows"]]
    else:
        layers = [r for r in b["rows"] if r["name"].startswith("layer ")]
        head = next(r for r in b["rows"] if r["name"] == "lm_head")
        total = sum(r["ms"] for r in layers)
        t.rows = [[f"{len(layers)} decoder layers", f"{total:.2f}", f"{total / b['step_ms']:.1%}"],
                  ["slowest layer", f"{max(r['ms'] for r in layers):.3f}", ""],
                  ["lm_head", f"{head['ms']:.2f}", f"{head['share_of_step']:.1%}"]]
    t.rows += [["sum of parts", f"{b['sum_ms']:.2f}", ""], ["measured step (no hooks)", f"{b['step_ms']:.2f}", ""],
               ["unattributed", f"{b['unattributed_ms']:.2f}", f"{b['unattributed_ms'] / b['step_ms']:.1%}"],
               ["sum / step", f"{b['ratio']:.3f}", ""]]
    notes = []
    if "hook_overhead_ms" in b:  # reports written before it took each part's median, which need not add up
        t.rows.append(["step with hooks", f"{b['hooked_step_ms']:.2f}", ""])
        notes.append("parts: their share of the hooked steps they were timed in, in ms of the step without hooks")
    if "fused_step_ms" in b:
        t.rows.append(["step as served", f"{b['fused_step_ms']:.2f}", ""])
        notes.append("hooks see the per-layer path; as served, a CPU decode step of few sequences runs every layer "
                     "in one native call (same kernels, same order)")
    t.note = "; ".join(filter(None, [b.get("note"), *notes]))
    return t


def ops_table(s: dict, which: str) -> TableData:
    o = s["ops"][which]
    t = TableData(f"ops-{which}", f"{s['source']}: top ops, {s['breakdown'][which]['what']}",
                  ["op", "calls/step", "ms/step", "share"])
    t.rows = [[r["op"], f"{r['calls_per_step']:g}", f"{r['ms_per_step']:.3f}", f"{r['share']:.1%}"] for r in o["rows"]]
    t.note = f"torch.profiler {o['clock']}, {o['steps']} steps, {o['ops_total']} distinct ops, " \
             f"{o['total_ms_per_step']:.2f} ms/step in all"
    return t


def memory_table(s: dict) -> TableData:
    m = s["memory"]
    t = TableData("memory", f"{s['source']}: memory", ["what", "value"])
    t.rows = [["weights on disk", human_bytes(s["size_bytes"])],
              ["weights read per decode step", human_bytes(s["weights"]["total"])],
              ["memory added by loading", human_bytes(m["loaded_bytes"])],
              ["KV cache per token", f"{m['kv_bytes_per_token']:,} B"],
              ["KV cache allocated for the sweep", human_bytes(m["kv_cache_bytes"])],
              [f"peak ({m['peak_method']})", human_bytes(m["peak_bytes"])]]
    return t


def capacity_table(s: dict) -> TableData:
    c = s["capacity"]
    t = TableData("capacity", f"{s['source']}: capacity at context {c['context']}, budget "
                              f"{human_bytes(c['budget_bytes'])}", ["batch", "TPOT ms", "tok/s", "fits"])
    t.rows = [[str(r["batch"]), f"{r['tpot_ms']:.1f}", f"{r['tokens_per_s']:.1f}", "yes" if r["fits"] else "no"]
              for r in c["tradeoff"]]
    rec = c["recommended_max_num_seqs"]
    target = f" for TPOT <= {c['target_tpot_ms']:g} ms" if c["target_tpot_ms"] else ""
    problems = c.get("sweep_problems") or []
    t.note = (f"{c['max_num_seqs_fit']} sequences fit ({human_bytes(c['kv_bytes_per_seq'])} of KV each); "
              f"recommended --max-num-seqs{target}: {rec if rec is not None else 'none'} ({c['reason']})"
              + "".join(f"; {p}" for p in problems))
    return t


def source_tables(s: dict, per_layer: bool = False) -> list[TableData]:
    """Every table of one source, in report order."""
    return [prefill_table(s), decode_table(s), roofline_table(s), breakdown_table(s, "decode", per_layer),
            breakdown_table(s, "prefill", per_layer), ops_table(s, "decode"), ops_table(s, "prefill"),
            memory_table(s), capacity_table(s)]
