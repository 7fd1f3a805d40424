"""A real Prometheus (Debian's package) scrapes a worker, router and agent with deploy/prometheus's jobs; every dashboard expression returns data.

The unit tests (tests/unit/test_deploy_monitoring.py) check names; this checks what a person
opening the dashboard would see: an expression over a labelled counter that only appears when
something goes wrong, a `by (pod)` over a label the scrape never sets, or a ratio with no traffic
behind it shows "no data" or NaN there and here alike. Without the binary the module skips,
except under RADIXSERVE_CI=1 (.ci/run installs the package), where it fails.
"""
from __future__ import annotations

import math
import os
import pathlib
import shutil
import subprocess
import sys

import httpx
import pytest
import yaml

from radixserve.bench.launch import free_port
from radixserve.http_common import poller_limits
from tests.api.conftest import REPO, STARTUP_TIMEOUT_S, terminate
from tests.api.router_fixtures import ADMIN_KEY, Fleet, port_open, wait_for
from tests.unit.test_deploy_monitoring import dashboard_exprs, scrape_jobs

WAIT_S = 180.0   # generous bound on each wait for a scrape to land (never a pass/fail timing)
# Stands in for Grafana's $__rate_interval (max(4 x scrape interval, step + scrape interval)).
# Longer than the whole module may take, so every rate() still covers the traffic sent below
# however slowly the machine runs; which window the dashboard uses does not change what it reads.
RATE_WINDOW = "10m"
GRAFANA_RANGES = ("$__rate_interval", "$__interval", "$__range")
# Values for the target labels deploy/prometheus's relabelling sets from Kubernetes.
TARGET_LABEL_VALUES = {"namespace": lambda job: "radixserve-test", "pod": lambda job: f"{job}-0"}
PROMPT = "one two three four five six seven eight " * 6   # spans pages: prefix hits


def prometheus_binary() -> str:
    """Path of `prometheus`; skips without it, or fails under RADIXSERVE_CI=1."""
    path = shutil.which("prometheus")
    if path:
        return path
    if os.environ.get("RADIXSERVE_CI") == "1":
        pytest.fail("RADIXSERVE_CI=1 and no `prometheus` on PATH: .ci/run should have installed "
                    "Debian's package (apt-get install prometheus)")
    pytest.skip("no `prometheus` on PATH (Debian: apt-get install prometheus; CI installs it)")


def static_config(addresses: dict[str, str]) -> dict:
    """deploy/prometheus/prometheus.yml with each job's Kubernetes discovery and relabelling
    replaced by a static target (`addresses`: job name -> host:port) carrying the labels that
    relabelling would set; metrics_path and the rest of each job are kept as they are."""
    jobs = []
    for name, job in scrape_jobs().items():
        labels = {r["target_label"]: TARGET_LABEL_VALUES[r["target_label"]](name)
                  for r in job.pop("relabel_configs") if "target_label" in r}
        job.pop("kubernetes_sd_configs")
        jobs.append({**job, "static_configs": [{"targets": [addresses[name]], "labels": labels}]})
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": jobs}


class Prometheus:
    """The `prometheus` binary on a free loopback port, its TSDB and log under `folder`."""

    def __init__(self, binary: str, folder: pathlib.Path, config: dict):
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(folder / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'tsdb'}", "--storage.tsdb.retention.time=1h",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(limits=poller_limits(), base_url=self.url, timeout=30, trust_env=False)

    def output(self) -> str:
        self.log.flush()
        return pathlib.Path(self.log.name).read_text()[-8000:]

    def is_ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.output()}")
        try:
            return self.http.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def query(self, expr: str) -> list[dict]:
        """Instant query at now: the result vector (each {"metric": labels, "value": [t, v]})."""
        r = self.http.get("/api/v1/query", params={"query": expr})
        assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
        data = r.json()["data"]
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def stop(self) -> None:
        terminate(self.proc)
        self.http.close()
        self.log.close()


def targets_up(prometheus: Prometheus) -> dict[str, dict] | None:
    """Job -> target labels once every job's last scrape succeeded (None before: a scrape
    can miss its 1 s timeout on a loaded machine, so callers poll this)."""
    up = {s["metric"]["job"]: s["metric"] for s in prometheus.query("up == 1")}
    return up if set(up) == set(scrape_jobs()) else None


def start_agent(router_url: str, folder: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """`radixserve agent` over the router, sweeping twice a second; (process, its URL)."""
    port = free_port()
    with open(folder / "agent.log", "w") as log:   # the child keeps its own copy
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "agent", "--router", router_url, "--port",
             str(port), "--admin-api-key", ADMIN_KEY, "--sweep-interval-s", "0.5",
             "--log-level", "warning"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        assert proc.poll() is None, (folder / "agent.log").read_text()
        return port_open(url)
    wait_for(listening, "the agent to listen", STARTUP_TIMEOUT_S)
    return proc, url


def send_traffic(fleet: Fleet) -> None:
    """Through the router: one prompt three times and once streamed, greedy, so from the
    second on the prompt is a prefix hit and the n-gram proposer drafts the first one's output
    (its shared table), which the model accepts: every speculative ratio has a denominator."""
    for _ in range(3):
        r = fleet.complete(PROMPT, max_tokens=8, temperature=0)
        assert r.status_code == 200, r.text
    r = fleet.complete(PROMPT, max_tokens=8, temperature=0, stream=True)
    assert r.status_code == 200 and "data: [DONE]" in r.text, r.text


@pytest.fixture(scope="module")
def prometheus(request, tmp_path_factory):
    """Prometheus scraping one worker (n-gram speculative decoding on, so the speculative
    panels have numbers), its router and an agent, after three requests and a stream."""
    binary = prometheus_binary()
    folder = tmp_path_factory.mktemp("prometheus")
    fleet = Fleet(request.getfixturevalue("tiny_model_dir"), num_workers=1,
                  worker_flags=("--speculative-algorithm", "ngram"))
    agent = prom = None
    try:
        fleet.wait_ready()
        agent, agent_url = start_agent(fleet.router_url, folder)
        addresses = {"radixserve-worker": fleet.urls[0], "radixserve-router": fleet.router_url,
                     "radixserve-agent": agent_url}
        prom = Prometheus(binary, folder, static_config(
            {job: url.removeprefix("http://") for job, url in addresses.items()}))
        wait_for(prom.is_ready, "prometheus to be ready", WAIT_S)
        # Traffic only after every target's first scrape, so rate() sees the counters rise.
        wait_for(lambda: targets_up(prom), "a first scrape of every target", WAIT_S)
        send_traffic(fleet)
        yield prom
    finally:
        if prom is not None:
            prom.stop()
        if agent is not None:
            agent.terminate()
            agent.wait(30)
        fleet.stop()


def test_each_job_scrapes_its_component_with_the_labels_the_dashboard_groups_by(prometheus):
    up = wait_for(lambda: targets_up(prometheus), "every target up", WAIT_S)
    for job, labels in up.items():
        assert labels["pod"] == f"{job}-0" and labels["namespace"] == "radixserve-test", labels
    prefix = {"radixserve-worker": "radixserve:", "radixserve-router": "radixserve_router:",
              "radixserve-agent": "radixserve_agent:"}
    for job, name_prefix in prefix.items():
        names = prometheus.query(f'count by (__name__) ({{job="{job}"}})')
        assert any(s["metric"]["__name__"].startswith(name_prefix) for s in names), (job, names)


def promql(expr: str) -> str:
    """The dashboard's expression with Grafana's range variables filled in."""
    for variable in GRAFANA_RANGES:
        expr = expr.replace(variable, RATE_WINDOW)
    assert "$" not in expr, f"a Grafana variable this test does not fill: {expr}"
    return expr


@pytest.mark.parametrize("title, expr", dashboard_exprs(),
                         ids=[f"{title} #{i}" for i, (title, _) in enumerate(dashboard_exprs())])
def test_every_dashboard_expression_returns_numbers(prometheus, title, expr):
    """At least one sample, every value a number (not NaN: the traffic above makes every
    ratio and quantile defined), once the scrapes after the traffic have landed."""
    query = promql(expr)
    last: list[dict] = []

    def numbers() -> list[float] | None:
        last[:] = prometheus.query(query)
        values = [float(s["value"][1]) for s in last]
        return values if values and all(math.isfinite(v) for v in values) else None
    try:
        values = wait_for(numbers, f"numbers from {query}", WAIT_S)
    except pytest.fail.Exception:   # say what Prometheus last answered
        values = None
    if values is None:
        pytest.fail(f"{title}: no numbers from {query} in {WAIT_S:.0f} s; last result: {last}")
    assert all(v >= 0 for v in values), (title, values)
