"""The compiled decode's warm-up leaves no multiprocessing semaphore behind: the engine process ends with os._exit,
so one made there (tqdm's lock, first used by torch.fx's tracing bar) was reported leaked at every shutdown."""
from __future__ import annotations

import multiprocessing.synchronize

import tqdm

from radixserve.runner import compiled_decode


def test_tqdm_bars_after_warm_up_setup_make_no_semaphore(monkeypatch):
    made = []
    original = multiprocessing.synchronize.SemLock.__init__

    def counting(self, *args, **kwargs):
        made.append(args)
        original(self, *args, **kwargs)

    monkeypatch.setattr(multiprocessing.synchronize.SemLock, "__init__", counting)
    monkeypatch.delattr(tqdm.tqdm, "_lock", raising=False)   # as in a fresh engine process
    compiled_decode._tqdm_thread_lock()
    for _ in tqdm.tqdm(range(3), disable=False):
        pass
    assert made == []
