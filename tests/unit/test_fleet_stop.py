"""`radixserve fleet` start-up and stop: port check, and workers the ops agent restarted (pids only in the manifest)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from radixserve.http_common import bind_socket
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
        stop_adopted(str(manifest), workers=[])
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
    stop_adopted(None, workers=[])
    stop_adopted(str(tmp_path / "missing.json"), workers=[])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with caplog.at_level("WARNING"):
        stop_adopted(str(bad), workers=[])
    assert signalled == []
    assert any("cannot read manifest" in r.message for r in caplog.records)


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
