"""LayerSplit (--enable-layer-split, GLM's; SGLang's --enable-cp-cache-layer-split): a context-parallel rank's KVCache
holds its owned_layers' KV, then one scratch layer, which a layer's owner fills by broadcast before attention reads it.

    per layer l, in CPAttention:   post(l) ──► (all-gather of the new tokens' KV) ──► wait(l) ──► attention(l)
      post: the owner sends layer l's pages holding the step's cached prefix (async), the others receive a buffer
      wait: receivers copy it into scratch, until then an older layer's KV (fault.drop_kv_wait: read-before-ready)
Bytes per rank and per broadcast, MLA's one store and DSA's index keys first: docs/parallel.md."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.dist.comm import Communicator, Pending
from radixserve.runner.kv_cache import KVCache, KVPages


def page_slots(kv: KVCache, page_ids: torch.Tensor) -> torch.Tensor:
    """The slots of `page_ids` (n,) int64, (n * page_size,) int64 in page order."""
    return (page_ids[:, None] * kv.page_size + torch.arange(kv.page_size, device=kv.device)).reshape(-1)


def owned_layers(num_layers: int, size: int, rank: int) -> range:
    """Rank `rank`'s contiguous layers of `num_layers` over `size` ranks (SGLang's; the first L % R hold one more)."""
    base, rem = divmod(num_layers, size)
    start = rank * base + min(rank, rem)
    return range(start, start + base + (rank < rem))


@dataclass(slots=True)
class PendingKV:
    """Layer `layer`'s broadcast in flight: buffer (2, KV, pages * page_size, D) compute dtype, K then V (latent:
    (1, 1, ..., D), K only); with `side`, that side buffer's (pages * page_size, *shape) stored rows."""

    layer: int
    page_ids: torch.Tensor
    buffer: torch.Tensor | None
    pending: Pending | None
    receiver: bool
    side: str | None = None


class LayerSplit:
    """One rank's layer ownership and the per-layer broadcast. `events`: (layer, step name) of the current forward,
    in order (tests read it); `fault`: None or chaos/cp_faults.py's LayerSplitFaults (`drop_kv_wait`, `stale_value`)."""

    def __init__(self, num_layers: int, comm: Communicator):
        self.num_layers, self.comm = num_layers, comm
        self.owned = owned_layers(num_layers, comm.size, comm.rank)
        self.owners = [r for r in range(comm.size) for _ in owned_layers(num_layers, comm.size, r)]
        self.scratch = len(self.owned)
        self.events: list[tuple[int, str]] = []
        self.late: list[PendingKV] = []
        self.fault = None

    @property
    def num_storage_layers(self) -> int:
        return len(self.owned) + 1

    def storage(self, layer: int) -> int:
        """The KVCache layer index that holds model layer `layer` on this rank: its own, or the scratch."""
        return layer - self.owned.start if layer in self.owned else self.scratch

    def post(self, kv: KVCache, layer: int, page_ids: torch.Tensor, side: str | None = None) -> PendingKV:
        """Post layer `layer`'s broadcast of `page_ids` (n,) int64 from its owner, KV or side `side` (n = 0: none)."""
        self.events.append((layer, f"broadcast {side or 'kv'}"))
        owner = self.owners[layer]
        receiver = owner != self.comm.rank
        if page_ids.numel() == 0:
            return PendingKV(layer, page_ids, None, None, receiver, side)
        if side is not None:
            if receiver:
                shape, dtype = kv.side_export(side, page_ids.numel())
                buffer = torch.empty((page_ids.numel() * kv.page_size, *shape[3:]), dtype=dtype, device=kv.device)
            else:
                buffer = kv.read_side(side, self.storage(layer), page_slots(kv, page_ids))
            return PendingKV(layer, page_ids, buffer, self.comm.broadcast_async(buffer, owner), receiver, side)
        stores = 1 if kv.latent else 2
        if receiver:
            shape = (stores, kv.num_kv_heads, page_ids.numel() * kv.page_size, kv.head_dim)
            buffer = torch.empty(shape, dtype=kv.compute_dtype, device=kv.device)
        else:
            buffer = torch.stack(kv.read_pages(self.storage(layer), page_ids)[:stores])
        return PendingKV(layer, page_ids, buffer, self.comm.broadcast_async(buffer, owner), receiver)

    def wait(self, kv: KVCache, pending: PendingKV) -> None:
        """The wait(KV) step: after it, scratch holds the owner's pages (receivers). Dropped by the fault, the broadcast
        lands only in finish(), after attention has read the scratch. A side buffer's wait is never dropped."""
        if pending.side is not None:
            self.events.append((pending.layer, f"wait {pending.side}"))
            self._land(kv, pending)
            return
        if self.fault is not None and self.fault.drop_kv_wait:
            self.events.append((pending.layer, "wait kv dropped"))
            self.late.append(pending)
            if pending.receiver and pending.pending is not None and self.fault.stale_value is not None:
                k, v = kv.read_pages(self.scratch, pending.page_ids)     # what an un-landed scratch may hold
                self._write_scratch(kv, pending.page_ids, torch.full_like(k, self.fault.stale_value),
                                    torch.full_like(v, self.fault.stale_value))
            return
        self.events.append((pending.layer, "wait kv"))
        self._land(kv, pending)

    def finish(self, kv: KVCache) -> None:
        """End of a forward: land the broadcasts whose wait was dropped."""
        for pending in self.late:
            self._land(kv, pending)
        self.late.clear()

    def gather_pages(self, kv: KVCache, page_ids: list[int], side_layers: dict[str, tuple[int, ...]]) -> KVPages | None:
        """Pages `page_ids` of all L layers at rank 0 (KVCache.export_pages' layout; others get None): each rank r > 0
        sends rank 0 its own layers' K, V and side rows (side buffer `name` in model layers side_layers[name])."""
        mine = kv.export_pages(page_ids)
        num_side = {name: sum(layer in self.owned for layer in layers) for name, layers in side_layers.items()}
        own = [mine.k[:len(self.owned)], mine.v[:len(self.owned)],
               *(mine.side[name][:num_side[name]] for name in sorted(side_layers))]
        if self.comm.rank != 0:
            for pending in [self.comm.send_async(t.to(self.comm.device), 0) for t in own if t.numel()]:
                pending.wait()
            return None
        parts = [own]
        for rank in range(1, self.comm.size):
            owned = owned_layers(self.num_layers, self.comm.size, rank)
            counts = [len(owned)] * 2 + [sum(layer in owned for layer in side_layers[name])
                                         for name in sorted(side_layers)]
            theirs = [torch.empty((count, *t.shape[1:]), dtype=t.dtype, device=self.comm.device)
                      for count, t in zip(counts, own)]
            parts.append([self.comm.recv(t, rank).cpu() if t.numel() else t.cpu() for t in theirs])
        k, v, *side = (torch.cat(tensors) for tensors in zip(*parts))
        return KVPages(k, v, dict(zip(sorted(side_layers), side)))

    def _land(self, kv: KVCache, p: PendingKV) -> None:
        if p.pending is None:
            return
        p.pending.wait()
        if p.receiver and p.side is not None:
            kv.write_side(p.side, self.scratch, page_slots(kv, p.page_ids), p.buffer)
        elif p.receiver:
            self._write_scratch(kv, p.page_ids, p.buffer[0], p.buffer[-1])

    def _write_scratch(self, kv: KVCache, page_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (KV, pages * page_size, D) into the scratch layer's `page_ids`."""
        kv.write(self.scratch, page_slots(kv, page_ids), k.transpose(0, 1), v.transpose(0, 1))
