"""The scenario plot: output throughput and queue over time, one line per arm, restarts marked.

    plot_scenario(report, "scenario-early-stop.png")

Top panel: output tokens/s, from the worker's generation-token counter (followed through restarts)
between consecutive samples, smoothed over ``SMOOTH_S``. Bottom panel: requests waiting, the
worker's ``#queue-req`` plus the proxy's own queue. A vertical line marks each worker restart
(a new worker pid in the samples); a cross marks a sample where the worker was down. For a fleet
(several workers) a third panel gives the share of the workers serving (READY), with the 75 % line.
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
    if fleet:  # a third panel: the share of the workers serving
        fig, (top, bottom, serving) = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    else:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for arm, series in report["series"].items():
        color = COLORS.get(arm)
        summary = report["arms"][arm]
        times, rates = throughput_series(series)
        top.plot(times, rates, color=color, lw=1.2, label=f"{arm}: {summary['output_tok_per_s']:.0f} tok/s overall")
        qt = [p["t"] for p in series if "proxy_queue" in p]
        qv = [(p.get("queue") or 0) + p["proxy_queue"] for p in series if "proxy_queue" in p]
        bottom.plot(qt, qv, color=color, lw=1.2, label=arm)
        for i, t in enumerate(_restarts(series)):
            for ax in (top, bottom):
                ax.axvline(
                    t, color=color, ls="--", lw=0.9, alpha=0.8, label="restart" if ax is top and i == 0 else None
                )
        if fleet:
            points = [(p["t"], p["serving"]) for p in series if "serving" in p]
            serving.step([t for t, _ in points], [v for _, v in points], where="post", color=color, lw=1.2, label=arm)
        down = [p["t"] for p in series if p.get("state") == "down"]
        if down:
            top.plot(down, [0.0] * len(down), "x", color=color, ms=4, label=f"{arm}: worker down")
    top.set_ylabel("output tokens/s (wall clock)")
    top.set_ylim(bottom=0)
    top.legend(loc="upper right", fontsize=8)
    top.set_title(f"{report['scenario']}: {report['gpu']}, {report['model']}, time scale {report['time_scale']:g}x")
    bottom.set_ylabel("requests waiting (proxy + worker)")
    if not fleet:
        bottom.set_xlabel("seconds since the workload was submitted")
    bottom.set_yscale("symlog", linthresh=100)
    bottom.legend(loc="upper right", fontsize=8)
    if fleet:
        serving.set_ylabel("share of workers serving")
        serving.set_ylim(0, 1.05)
        serving.axhline(0.75, color="black", ls=":", lw=0.8)
        serving.set_xlabel("seconds since the workload was submitted")
        serving.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
