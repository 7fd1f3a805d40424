"""Tensor-parallel ranks: rank 0's runner broadcasts each step to the followers, which run the same forward.

    rank 0 (engine process)                     rank r > 0 (`python -m radixserve.runner.tp r`)
    scheduler -> TPRunner.run(batch)            follow(): batch = broadcast_object()
      broadcast_object(batch)  ───────────────►   runner.forward(batch)
      runner.run(batch): forward + sample          (the same collectives, no sampling)
    close(): broadcast_object(None) ──────────►   exits 0

Only rank 0 samples (the next batch carries the tokens). Also --cp-size (runner/cp.py) and --pp-size (runner/pp.py)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import weakref

from radixserve.dist.comm import Communicator, DistError, init_communicator, split_group
from radixserve.engine.runner_api import ScheduledSeq, SeqResult
from radixserve.engine_config import EngineConfig
from radixserve.runner.cp import CPModelRunner
from radixserve.runner.device import resolve_device
from radixserve.runner.kv_transfer import KVExport, KVImport
from radixserve.runner.model_runner import ModelRunner
from radixserve.runner.pp import PPModelRunner

logger = logging.getLogger(__name__)

CONFIG_ENV = "RADIXSERVE_TP_CONFIG"     # the EngineConfig as JSON, for follower processes
FOLLOWER_EXIT_S = 30.0
PING = "ping"   # TPRunner.check_group's message, dropped by the followers


def for_followers(batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The batch without what only sampling reads (output ids; prompt ids unless prompt logprobs need them)."""
    return [dataclasses.replace(s, output_ids=[], prompt_ids=s.prompt_ids if s.prompt_logprob_start is not None
                                else []) for s in batch]


class Followers:
    """The group as rank 0 holds it: stop() sends None to end the followers' loops and waits for the processes this
    rank started; close() also leaves the group. Each runs once."""

    def __init__(self, comm: Communicator, processes: list[subprocess.Popen]):
        self.comm, self.processes = comm, processes
        self.stopped = self.closed = False

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            self.comm.broadcast_object(None)
        except DistError as exc:
            logger.warning("could not stop the tensor-parallel followers: %s", exc)
        for proc in self.processes:
            try:
                proc.wait(FOLLOWER_EXIT_S)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel follower %d did not exit; killing it", proc.pid)
                proc.kill()

    def close(self) -> None:
        self.stop()
        if not self.closed:
            self.closed = True
            self.comm.close()


class TPRunner:
    """Rank 0's Runner: run() broadcasts the batch first; close() (also at exit) ends the followers and the group."""

    def __init__(self, runner: ModelRunner, followers: Followers):
        self.runner, self.followers, self.comm = runner, followers, followers.comm
        weakref.finalize(self, followers.close)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def run(self, batch: list[ScheduledSeq]) -> list[SeqResult]:
        if not batch:
            return []
        self.comm.broadcast_object(for_followers(batch))
        return self.runner.run(batch)

    def import_kv(self, page_ids: list[int], data: bytes, foreign: bool) -> None:
        """ModelRunner.import_kv on rank 0 (ValueError: bytes do not fit), then on the followers (each its KV heads)."""
        self.runner.import_kv(page_ids, data, foreign)
        self.comm.broadcast_object(KVImport(page_ids, data, foreign))

    def export_kv(self, page_ids: list[int]) -> bytes:
        """A PD prefill worker's KV export (ModelRunner.export_kv), with the followers when it gathers."""
        if self.runner.export_gathers:
            self.comm.broadcast_object(KVExport(page_ids))
        return self.runner.export_kv(page_ids)

    def check_group(self) -> None:
        """An idle engine's probe: a message every follower reads and drops; DistError if a rank is gone."""
        self.comm.broadcast_object(PING)

    def info(self) -> dict:
        return {"tp_size": self.runner.config.tp_size, **self.runner.info()}

    def close(self) -> None:
        self.followers.close()


def free_init_addr() -> str:
    """127.0.0.1:<a port free now> for a one-machine group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def launch_followers(config: EngineConfig, ranks: range) -> list[subprocess.Popen]:
    """Start one follower process per rank in `ranks` (config.dist_init_addr set), inheriting stdio."""
    env = {**os.environ, CONFIG_ENV: json.dumps(dataclasses.asdict(config))}
    return [subprocess.Popen([sys.executable, "-m", "radixserve.runner.tp", str(rank)], env=env) for rank in ranks]


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` for one rank: on CUDA, device cuda:<local rank>."""
    if resolve_device(config.device).type != "cuda":
        return config
    return dataclasses.replace(config, device=f"cuda:{rank % (config.world_size // config.nnodes)}")


def rank_runner(config: EngineConfig, comm: Communicator) -> ModelRunner:
    """This rank's runner: a CPModelRunner (whole weights) with --cp-size > 1, a PPModelRunner (its stage's layers,
    its TP shard of them) with --pp-size > 1, else ModelRunner's TP shard. Collective over the group."""
    if config.pp_size > 1:
        tp = split_group(comm, config.tp_size, config.dist_timeout) if config.tp_size > 1 else None
        return PPModelRunner.from_config(config, tp, comm=comm)
    if config.cp_size > 1:
        return CPModelRunner.from_config(config, comm=comm)
    return ModelRunner.from_config(config, comm)


def load_runner(config: EngineConfig) -> ModelRunner | TPRunner:
    """The engine's runner: a ModelRunner, or with --tp-size, --cp-size or --pp-size > 1 rank 0's TPRunner, its node's
    followers started first. Raises DistError when a rank does not join within --dist-timeout."""
    if config.world_size == 1:
        return ModelRunner.from_config(config)
    if config.dist_init_addr is None:
        config = dataclasses.replace(config, dist_init_addr=free_init_addr())
    followers = launch_followers(config, range(1, config.world_size // config.nnodes))
    config = rank_config(config, 0)
    try:
        comm = init_communicator(0, config.world_size, config.dist_init_addr, config.dist_timeout,
                                 config.device or "cpu")
        return TPRunner(rank_runner(config, comm), Followers(comm, followers))
    except BaseException:
        for proc in followers:
            proc.kill()
        raise


def serve_node(config: EngineConfig) -> int:
    """`serve --node-rank N > 0`: run this machine's ranks until they end; 1 when any failed."""
    per_node = config.world_size // config.nnodes
    followers = launch_followers(config, range(config.node_rank * per_node, (config.node_rank + 1) * per_node))
    return max(proc.wait() for proc in followers)


def follow(runner: ModelRunner, comm: Communicator) -> None:
    """A follower's loop: each broadcast batch's forward (or KV import, export) to None; DistError if a peer fails."""
    while (msg := comm.broadcast_object()) is not None:
        if isinstance(msg, KVImport):
            runner.import_kv(msg.page_ids, msg.data, msg.foreign)
        elif isinstance(msg, KVExport):
            runner.export_kv(msg.page_ids)
        elif msg != PING:
            runner.forward(msg)


def main(argv: list[str]) -> int:
    """Follower rank `argv[0]` of the group described by $RADIXSERVE_TP_CONFIG; 1 when the group fails."""
    rank = int(argv[0])
    config = rank_config(EngineConfig(**json.loads(os.environ[CONFIG_ENV])), rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s")
    try:
        comm = init_communicator(rank, config.world_size, config.dist_init_addr, config.dist_timeout,
                                 config.device or "cpu")
        follow(rank_runner(config, comm), comm)
    except DistError as exc:
        logger.error("tensor-parallel rank %d stops: %s", rank, exc)
        return 1
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
