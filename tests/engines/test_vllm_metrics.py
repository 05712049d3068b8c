"""vLLM /metrics -> Sample, over pages recorded from a real vLLM 0.32 (CPU build) and the older names."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engines.vllm.metrics import MetricsParseError, parse_metrics

FIXTURES = Path(__file__).parent / "fixtures"


def test_recorded_page_under_load() -> None:
    # 200 requests sent at once to --max-num-seqs 128 with a 64-block (8,192-token) KV cache
    sample = parse_metrics((FIXTURES / "vllm_0.32_cpu_metrics_busy.txt").read_text(), 5.0)
    assert sample.time == 5.0
    assert (sample.running, sample.queue) == (20, 18)
    assert sample.token_usage == pytest.approx(0.98413, abs=1e-4)
    assert sample.retractions_total == 119
    assert sample.max_total_tokens == 8192
    assert sample.prompt_tokens_total == 45811
    assert sample.generation_tokens_total == 42687
    assert sample.requests_total == 162  # summed over finished_reason
    assert sample.finished_requests_total == 162 and sample.finished_request_tokens_total == 39433 + 41472
    assert sample.cache_hit_rate == 0.0
    assert sample.gen_throughput is None and sample.new_token_ratio is None


def test_recorded_idle_page() -> None:
    sample = parse_metrics((FIXTURES / "vllm_0.32_cpu_metrics_idle.txt").read_text(), 0.0)
    assert (sample.running, sample.queue, sample.token_usage) == (0, 0, 0.0)
    assert sample.retractions_total == 0
    assert sample.cache_hit_rate is None  # no queries yet
    assert sample.max_total_tokens == 8192


OLD_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 25.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
"""


def test_old_names_and_two_engines() -> None:
    sample = parse_metrics(OLD_V1, 1.0)
    assert (sample.running, sample.queue) == (12, 4)  # summed over engines
    assert sample.token_usage == 0.75  # the fuller engine
    assert sample.retractions_total == 6
    assert sample.cache_hit_rate == 0.25
    assert sample.max_total_tokens == 32000  # 2 x 1000 blocks x 16
    assert sample.generation_tokens_total is None


def test_new_usage_name_wins_over_deprecated() -> None:
    page = OLD_V1 + '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    assert parse_metrics(page, 0.0).token_usage == 0.5


def test_capacity_unknown_before_profiling() -> None:
    page = OLD_V1.replace('num_gpu_blocks="1000"', 'num_gpu_blocks="None"')
    assert parse_metrics(page, 0.0).max_total_tokens is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 1\n", "lacks vllm:num_requests_waiting"),
        ("vllm:num_requests_running{ 1\n", "not a Prometheus metrics page"),
    ],
)
def test_bad_pages(text: str, message: str) -> None:
    with pytest.raises(MetricsParseError, match=message):
        parse_metrics(text, 0.0)
