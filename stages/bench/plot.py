"""--plot FILE.png: latency CDFs (TTFT, TPOT, ITL, e2e) and output throughput over time."""
from __future__ import annotations

from pathlib import Path

from .report import token_times


def latency_samples(report: dict) -> dict[str, list[float]]:
    """Milliseconds per completed request (ITL: per gap), rebuilt from the report's samples."""
    ok = [i for i, error in enumerate(report.get("errors", [])) if error is None]
    ttft = [report["ttfts"][i] * 1000 for i in ok if report["ttfts"][i] is not None]  # None: 0 tokens
    e2e = [report["e2els"][i] * 1000 for i in ok]
    tpot = [(report["e2els"][i] - report["ttfts"][i]) / (report["output_lens"][i] - 1) * 1000
            for i in ok if report["output_lens"][i] > 1]
    itl = [gap * 1000 for i in ok for gap in report["itls"][i]]
    return {"TTFT": ttft, "TPOT": tpot, "ITL": itl, "end-to-end": e2e}


def throughput_series(report: dict, bins: int = 40) -> tuple[list[float], list[float]]:
    """(bin centres in s, streamed tokens per second in each bin)."""
    times = token_times(report)
    span = max(report.get("duration") or 0.0, max(times, default=0.0))
    if not times or span <= 0:
        return [], []
    width = max(span / bins, 0.05)
    count = int(span / width) + 1
    counts = [0] * count
    for t in times:
        counts[min(int(t / width), count - 1)] += 1
    return [(i + 0.5) * width for i in range(count)], [c / width for c in counts]


def write_plot(report: dict, path: Path, title: str | None = None) -> None:
    """One PNG: four latency CDFs and the throughput line (matplotlib, Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, (name, values) in zip(axes.flat, latency_samples(report).items()):
        _cdf(ax, name, values)
    ax = axes.flat[4]
    x, y = throughput_series(report)
    ax.plot(x, y, color="tab:green")
    ax.set(title="output throughput over time", xlabel="seconds since start", ylabel="tokens / s")
    ax.grid(alpha=0.3)
    axes.flat[5].axis("off")
    axes.flat[5].text(0, 0.95, _summary(report), va="top", family="monospace", fontsize=9)
    fig.suptitle(title or f"llmopt bench: {report.get('model_id') or 'model'} at {report.get('base_url')}, "
                          f"{report.get('dataset')}, rate {report.get('request_rate')}, "
                          f"max concurrency {report.get('max_concurrency') or 'unlimited'}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf(ax, name: str, values: list[float]) -> None:
    ordered = sorted(values)
    if ordered:
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post")
    ax.set(title=f"{name} CDF ({len(ordered)} samples)", xlabel="ms", ylabel="fraction", ylim=(0, 1.02))
    ax.grid(alpha=0.3)


def _summary(report: dict) -> str:
    def fmt(key: str, unit: str = "") -> str:
        value = report.get(key)
        return "-" if value is None else f"{value:,.2f}{unit}"

    lines = [f"completed  {report.get('completed')}   failed {report.get('failed')}",
             f"duration   {fmt('duration', ' s')}",
             f"requests   {fmt('request_throughput', ' /s')}",
             f"output     {fmt('output_throughput', ' tok/s')}",
             f"rate {report.get('request_rate')}  concurrency {report.get('max_concurrency')}"]
    lines += [f"p99 {m:<5} {fmt(f'p99_{m}_ms', ' ms')}" for m in ("ttft", "tpot", "itl", "e2el")]
    return "\n".join(lines)
