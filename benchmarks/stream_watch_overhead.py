"""Cost of making each read of the router's SSE loop cuttable on ejection (router/eject.py StreamWatch).

    PYTHONPATH=. python benchmarks/stream_watch_overhead.py [--reads 200000]

Times `--reads` awaits of a trivial coroutine bare and through `StreamWatch.read`, in the same
process, twice each (the second pair after warm-up), and prints µs per read and the added
cost: what every relayed event of a stream pays for being cuttable on ejection.
"""
from __future__ import annotations

import argparse
import time

import anyio

from radixserve.router.eject import StreamWatch


class _Worker:
    url = "http://worker"
    streams: set = set()


async def _step() -> int:
    return 1


async def main(reads: int) -> None:
    watch = StreamWatch(_Worker())
    for _ in range(2):
        t = time.perf_counter()
        for _ in range(reads):
            await _step()
        bare = (time.perf_counter() - t) / reads
        t = time.perf_counter()
        for _ in range(reads):
            await watch.read(_step)
        watched = (time.perf_counter() - t) / reads
        print(f"bare {bare * 1e6:.2f} µs/read, through StreamWatch {watched * 1e6:.2f} µs/read, "
              f"added {(watched - bare) * 1e6:.2f} µs/read")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reads", type=int, default=200_000)
    anyio.run(main, p.parse_args().reads)
