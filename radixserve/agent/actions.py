"""The agent's hands: drain, undrain, isolate and policy changes through the router's admin API; restarts from the fleet manifest."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
import subprocess
import time
from typing import Any

from radixserve.agent.ladder import Decision
from radixserve.router.client import AsyncRouterAdminClient

logger = logging.getLogger("radixserve.agent")


def _url_key(url: str) -> str:
    return url.rstrip("/")


class Manifest:
    """The JSON `radixserve fleet` writes: {"router_url", "workers": [{"url", "pid", "argv",
    "log"}]}. Read on every use (the fleet may rewrite it); written atomically."""

    def __init__(self, path: str):
        self.path = pathlib.Path(path)

    def read(self) -> dict:
        return json.loads(self.path.read_text())

    def entry(self, url: str) -> dict | None:
        for worker in self.read().get("workers", []):
            if _url_key(worker["url"]) == _url_key(url):
                return worker
        return None

    def set_pid(self, url: str, pid: int) -> None:
        data = self.read()
        for worker in data["workers"]:
            if _url_key(worker["url"]) == _url_key(url):
                worker["pid"] = pid
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, self.path)


class Actions:
    """Applies decisions. `manifest_path` set means supervising: restarts kill the worker's
    process group (or process, when it leads none) and re-spawn its argv. Errors:
    RouterAdminError / httpx errors from the router, OSError or KeyError from a restart."""

    def __init__(self, admin: AsyncRouterAdminClient, manifest_path: str | None,
                 kill_grace_s: float = 5.0):
        self.admin, self.kill_grace_s = admin, kill_grace_s
        self.manifest = Manifest(manifest_path) if manifest_path else None
        self.children: dict[int, subprocess.Popen] = {}   # workers this agent re-spawned

    def supervised(self) -> frozenset[str]:
        """Worker URLs the manifest lists (empty when not supervising)."""
        if self.manifest is None:
            return frozenset()
        try:
            return frozenset(w["url"] for w in self.manifest.read().get("workers", []))
        except (OSError, ValueError) as exc:
            logger.warning("fleet manifest unreadable: %s", exc)
            return frozenset()

    async def apply(self, d: Decision, engine_pid: int | None = None) -> Any:
        """Carry out one acting decision; returns what the router or the restart answered."""
        if d.action in ("drain", "isolate"):
            return await self.admin.drain(d.worker)
        if d.action == "undrain":
            return await self.admin.undrain(d.worker)
        if d.action == "set_policy_params":
            return await self.admin.set_policy_params(**d.params)
        if d.action == "restart":
            return await self.restart(d.worker, engine_pid)
        raise ValueError(f"not an acting decision: {d.action}")

    async def restart(self, url: str, engine_pid: int | None) -> dict:
        """Stop the worker (SIGTERM, SIGKILL after `kill_grace_s`; its engine too) and start
        its argv again with output appended to its log; the manifest gets the new pid."""
        if self.manifest is None:
            raise RuntimeError("not supervising: no fleet manifest")
        entry = self.manifest.entry(url)
        if entry is None:
            raise KeyError(f"{url} is not in the fleet manifest")
        pid = int(entry["pid"])
        await self._stop(pid, engine_pid)
        log = open(entry["log"], "ab") if entry.get("log") else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(entry["argv"], stdout=log, stderr=subprocess.STDOUT,
                                    cwd=entry.get("cwd"), start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self.children[proc.pid] = proc
        self.manifest.set_pid(url, proc.pid)
        logger.info("restarted %s: pid %d -> %d", url, pid, proc.pid)
        return {"old_pid": pid, "new_pid": proc.pid}

    async def _stop(self, pid: int, engine_pid: int | None) -> None:
        _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        while time.monotonic() < deadline and self._alive(pid):
            await asyncio.sleep(0.1)
        if self._alive(pid):
            logger.warning("pid %d did not stop in %.1f s: SIGKILL", pid, self.kill_grace_s)
            _signal(pid, signal.SIGKILL)
            if engine_pid:  # it would exit on its own once its parent is gone; do not wait
                _signal(engine_pid, signal.SIGKILL, group=False)
        while self._alive(pid):
            await asyncio.sleep(0.05)

    def reap(self) -> None:
        """Collect restarted workers that have exited (stopped by the fleet, or crashed), so
        none lingers as a zombie, which the fleet's stop would take for a live worker."""
        for pid in list(self.children):
            self._alive(pid)

    def _alive(self, pid: int) -> bool:
        child = self.children.get(pid)
        if child is not None:
            if child.poll() is None:
                return True
            del self.children[pid]
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
        except (FileNotFoundError, ProcessLookupError):
            return False
        except OSError:   # no /proc (not Linux): ask the kernel
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True


def _signal(pid: int, sig: int, group: bool = True) -> None:
    """Signal the process group `pid` leads, or only `pid` when it leads none (never the
    group of whoever started it, which may be the fleet or this agent)."""
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        logger.debug("pid %d already gone", pid)
