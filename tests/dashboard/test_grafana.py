"""The Grafana dashboard (deploy/grafana/sglang-pacer.json) loads, and every PromQL query names only
metrics that exist: the proxy's, from its own registry's page; SGLang's, from the engine table the
proxy reads them by (proxy/engines/sglang/metrics.py); vLLM's, from a page recorded from vLLM."""

from __future__ import annotations

import re
from pathlib import Path

import orjson

from proxy.engines.base import Sample
from proxy.engines.sglang import metrics as sglang_metrics
from proxy.observe.nvml import GpuDevice, GpuReport
from proxy.request.admission import AdmissionQueue
from proxy.request.pacing import LoadBoard
from proxy.server.metrics import ProxyMetrics
from proxy.workers.base import WorkerInfo, WorkerState

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "sglang-pacer.json"
VLLM_PAGE = ROOT / "tests" / "engines" / "fixtures" / "vllm_0.32_cpu_metrics_busy.txt"

FUNCTIONS = {"rate", "irate", "increase", "sum", "max", "min", "avg", "histogram_quantile", "clamp_min", "count"}
KEYWORDS = {"by", "without", "on", "ignoring", "and", "or", "unless"}
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def page_names(text: str) -> set[str]:
    return {line.split()[0].split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}


def proxy_names() -> set[str]:
    board = LoadBoard()
    board.publish("w0", Sample(time=1.0, queue=1, running=2, token_usage=0.3), None)
    device = GpuDevice(index=0, name="H100", uuid=None, memory_total_bytes=8, memory_used_bytes=4,
                       memory_free_bytes=4, utilization_gpu_pct=50, utilization_memory_pct=10)  # fmt: skip
    report = GpuReport(time=1.0, devices=(device,))
    w0 = WorkerInfo(id="w0", url="http://w0", state=WorkerState.READY, managed=True)
    queue = AdmissionQueue(10)
    metrics = ProxyMetrics(queue, {"default": queue}, board, lambda: [w0], lambda: report)
    return page_names(metrics.render().decode())


def engine_names() -> set[str]:
    sglang = {sglang_metrics.PREFIX + n for names, _ in sglang_metrics.FIELDS.values() for n in names}
    return sglang | page_names(VLLM_PAGE.read_text())


def metric_names(expr: str) -> set[str]:
    """The metric names a query reads: label matchers, ranges, grouping labels and functions removed."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)
    names = set()
    for m in IDENT.finditer(text):
        word = m.group(0)
        after = text[m.end() :].lstrip()
        if after.startswith("(") or word in KEYWORDS:
            assert word in FUNCTIONS, f"unknown function {word!r} in {expr}"
            continue
        names.add(word)
    return names


def queries() -> list[str]:
    dash = orjson.loads(DASHBOARD.read_bytes())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_the_dashboard_loads_and_every_panel_has_a_place() -> None:
    dash = orjson.loads(DASHBOARD.read_bytes())
    assert dash["uid"] == "sglang-pacer" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"


def test_every_query_names_only_exported_metrics() -> None:
    known_proxy, known_engines = proxy_names(), engine_names()
    assert "pacer_queue_depth" in known_proxy and "vllm:num_requests_waiting" in known_engines
    used: set[str] = set()
    for expr in queries():
        names = metric_names(expr)
        assert names, f"no metric in {expr}"
        unknown = names - known_proxy - known_engines
        assert not unknown, f"{expr}: {sorted(unknown)} are exported by neither the proxy nor the engines"
        used |= names
    # the dashboard covers the three sources
    assert any(n.startswith("pacer_") for n in used)
    assert any(n.startswith("sglang:") for n in used) and any(n.startswith("vllm:") for n in used)


def test_the_query_check_catches_a_wrong_name() -> None:
    assert metric_names('sum by (priority) (rate(pacer_queue_depth{x="a"}[1m]))') == {"pacer_queue_depth"}
    assert metric_names("pacer_gpu_memory_used_bytes / pacer_gpu_memory_total_bytes") == {
        "pacer_gpu_memory_used_bytes",
        "pacer_gpu_memory_total_bytes",
    }
    assert "sglang:num_queue_requests" not in engine_names()
