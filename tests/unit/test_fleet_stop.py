"""`radixserve fleet` start-up and stop: worker ports, port checks, progress, and workers the ops agent restarted (pids only in the manifest)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from radixserve.http_common import bind_socket
from radixserve.config import from_args
from radixserve.router import fleet
from radixserve.router.config import RouterConfig
from radixserve.router.fleet import _group_alive, stop_adopted


def test_stop_adopted_kills_workers_listed_under_pids_the_fleet_did_not_start(tmp_path):
    # Started by someone else (as the agent's restarts are): a grandchild in its own session.
    spawn = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(600)'], start_new_session=True, "
             "stdout=subprocess.DEVNULL); print(p.pid)")
    pid = int(subprocess.check_output([sys.executable, "-c", spawn], text=True))
    manifest = tmp_path / "fleet.json"
    manifest.write_text(json.dumps({"router_url": "http://127.0.0.1:1", "workers": [
        {"url": "http://127.0.0.1:2", "pid": pid, "argv": [], "log": None}]}))
    try:
        stop_adopted(str(manifest), workers=[], grace_s=0.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, 9)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stop_adopted_without_a_manifest_or_with_a_bad_one_does_nothing(tmp_path, monkeypatch, caplog):
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr("radixserve.router.fleet._kill_group", lambda pid, sig: signalled.append((pid, sig)))
    stop_adopted(None, workers=[], grace_s=0.0)
    stop_adopted(str(tmp_path / "missing.json"), workers=[], grace_s=0.0)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with caplog.at_level("WARNING"):
        stop_adopted(str(bad), workers=[], grace_s=0.0)
    assert signalled == []
    assert any("cannot read manifest" in r.message for r in caplog.records)


@pytest.mark.parametrize("body, says", [
    ([], "has no list of workers"),
    ({"workers": 5}, "has no list of workers"),
    # 0, 1 and our own group would signal the fleet itself or init's group; True is not a pid
    ({"workers": [5, {"url": "x"}, {"pid": "123"}, {"pid": True}, {"pid": -3}, {"pid": 0},
                  {"pid": 1}, {"pid": os.getpgrp()}, {"pid": 2.5}]}, "skipped 9 worker entries"),
])
def test_a_manifest_of_the_wrong_shape_signals_no_group(body, says, tmp_path, monkeypatch, caplog):
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(fleet, "_kill_group", lambda pid, sig: signalled.append((pid, sig)))
    monkeypatch.setattr(fleet, "STOP_MARGIN_S", 0.0)
    manifest = tmp_path / "fleet.json"
    manifest.write_text(json.dumps(body))
    with caplog.at_level("WARNING", logger="radixserve.fleet"):
        stop_adopted(str(manifest), workers=[], grace_s=0.0)
    assert signalled == []
    assert [r.getMessage() for r in caplog.records if says in r.getMessage()], caplog.text


def test_a_zombie_group_leader_counts_as_stopped():
    """A worker that exited but was not reaped yet (the agent's restarted child after the
    fleet's SIGTERM) must not hold the fleet's stop for the whole grace period."""
    child = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _state(child.pid) != "Z":
        time.sleep(0.05)
    assert _state(child.pid) == "Z"  # exited, not reaped: os.killpg(pid, 0) still succeeds
    assert not _group_alive(child.pid)
    child.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    try:
        assert _group_alive(live.pid)
    finally:
        live.kill()
        live.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_bind_socket_refuses_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="cannot listen"):
            bind_socket("127.0.0.1", taken.getsockname()[1])


def commands(*argv: str) -> list[tuple[str, list[str]]]:
    args, worker_args = fleet.build_parser().parse_known_args(list(argv))
    return fleet.worker_commands(args, from_args(RouterConfig, args), worker_args)


def test_port_moves_the_workers_with_the_router_unless_their_base_is_given():
    derived = commands("--num-workers", "2", "--port", "40000", "--model-path", "m.gguf")
    assert [url for url, _ in derived] == ["http://127.0.0.1:40001", "http://127.0.0.1:40002"]
    for (url, cmd), port in zip(derived, ("40001", "40002")):
        assert cmd[cmd.index("--port") + 1] == port and cmd[cmd.index("--model-path") + 1] == "m.gguf"
    given = commands("--num-workers", "2", "--port", "40000", "--worker-base-port", "50000")
    assert [url for url, _ in given] == ["http://127.0.0.1:50000", "http://127.0.0.1:50001"]
    assert "--worker-base-port" in fleet.build_parser().format_help()


@pytest.mark.parametrize("who", ["router", "worker"])
def test_a_taken_port_stops_the_fleet_before_any_worker_starts(who, taken_port, tmp_path,
                                                              monkeypatch, caplog):
    def spawn(*args):
        raise AssertionError("a worker was started")
    monkeypatch.setattr(fleet, "spawn_worker", spawn)
    ports = (["--port", str(taken_port)] if who == "router"
             else ["--port", "0", "--worker-base-port", str(taken_port)])
    with caplog.at_level("ERROR", logger="radixserve.fleet"):
        assert fleet.main(["--num-workers", "1", "--log-dir", str(tmp_path), *ports]) == 1
    said = {"router": f"fleet: router: cannot listen on 127.0.0.1:{taken_port}: already in use by "
                      f"another process (choose another port with --port)",
            "worker": f"fleet: worker 0: cannot listen on 127.0.0.1:{taken_port}: already in use "
                      f"by another process (move the workers with --worker-base-port, or the "
                      f"whole fleet with --port)"}[who]
    assert [r.getMessage() for r in caplog.records] == [said]


def test_wait_healthy_logs_each_worker_as_it_comes_up(monkeypatch, caplog):
    workers = [SimpleNamespace(url=f"http://w{i}", proc=SimpleNamespace(poll=lambda: None),
                               log_path="log") for i in range(2)]
    monkeypatch.setattr(fleet.httpx, "get", lambda url, timeout: SimpleNamespace(status_code=200))
    with caplog.at_level("INFO", logger="radixserve.fleet"):
        fleet.wait_healthy(workers, timeout_s=60)
    assert [r.getMessage() for r in caplog.records] == [
        "fleet: worker http://w0 is up (1 of 2)", "fleet: worker http://w1 is up (2 of 2)"]


def test_workers_get_the_routers_graceful_shutdown_timeout():
    (_, cmd), = commands("--num-workers", "1", "--graceful-shutdown-timeout", "7.5")
    assert cmd[cmd.index("--graceful-shutdown-timeout") + 1] == "7.5"
    (_, cmd), = commands("--num-workers", "1")
    assert cmd[cmd.index("--graceful-shutdown-timeout") + 1] == "25"


def test_workers_get_the_routers_request_body_and_read_timeouts():
    (_, cmd), = commands("--num-workers", "1", "--request-body-timeout", "2.5", "--request-read-timeout", "7")
    assert cmd[cmd.index("--request-body-timeout") + 1] == "2.5"
    assert cmd[cmd.index("--request-read-timeout") + 1] == "7"
    (_, cmd), = commands("--num-workers", "1")
    assert cmd[cmd.index("--request-body-timeout") + 1] == "10"
    assert cmd[cmd.index("--request-read-timeout") + 1] == "60"


# A worker stand-in: says "ready" once its SIGTERM handler is in place; on SIGTERM it drains
# (exits 0 by itself) or, with "ignore", keeps running until SIGKILLed.
FAKE_WORKER = """
import signal, sys, time
stop = []
if sys.argv[1] == "drain":
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while not stop:
    time.sleep(0.05)
"""


def _fake_worker(tmp_path, mode: str) -> fleet.WorkerProc:
    log = tmp_path / f"{mode}.log"
    worker = fleet.spawn_worker([sys.executable, "-c", FAKE_WORKER, mode], f"http://{mode}", str(log))
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "ready" in log.read_text()
    return worker


def test_stop_waits_for_a_draining_worker_and_kills_one_past_its_grace(tmp_path, monkeypatch, caplog):
    draining = _fake_worker(tmp_path, "drain")
    with caplog.at_level("INFO", logger="radixserve.fleet"):
        fleet.stop_workers([draining], grace_s=600.0)   # exits on SIGTERM long before this
    assert draining.proc.returncode == 0
    assert "requests in flight get up to 600 s (--graceful-shutdown-timeout), SIGKILL after 610 s" \
        in caplog.text
    stubborn = _fake_worker(tmp_path, "ignore")
    monkeypatch.setattr(fleet, "STOP_MARGIN_S", 0.0)
    caplog.clear()
    with caplog.at_level("INFO", logger="radixserve.fleet"):
        fleet.stop_workers([stubborn], grace_s=0.0)
    assert stubborn.proc.returncode == -9
    assert "worker http://ignore still running 0 s after SIGTERM; killing it" in caplog.text
