"""dist/comm.py on a 2-process gloo group (C56): every collective exact against a reference, the byte counters
equal their formulas, and a hung or dead peer ends the waiting rank with DistError instead of a hang (C54)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from radixserve.runner.tp import free_init_addr

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_pair(out_dir: pathlib.Path) -> tuple[list[int], list[dict | None]]:
    """Both ranks' results; each process must exit 0 within the test's bound (no hang)."""
    addr = free_init_addr()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.dist_worker", str(r), addr, str(out_dir)],
                              cwd=REPO, env=env) for r in range(2)]
    try:
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return codes, [torch.load(out_dir / f"rank{r}.pt") if (out_dir / f"rank{r}.pt").exists() else None
                   for r in range(2)]


@pytest.fixture(scope="module")
def ops_results(tmp_path_factory):
    codes, results = run_pair(tmp_path_factory.mktemp("ops"))
    assert codes == [3, 0]
    return results


def test_collectives_equal_their_references(ops_results):
    f32 = sum(torch.arange(6, dtype=torch.float32).view(2, 3) * (r + 1) + 0.25 for r in range(2))
    base = [torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * r for r in range(2)]
    for out in ops_results:
        assert torch.equal(out["sum_f32"], f32)
        assert out["sum_i64"].tolist() == [2 * 2**40 + 1, -7]
        assert torch.equal(out["gather_dim0"], torch.cat(base, dim=0))
        assert torch.equal(out["gather_last_noncontig"], torch.cat([b.t() for b in base], dim=-1))
        assert out["bcast"].tolist() == [8.0] * 5
        assert out["obj"] == {"step": [1, 2, 0]}


def test_byte_counters_equal_the_formulas(ops_results):
    """all_reduce: numel x itemsize; all_gather: the input's; broadcast_object: 8 + the pickle (the same on both)."""
    import pickle
    obj = 8 + len(pickle.dumps({"step": [1, 2, 0]}, protocol=pickle.HIGHEST_PROTOCOL))
    for out in ops_results:
        assert out["calls"] == {"all_reduce": 2, "all_gather": 2, "broadcast": 1, "broadcast_object": 1}
        assert out["bytes"] == {"all_reduce": 6 * 4 + 2 * 8, "all_gather": 2 * 12 * 4, "broadcast": 5 * 4,
                                "broadcast_object": obj}


def test_a_hung_peer_times_the_collective_out(ops_results):
    assert "all_reduce failed on rank 0" in ops_results[0]["hang_error"]
    assert "Timed out" in ops_results[0]["hang_error"]


def test_a_dead_leader_ends_a_waiting_follower(ops_results):
    assert "broadcast_object failed on rank 1" in ops_results[1]["dead_error"]
