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
from radixserve.router.worker import AGENT

logger = logging.getLogger("radixserve.agent")


def _url_key(url: str) -> str:
    return url.rstrip("/")


class Manifest:
    """`radixserve fleet`'s JSON {"router_url", "workers": [{"url", "pid", "argv", "log"}]}; re-read on every use."""

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
    """Applies decisions (supervises if `manifest_path`); raises RouterAdminError, httpx, OSError/KeyError (restart)."""

    def __init__(self, admin: AsyncRouterAdminClient, manifest_path: str | None,
                 kill_grace_s: float = 5.0):
        self.admin, self.kill_grace_s = admin, kill_grace_s
        self.manifest = Manifest(manifest_path) if manifest_path else None
        self.children: dict[int, subprocess.Popen] = {}   # re-spawned workers by pid

    def supervised(self) -> frozenset[str]:
        if self.manifest is None:
            return frozenset()
        try:
            return frozenset(w["url"] for w in self.manifest.read().get("workers", []))
        except (OSError, ValueError) as exc:
            logger.warning("fleet manifest unreadable: %s", exc)
            return frozenset()

    async def apply(self, d: Decision, engine_pid: int | None = None) -> Any:
        """Carry out one acting decision; returns the router's or the restart's answer."""
        if d.action in ("drain", "isolate"):
            return await self.admin.drain(d.worker, by=AGENT)   # a later agent adopts it
        if d.action == "undrain":
            return await self.admin.undrain(d.worker, by=AGENT)   # never the operator's drain
        if d.action == "set_policy_params":
            return await self.admin.set_policy_params(**d.params)
        if d.action == "restart":
            return await self.restart(d.worker, engine_pid)
        raise ValueError(f"not an acting decision: {d.action}")

    async def restart(self, url: str, engine_pid: int | None) -> dict:
        """SIGTERM the worker and its engine (SIGKILL after `kill_grace_s`), re-spawn its argv; new pid to the manifest."""
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
            if engine_pid:
                _signal(engine_pid, signal.SIGKILL, group=False)
        while self._alive(pid):
            await asyncio.sleep(0.05)

    def reap(self) -> None:
        """Reap exited re-spawned workers, so no zombie looks alive to the fleet's stop."""
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
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False
        except OSError:   # no /proc (not Linux)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True


def _signal(pid: int, sig: int, group: bool = True) -> None:
    """Signal the process group `pid` leads, or only `pid` (never its starter's group)."""
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        logger.debug("pid %d already gone", pid)
