"""deploy/prometheus and deploy/grafana: the scrape config finds every component's pods on the
port and route they serve /metrics on, and every PromQL expression of the dashboard uses only
metric and label names the code exports (read from the real metrics classes, not a list)."""
from __future__ import annotations

import json
import pathlib
import re

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_deploy import COMPONENTS, app_of, container, serves_get, workload

REPO = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "radixserve.json"
TARGET_LABELS = {"pod", "namespace", "job", "instance"}   # added by the scrape config / Prometheus
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "gauge": ("",), "summary": ("", "_count", "_sum", "_created"), "unknown": ("",)}
PROMQL_FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "increase", "irate",
                    "histogram_quantile", "by", "without", "on", "ignoring", "and", "or", "unless"}


def exported_metrics() -> dict[str, set[str]]:
    """Sample name -> label names, over one worker, one router and one agent that saw a little
    traffic (so labelled families have samples to read their labels from)."""
    from radixserve.agent.metrics import AgentMetrics
    from radixserve.router.metrics import RouterMetrics
    from radixserve.server import metrics as worker

    stats = {key: 0.0 for _, key, _ in (*worker.ENGINE_GAUGES, *worker.ENGINE_COUNTERS)}
    stats.update({key: [1.0] for _, key, _ in worker.SPEC_BY_POSITION}, num_finished_requests=0)
    worker_text = worker.ServerMetrics("m").render(stats)
    router = RouterMetrics()
    router.requests.labels("w", "success").inc()
    router.on_transition("w", "closed", "open")
    router.in_flight.labels("w").set(0)
    router.healthy.labels("w").set(1)
    router.migrations.labels("success").inc()
    router.anomalies.labels("spec_acceptance", "retried").inc()
    agent = AgentMetrics(lambda: {"workers": {"w": "observe"}, "panic": False, "gpu_checks": False})
    agent.decisions.labels("drain").inc()
    agent.failed.labels("drain").inc()
    agent.findings.labels("unresponsive").inc()
    names: dict[str, set[str]] = {}
    for text in (worker_text, router.render(), agent.render()):
        for family in text_string_to_metric_families(text.decode()):
            for suffix in SUFFIXES[family.type]:
                names.setdefault(family.name + suffix, set())
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def parse_promql(expr: str) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """(functions called, metric names, metric name -> label names in its {matchers}) plus
    grouping labels under the key "by". Enough PromQL for dashboards: selectors, matchers,
    ranges, aggregations with by/without, arithmetic between them."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)              # string literals
    matchers: dict[str, set[str]] = {}
    for name, body in re.findall(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", text):
        matchers.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body))
    matchers["by"] = {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text)
                      for label in group.split(",") if label.strip()}
    text = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)             # matchers, ranges
    functions, metrics = set(), set()
    for match in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?", text):
        (functions if match.group(2) else metrics).add(match.group(1))
    return functions, metrics, matchers


def test_the_promql_reader_finds_names_functions_and_labels():
    functions, metrics, labels = parse_promql(
        'histogram_quantile(0.9, sum by (le, pod) (rate(a:b_bucket{kind!="x",pod=~"w.*"}[5m])))'
        ' / on() max(process_open_fds) * 2')
    assert functions == {"histogram_quantile", "sum", "rate", "on", "max"}
    assert metrics == {"a:b_bucket", "process_open_fds"}
    assert labels == {"a:b_bucket": {"kind", "pod"}, "by": {"le", "pod"}}


@pytest.mark.parametrize("title, expr", dashboard_exprs(),
                         ids=[f"{title} #{i}" for i, (title, _) in enumerate(dashboard_exprs())])
def test_every_dashboard_expression_uses_exported_metrics_and_labels(title, expr):
    exported = exported_metrics()
    functions, metrics, matchers = parse_promql(expr)
    assert functions <= PROMQL_FUNCTIONS, functions - PROMQL_FUNCTIONS
    assert metrics, f"{title}: no metric in {expr}"
    assert metrics <= set(exported), f"{title}: not exported: {metrics - set(exported)}"
    available = TARGET_LABELS.union(*(exported[m] for m in metrics))
    for name, labels in matchers.items():
        assert labels <= available, f"{title}: {name} has no label {labels - available}"


def test_the_dashboard_has_the_panels_an_operator_watches():
    used = set().union(*(parse_promql(expr)[1] for _, expr in dashboard_exprs()))
    for watched in ("radixserve:num_queue_reqs", "radixserve:cached_tokens_total",
                    "radixserve:time_to_first_token_seconds_bucket",
                    "radixserve:inter_token_latency_seconds_bucket", "radixserve:token_usage",
                    "radixserve:generation_tokens_total", "radixserve:num_anomalies_total",
                    "radixserve:anomaly_detections_total", "radixserve_router:output_anomalies_total",
                    "radixserve:spec_accepted_tokens_total", "radixserve_agent:decisions_total",
                    "radixserve_router:retries_total", "radixserve_router:breaker_state",
                    "radixserve_router:stream_migrations_total"):
        assert watched in used, watched
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p.get("targets", []))


def scrape_jobs() -> dict[str, dict]:
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_is_scraped_on_its_metrics_route_and_port(component):
    job = scrape_jobs()[f"radixserve-{component}"]
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"]
             if r.get("action") == "keep"}
    labels = workload(component)["spec"]["template"]["metadata"]["labels"]
    assert keeps[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)] == labels["app.kubernetes.io/name"]
    assert keeps[("__meta_kubernetes_pod_label_app_kubernetes_io_component",)] == component
    port_name = keeps[("__meta_kubernetes_pod_container_port_name",)]
    assert port_name in {p["name"] for p in container(component)["ports"]}
    assert serves_get(app_of(component), job["metrics_path"])
    targets = {r.get("target_label") for r in job["relabel_configs"]} - {None}
    assert targets <= TARGET_LABELS


def test_only_the_three_components_are_scraped():
    assert set(scrape_jobs()) == {f"radixserve-{c}" for c in COMPONENTS}
