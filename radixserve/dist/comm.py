"""Counted, timed-out collectives and point-to-point ops of one torch.distributed group (gloo on CPU, NCCL on CUDA).

Two groups over the same ranks: `group` (the forward's collectives and sends) times out after `timeout_s`, so a dead or
stuck peer ends every rank with DistError, never a hang; `step_group` (gloo, no practical timeout) carries rank 0's step
messages, which idle followers wait on (docs/parallel.md)."""
from __future__ import annotations

import datetime
import logging
import pickle
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STEP_TIMEOUT = datetime.timedelta(days=365)
JOIN_TIMEOUT_S = 300.0
PROBE_VALUE = 1.0


class DistError(RuntimeError):
    """A collective failed: a peer exited, hung past the timeout, or answered wrongly."""


class Communicator:
    """One process's handle on the group (ranks numbered within it). Counters, per op: `calls[op]`, `bytes[op]`, the
    bytes this rank contributes (all_reduce, broadcast: the tensor's nbytes; all_gather: its input's; broadcast_object:
    8 + the pickle) or, point to point, sends ("send") and receives ("recv") (the tensor's nbytes)."""

    def __init__(self, rank: int, size: int, device: torch.device, group: Any = None, step_group: Any = None):
        self.rank, self.size, self.device = rank, size, device
        self.group, self.step_group = group, step_group
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def _count(self, op: str, num_bytes: int) -> None:
        self.calls[op] += 1
        self.bytes[op] += num_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the same bits. Returns x."""
        self._count("all_reduce", x.nelement() * x.element_size())
        _run("all_reduce", dist.all_reduce, x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """x (..., n, ...) from every rank -> concatenated along `dim` in rank order (..., size * n, ...)."""
        x = x.contiguous()
        self._count("all_gather", x.nelement() * x.element_size())
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _run("all_gather", dist.all_gather, parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` into every rank's `x` (same shape and dtype everywhere), in place. Returns x."""
        self._count("broadcast", x.nelement() * x.element_size())
        _run("broadcast", dist.broadcast, x, group=self.group, group_src=src)
        return x

    def broadcast_async(self, x: torch.Tensor, src: int = 0) -> Pending:
        """broadcast() in the background: `x` holds rank `src`'s values once the Pending's wait() returns; counted."""
        self._count("broadcast", x.nelement() * x.element_size())
        return Pending(_run("broadcast", dist.broadcast, x, group=self.group, async_op=True, group_src=src))

    def send_async(self, x: torch.Tensor, dst: int) -> Pending:
        """Send `x` to rank `dst` in the background; keep `x` unchanged until Pending.wait(). Counted as "send"."""
        x = x.contiguous()
        self._count("send", x.nelement() * x.element_size())
        return Pending(_run("send", dist.isend, x, group=self.group, group_dst=dst), "send", x)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s matching send into `x` (the same shape and dtype as sent), blocking; DistError when `src`
        exited or did not send within the group's timeout. Counted as "recv": x's nbytes. Returns x."""
        self._count("recv", x.nelement() * x.element_size())
        _run("recv", dist.recv, x, group=self.group, group_src=src)
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj` (others pass None) to every rank over the step group (CPU, no timeout)."""
        size = torch.zeros(1, dtype=torch.int64)
        data = b""
        if self.rank == src:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size[0] = len(data)
        _run("broadcast_object", dist.broadcast, size, src, group=self.step_group)
        payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src
                   else torch.empty(int(size[0]), dtype=torch.uint8))
        _run("broadcast_object", dist.broadcast, payload, src, group=self.step_group)
        self._count("broadcast_object", 8 + payload.nelement())
        return obj if self.rank == src else pickle.loads(payload.numpy().tobytes())

    def probe(self) -> None:
        """All-reduce PROBE_VALUE on each group it has; DistError unless each gives size * PROBE_VALUE."""
        for name, group in (("group", self.group), ("step group", self.step_group)):
            if group is None:
                continue
            x = torch.full((1,), PROBE_VALUE, device=self.device if group is self.group else "cpu")
            _run("probe", dist.all_reduce, x, group=group)
            if x.item() != self.size * PROBE_VALUE:
                raise DistError(f"rank {self.rank}: start-up probe on the {name} summed {x.item()}, "
                                f"expected {self.size * PROBE_VALUE}")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class Pending:
    """An op in flight (Communicator.broadcast_async, send_async); holds the tensor it reads or writes."""

    def __init__(self, work: Any, op: str = "broadcast", tensor: torch.Tensor | None = None):
        self.work, self.op, self.tensor = work, op, tensor

    def wait(self) -> None:
        """Block until it has landed; DistError when a peer exited or the group's timeout passed."""
        _run(self.op, self.work.wait)


def _run(op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError) as exc:
        raise DistError(f"{op} failed on rank {dist.get_rank()}: a peer exited or timed out ({exc})") from exc


def init_communicator(rank: int, size: int, init_addr: str, timeout_s: float, device: torch.device | str = "cpu",
                      join_timeout_s: float = JOIN_TIMEOUT_S) -> Communicator:
    """Join the group of `size` ranks at `init_addr` ("host:port", rank 0 listens there) and probe it. The forward's
    group is NCCL on a CUDA `device`, else gloo. Raises DistError when a rank does not join within `join_timeout_s`."""
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    ranks = list(range(size))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=max(join_timeout_s, timeout_s)))
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
        step_group = dist.new_group(ranks, timeout=STEP_TIMEOUT, backend="gloo")
    except (RuntimeError, ValueError) as exc:
        raise DistError(f"rank {rank} of {size} could not join the group at {init_addr} within "
                        f"{join_timeout_s} s: {exc}") from exc
    comm = Communicator(rank, size, device, group, step_group)
    comm.probe()
    logger.info("rank %d of %d joined the %s group at %s (collective timeout %.0f s)",
                rank, size, backend, init_addr, timeout_s)
    return comm


def split_group(comm: Communicator, group_size: int, timeout_s: float) -> Communicator:
    """Collective over all of `comm`'s ranks: cut them into consecutive groups of `group_size` (rank // group_size),
    each timed out after `timeout_s`, and return this rank's, probed, with its own counters and no step group."""
    backend = "nccl" if comm.device.type == "cuda" else "gloo"
    mine = None
    try:
        for first in range(0, comm.size, group_size):
            group = dist.new_group(list(range(first, first + group_size)),
                                   timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
            mine = group if first <= comm.rank < first + group_size else mine
    except (RuntimeError, ValueError) as exc:
        raise DistError(f"rank {comm.rank} could not build its group of {group_size}: {exc}") from exc
    sub = Communicator(comm.rank % group_size, group_size, comm.device, mine)
    sub.probe()
    return sub
