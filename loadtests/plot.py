"""The scenario plot: throughput, queue, running batch and token usage over time, one line per arm,
restarts marked.

    plot_scenario(report, "scenario-early-stop.png")

In modelled time (the arms run ``time_scale`` times faster): output tokens/s, from the worker's
generation-token counter (followed through restarts) between consecutive samples, smoothed over
``SMOOTH_S`` wall seconds; requests waiting (the worker's ``#queue-req`` plus the proxy's own
queue); requests running; token usage (the 0.9 the tuning guide asks for dotted). A vertical line
marks each worker restart (a new worker pid in the samples); a cross marks a sample where the
worker was down. For a fleet (several workers) a last panel gives the share of the workers serving
(READY), with the 75 % line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_scenario", "throughput_series"]

SMOOTH_S = 2.0
COLORS = {
    "default": "#d62728",
    "adaptive": "#1f77b4",
    "oracle": "#2ca02c",
    "defaults": "#7f7f7f",
    "injected": "#9467bd",
}


def throughput_series(
    series: Sequence[Mapping[str, Any]], smooth_s: float = SMOOTH_S
) -> tuple[list[float], list[float]]:
    """(times, tokens/s) from the cumulative ``gen_tokens_total`` of the samples (gaps count as no output)."""
    points: list[tuple[float, float]] = []
    total = 0.0
    for p in series:  # a sample without the counter (worker starting or down) adds nothing
        if "t" in p and "proxy_queue" in p:
            total = float(p["gen_tokens_total"]) if p.get("gen_tokens_total") is not None else total
            points.append((float(p["t"]), total))
    times: list[float] = []
    rates: list[float] = []
    j = 0
    for i, (t, total) in enumerate(points):
        while j < i and points[j][0] < t - smooth_s:
            j += 1
        if j < i:
            t0, tot0 = points[j]
            times.append(t)
            rates.append((total - tot0) / (t - t0) if t > t0 else 0.0)
    return times, rates


def _restarts(series: Sequence[Mapping[str, Any]]) -> list[float]:
    out = []
    last = None
    for p in series:
        n = p.get("restarts")
        if n is None:
            continue
        if last is not None and n > last:
            out.append(float(p["t"]))
        last = n
    return out


def plot_scenario(report: Mapping[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleet = int(report.get("workers") or 1) > 1
    scale = float(report.get("time_scale") or 1.0)
    rows = 5 if fleet else 4
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.1 * rows + 1.2), sharex=True)
    top, waiting, running, usage = axes[:4]
    serving = axes[4] if fleet else None
    most_waiting = 0.0
    for arm, series in report["series"].items():
        color = COLORS.get(arm)
        summary = report["arms"][arm]
        times, rates = throughput_series(series)
        top.plot([t * scale for t in times], [r / scale for r in rates], color=color, lw=1.0,
                 label=f"{arm}: {summary['output_tok_per_s'] / scale:.0f} tok/s overall")  # fmt: skip
        looks = [p for p in series if "proxy_queue" in p]
        t = [p["t"] * scale for p in looks]
        queued = [(p.get("queue") or 0) + p["proxy_queue"] for p in looks]
        most_waiting = max([most_waiting, *queued])
        waiting.plot(t, queued, color=color, lw=1.0, label=arm)
        running.plot(t, [p.get("running") or 0 for p in looks], color=color, lw=1.0, label=arm)
        usage.plot(t, [p.get("token_usage") or 0.0 for p in looks], color=color, lw=1.0, label=arm)
        for i, at in enumerate(_restarts(series)):
            for ax in axes:
                ax.axvline(at * scale, color=color, ls="--", lw=0.9, alpha=0.8,
                           label=f"{arm}: restart" if ax is top and i == 0 else None)  # fmt: skip
        if serving is not None:
            points = [(p["t"] * scale, p["serving"]) for p in series if "serving" in p]
            serving.step([x for x, _ in points], [v for _, v in points], where="post", color=color, lw=1.2, label=arm)
        down = [p["t"] * scale for p in series if p.get("state") == "down"]
        if down:
            top.plot(down, [0.0] * len(down), "x", color=color, ms=4, label=f"{arm}: worker down")
    top.set_ylabel("output tokens/s")
    top.set_ylim(bottom=0)
    top.legend(loc="upper right", fontsize=7)
    top.set_title(f"{report['scenario']}: {report['gpu']}, {report['model']} (modelled time; the arms ran "
                  f"{scale:g}x faster)", fontsize=10)  # fmt: skip
    waiting.set_ylabel("waiting\n(proxy + worker)")
    if most_waiting > 200:  # a backlog of thousands beside a queue of tens: both readable
        waiting.set_yscale("symlog", linthresh=100)
    waiting.set_ylim(bottom=0)
    running.set_ylabel("running")
    running.set_ylim(bottom=0)
    usage.set_ylabel("token usage")
    usage.set_ylim(0, 1.05)
    usage.axhline(0.9, color="black", ls=":", lw=0.8)
    if serving is not None:
        serving.set_ylabel("share of workers\nserving")
        serving.set_ylim(0, 1.05)
        serving.axhline(0.75, color="black", ls=":", lw=0.8)
        serving.legend(loc="lower right", fontsize=7)
    axes[-1].set_xlabel("modelled seconds since the workload was submitted")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
