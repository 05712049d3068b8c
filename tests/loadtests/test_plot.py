"""The scenario plot from a hand-built report: one line per arm in each panel, restarts found."""

from __future__ import annotations

from pathlib import Path

from loadtests.plot import _restarts, plot_scenario, throughput_series


def _series(restart_at: float | None) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for i in range(40):
        t = i * 0.5
        restarted = restart_at is not None and t >= restart_at
        out.append({"t": t, "state": "ready", "restarts": int(restarted), "serving": 1.0, "proxy_queue": 5,
                    "queue": 10, "running": 80, "token_usage": 0.8, "gen_tokens_total": 100 * i})  # fmt: skip
    return out


def test_restarts_are_found_and_the_plot_is_written(tmp_path: Path) -> None:
    series = _series(restart_at=7.0)
    assert _restarts(series) == [7.0] and _restarts(_series(None)) == []
    _, rates = throughput_series(series)
    assert rates and all(abs(r - 200.0) < 1e-6 for r in rates)  # 100 tokens every half second
    report = {"scenario": "s", "gpu": "g", "model": "m", "time_scale": 10.0,
              "series": {"default": _series(None), "adaptive": series},
              "arms": {"default": {"output_tok_per_s": 2000.0}, "adaptive": {"output_tok_per_s": 2000.0}}}  # fmt: skip
    out = plot_scenario(report, tmp_path / "s.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
