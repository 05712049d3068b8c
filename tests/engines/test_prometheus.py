"""The shared Prometheus page reader: on a large page (a recorded vLLM page as sixteen data-parallel
engines would serve it, its histogram buckets most of it) the pre-filter drops every bucket line
and both engines' samples come out as they do from parsing the whole page."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engines import prometheus
from proxy.engines.sglang import metrics as sglang_metrics
from proxy.engines.vllm import metrics as vllm_metrics

FIXTURES = Path(__file__).parent / "fixtures"
ENGINES = 16


def large_vllm_page() -> str:
    """The recorded busy page with every per-engine sample repeated for engines 0..15."""
    out = []
    for line in (FIXTURES / "vllm_0.32_cpu_metrics_busy.txt").read_text().splitlines():
        if not line.startswith("#") and 'engine="0"' in line:
            out += [line.replace('engine="0"', f'engine="{i}"') for i in range(ENGINES)]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def test_the_pre_filter_drops_the_buckets_of_a_large_page() -> None:
    page = large_vllm_page()
    kept = prometheus.keep_read_lines(page, vllm_metrics.PREFIX, vllm_metrics.READ)
    assert page.count("_bucket{") > 4000
    assert "vllm:" not in "".join(line for line in kept.splitlines() if "_bucket{" in line)
    assert len(kept) < len(page) / 10
    assert "python_gc_objects_collected_total" in kept  # not a vllm: series: left to the parser


def test_a_large_page_gives_the_sample_of_the_whole_page() -> None:
    page = large_vllm_page()
    whole = prometheus.collect_series(page, vllm_metrics.PREFIX)  # no read set: every series parsed
    read = vllm_metrics.collect_series(page)
    assert set(read.values) == vllm_metrics.READ & set(whole.values)
    for name in read.values:
        assert read.values[name] == whole.values[name], name
        assert read.labels[name] == whole.labels[name], name
    sample = vllm_metrics.parse_metrics(page, 5.0)
    assert (sample.running, sample.queue) == (20 * ENGINES, 18 * ENGINES)
    assert sample.token_usage == pytest.approx(0.98413, abs=1e-4)
    assert sample.retractions_total == 119 * ENGINES
    assert sample.max_total_tokens == 8192 * ENGINES
    assert sample.requests_total == 162 * ENGINES


def test_sglang_reads_through_the_same_filter() -> None:
    page = "\n".join([
        "# TYPE sglang:num_queue_reqs gauge", "sglang:num_queue_reqs 4.0",
        "# TYPE sglang:num_running_reqs gauge", "sglang:num_running_reqs 2.0",
        "# TYPE sglang:token_usage gauge", "sglang:token_usage 0.5",
        "# TYPE sglang:e2e_request_latency_seconds histogram",
        *(f'sglang:e2e_request_latency_seconds_bucket{{le="{le}"}} 1.0' for le in ("0.1", "1.0", "+Inf")),
        "sglang:e2e_request_latency_seconds_sum 0.3", "sglang:e2e_request_latency_seconds_count 1.0", "",
    ])  # fmt: skip
    kept = prometheus.keep_read_lines(page, sglang_metrics.PREFIX, sglang_metrics.READ)
    assert "e2e_request_latency" not in kept and "sglang:num_queue_reqs 4.0" in kept
    sample = sglang_metrics.parse_metrics(page, 1.0)
    assert (sample.queue, sample.running, sample.token_usage) == (4, 2, 0.5)


@pytest.mark.parametrize("page", ["this is { not prometheus", "vllm:num_requests_waiting{ 1\n"])
def test_a_broken_page_fails_with_the_shared_error(page: str) -> None:
    with pytest.raises(prometheus.MetricsParseError, match="not a Prometheus metrics page"):
        vllm_metrics.parse_metrics(page, 0.0)
