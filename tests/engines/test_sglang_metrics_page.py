"""parse_metrics reads only the series it needs (the histograms are skipped unparsed) and gets the
same sample as parsing the whole page; a broken page still fails."""

from __future__ import annotations

import pytest

from proxy.engines.prometheus import keep_read_lines
from proxy.engines.sglang.metrics import FIELDS, PREFIX, READ, MetricsParseError, collect_series, parse_metrics

LABELS = 'model_name="m",tp_rank="{r}"'
PAGE = "\n".join(
    [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 1234.0',
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        *(f"sglang:num_running_reqs{{{LABELS.format(r=r)}}} {10 + r}.0" for r in range(2)),
        "# TYPE sglang:num_queue_reqs gauge",
        *(f"sglang:num_queue_reqs{{{LABELS.format(r=r)}}} {3 * r}.0" for r in range(2)),
        "# TYPE sglang:token_usage gauge",
        *(f"sglang:token_usage{{{LABELS.format(r=r)}}} 0.{4 + r}" for r in range(2)),
        "# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE sglang:time_to_first_token_seconds histogram",
        *(
            f'sglang:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {i}.0'
            for i, le in enumerate(("0.1", "0.5", "1.0", "+Inf"))
        ),
        'sglang:time_to_first_token_seconds_sum{model_name="m"} 1.5',
        'sglang:time_to_first_token_seconds_count{model_name="m"} 3.0',
        "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE sglang:prompt_tokens counter",  # prometheus_client names the family without _total
        'sglang:prompt_tokens_total{model_name="m"} 120.0',
        "# TYPE sglang:num_retracted_requests_total counter",
        'sglang:num_retracted_requests_total{model_name="m"} 7.0',
        'sglang:max_total_num_tokens{model_name="m"} 422286.0',
        "",
    ]
)


def test_the_filtered_page_gives_the_same_sample_as_the_whole_page() -> None:
    kept = keep_read_lines(PAGE, PREFIX, READ)  # what parse_metrics parses
    assert "_bucket" not in kept and "time_to_first_token" not in kept
    assert "python_gc_objects_collected_total" in kept  # not an sglang: series: left to the parser
    whole, filtered = collect_series(PAGE), collect_series(kept)
    for names, _ in FIELDS.values():
        for name in names:
            assert filtered.get(name) == whole.get(name), name
    s = parse_metrics(PAGE, 5.0)
    assert (s.time, s.queue, s.running, s.token_usage) == (5.0, 3, 21, 0.5)
    assert (s.prompt_tokens_total, s.retractions_total, s.max_total_tokens) == (120.0, 7.0, 422286)


@pytest.mark.parametrize("page", ["this is { not prometheus", "sglang:num_queue_reqs{ 1\n"])
def test_a_broken_page_still_fails(page: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(page, 0.0)


def test_the_read_set_covers_every_field() -> None:
    kept = keep_read_lines("\n".join(f"{PREFIX}{n} 1.0" for names, _ in FIELDS.values() for n in names), PREFIX, READ)
    assert len(kept.splitlines()) == sum(len(names) for names, _ in FIELDS.values())
