"""The report's figures as PNG bytes (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import io


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    _pyplot().close(fig)
    return buf.getvalue()


def latency_figure(report: dict) -> bytes:
    """Decode ms/step and tokens/s against batch size, and prefill latency against prompt length; bars:
each point's fastest to slowest timing."""
    plt = _pyplot()
    fig, (step_ax, tps_ax, pre_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    target = report["config"].get("target_tpot_ms")
    for s in report["sources"]:
        batches = [p["batch"] for p in s["decode"]]
        step_ax.errorbar(batches, [p["ms"] for p in s["decode"]], yerr=spread_bars(s["decode"]), marker="o",
                         capsize=3, label=s["source"])
        tps_ax.plot(batches, [p["tokens_per_s"] for p in s["decode"]], marker="o", label=s["source"])
        pre_ax.errorbar([p["prompt_len"] for p in s["prefill"]], [p["ms"] for p in s["prefill"]],
                        yerr=spread_bars(s["prefill"]), marker="o", capsize=3, label=s["source"])
    if target:
        step_ax.axhline(target, color="tab:red", linestyle="--", label=f"target {target:g} ms")
    context = report["sources"][0]["decode"][0]["context"]
    for ax, title, xlabel, ylabel in ((step_ax, f"decode step latency (context {context})", "batch size", "ms / step"),
                                      (tps_ax, "decode throughput", "batch size", "tokens / s"),
                                      (pre_ax, "prefill latency", "prompt tokens", "ms")):
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _png(fig)


def spread_bars(points: list[dict]) -> list[list[float]] | None:
    """[below, above] the median to each point's fastest and slowest timing (None: an older report)."""
    if not all("ms_min" in p for p in points):
        return None
    return [[p["ms"] - p["ms_min"] for p in points], [p["ms_max"] - p["ms"] for p in points]]


def roofline_figure(report: dict) -> bytes:
    """Achieved FLOP/s against arithmetic intensity, under the copy-bandwidth and GEMM ceilings."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    machine = report["machine"]
    bandwidth = machine["copy"]["bytes_per_s"]
    points = [_intensity_points(s) for s in report["sources"]]
    xs = [x for pts in points for x, _, _ in pts] or [1.0]
    lo, hi = min(xs) / 2, max(xs) * 2
    for name, peak in machine["gemm_flops_per_s"].items():
        knee = peak / bandwidth
        grid = sorted({lo, hi, min(max(knee, lo), hi)})
        ax.plot(grid, [min(bandwidth * x, peak) for x in grid], linestyle="--", label=f"ceiling: copy bw / GEMM {name}")
    for s, pts in zip(report["sources"], points):
        line = ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", linestyle="", label=s["source"])
        for x, y, text in pts:
            ax.annotate(text, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points",
                        color=line[0].get_color())
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte of weights + KV)",
           ylabel="achieved FLOP/s", title="roofline: decode (bN = batch) and prefill (pN = prompt tokens)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _png(fig)


def _intensity_points(s: dict) -> list[tuple[float, float, str]]:
    weights, kv_token = s["weights"]["total"], s["memory"]["kv_bytes_per_token"]
    pts = [(p["flops"] / (weights + p["kv_bytes_read"]), p["flops_per_s"], f"b{p['batch']}") for p in s["decode"]]
    pts += [(p["flops"] / (weights + p["prompt_len"] * kv_token), p["flops_per_s"], f"p{p['prompt_len']}")
            for p in s["prefill"]]
    return pts


def breakdown_figure(s: dict) -> bytes:
    """Per-layer ms of the decode and prefill steps, lm_head and the unattributed rest beside them."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(15, 3.8))
    for ax, which in zip(axes, ("decode", "prefill")):
        b = s["breakdown"][which]
        names = [r["name"].replace("layer ", "") for r in b["rows"]] + ["rest"]
        values = [r["ms"] for r in b["rows"]] + [max(b["unattributed_ms"], 0.0)]
        colors = ["tab:blue"] * (len(values) - 2) + ["tab:orange", "tab:gray"]
        ax.bar(range(len(values)), values, color=colors)
        ax.set_xticks(range(len(values)), names, fontsize=7, rotation=90)
        ax.set(title=f"{b['what']}: parts sum to {b['ratio']:.1%} of the {b['step_ms']:.2f} ms step",
               xlabel="decoder layer / lm_head / unattributed", ylabel="ms")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(s["source"], fontsize=10)
    return _png(fig)
