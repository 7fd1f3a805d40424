"""One rank of test_dist_comm.py's 2-process gloo group: `python -m tests.unit.dist_worker RANK ADDR OUT_DIR`.

Every collective on known inputs; then rank 1 waits for a step message while rank 0's all-reduce times out (a hung
peer), after which rank 0 exits (a dead leader) and rank 1's wait must fail. Results: OUT_DIR/rank{R}.pt."""
from __future__ import annotations

import os
import sys

import torch

from radixserve.dist.comm import DistError, init_communicator

TIMEOUT_S = 3.0


def error_of(fn) -> str:
    try:
        fn()
    except DistError as exc:
        return str(exc)
    return ""


def ops(comm, out: dict) -> None:
    r = comm.rank
    out["sum_f32"] = comm.all_reduce(torch.arange(6, dtype=torch.float32).view(2, 3) * (r + 1) + 0.25)
    out["sum_i64"] = comm.all_reduce(torch.tensor([2**40 + r, -7 * r], dtype=torch.int64))
    base = torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * r
    out["gather_dim0"] = comm.all_gather(base, dim=0)
    out["gather_last_noncontig"] = comm.all_gather(base.t(), dim=-1)   # (4, 3) view, not contiguous
    out["bcast"] = comm.broadcast(torch.full((5,), float(r + 7)), src=1)
    out["obj"] = comm.broadcast_object({"step": [1, 2, r]} if r == 0 else None)
    out["calls"], out["bytes"] = dict(comm.calls), dict(comm.bytes)


def main(argv: list[str]) -> int:
    rank, addr, out_dir = int(argv[0]), argv[1], argv[2]
    torch.set_num_threads(1)
    comm = init_communicator(rank, 2, addr, TIMEOUT_S)
    out: dict = {}
    ops(comm, out)
    if rank == 0:   # rank 1 never enters this all-reduce: it times out; then rank 0 dies
        out["hang_error"] = error_of(lambda: comm.all_reduce(torch.ones(3)))
        torch.save(out, os.path.join(out_dir, "rank0.pt"))
        os._exit(3)
    out["dead_error"] = error_of(lambda: comm.broadcast_object())   # waits for a step that never comes
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
