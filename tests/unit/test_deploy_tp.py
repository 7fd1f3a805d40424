"""deploy/k8s/tp/: one tensor-parallel group over several nodes, one StatefulSet pod per node (docs/parallel.md
"Kubernetes"). Its schema and kustomization are checked with the fleet's in test_deploy.py; here: each pod's args,
with its ordinal as --node-rank, are `serve` flags that parse into one node of the group meeting at pod 0's headless
name; one pod per node; only pod 0 serves the API; every pod answers the probes. No cluster is used."""
from __future__ import annotations

import pytest

from radixserve.drain import FLUSH_S
from tests.unit.test_deploy import (ENGINE_STOP_MARGIN_S, TP, app_of, flag, help_flags, manifests, parse_args,
                                    serves_get)


def tp_group() -> tuple[dict, dict, dict]:
    """(the StatefulSet, its headless Service, the API Service)."""
    docs = manifests(TP)
    (group,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (headless,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == group["spec"]["serviceName"]]
    (api,) = [d for d in docs if d["kind"] == "Service" and d is not headless]
    return group, headless, api


def tp_container() -> dict:
    (only,) = tp_group()[0]["spec"]["template"]["spec"]["containers"]
    return only


def tp_args(ordinal: int) -> list[str]:
    """The container's args as pod `ordinal` runs them: $(NAME) expanded from its downward-API env."""
    spec = tp_container()
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in spec["env"]}
    assert env == {"NODE_RANK": "metadata.labels['apps.kubernetes.io/pod-index']"}   # the pod's ordinal
    return [a.replace("$(NODE_RANK)", str(ordinal)) for a in spec["args"]]


def test_each_tp_pod_is_one_node_of_the_group_and_rank_0_is_pod_0_on_the_headless_service():
    group, headless, _ = tp_group()
    replicas = group["spec"]["replicas"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    (dist,) = [p for p in headless["spec"]["ports"] if p["name"] == "dist"]
    ports = {p["name"]: p["containerPort"] for p in tp_container()["ports"]}
    assert dist["targetPort"] == "dist" and ports["dist"] == dist["port"]
    for ordinal in range(replicas):
        args = tp_args(ordinal)
        assert {a for a in args if a.startswith("--")} <= help_flags("serve")
        _, engine, _ = parse_args(args)   # EngineConfig's checks: --nnodes divides the ranks, --node-rank in range
        assert (engine.nnodes, engine.node_rank) == (replicas, ordinal)
        assert engine.dist_init_addr == f"{group['metadata']['name']}-0.{headless['metadata']['name']}:{dist['port']}"
        assert engine.world_size // engine.nnodes * engine.num_threads == int(
            tp_container()["resources"]["limits"]["cpu"])
    with pytest.raises(ValueError, match="--node-rank"):   # one pod too many would be refused
        parse_args(tp_args(replicas))


def test_tp_pods_spread_one_per_node_and_start_together():
    group = tp_group()[0]
    pod = group["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == group["spec"]["selector"]["matchLabels"]
    assert group["spec"]["podManagementPolicy"] == "Parallel"


def test_only_node_0_serves_the_api_and_every_tp_pod_answers_its_probes():
    from radixserve.server.node_health import PATHS

    group, _, api = tp_group()
    assert api["spec"]["selector"] == {**group["spec"]["selector"]["matchLabels"], "apps.kubernetes.io/pod-index": "0"}
    spec = tp_container()
    listen = int(flag(spec["args"], "--port"))
    assert {p["name"]: p["containerPort"] for p in spec["ports"]}["http"] == listen == api["spec"]["ports"][0]["port"]
    app = app_of("worker")
    probes = {k: v for k, v in spec.items() if k.endswith("Probe")}
    assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}
    for name, probe in probes.items():
        path = probe["httpGet"]["path"]
        assert probe["httpGet"]["port"] == "http" and serves_get(app, path) and path in PATHS, name
    grace = group["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= parse_args(tp_args(0))[0].graceful_shutdown_timeout + FLUSH_S + ENGINE_STOP_MARGIN_S
    assert group["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
