"""KVChecksums on a fake KV memory (slot -> value): what gets sealed, when a sealed slot is
compared, that freeing a page unseals it, and that nothing below a request's computed length
is ever skipped by a full check; and the real cache's slot sums."""
from __future__ import annotations

from radixserve.engine.kv_checksum import KVChecksums
from radixserve.engine.request import Request
from radixserve.sampling_params import SamplingParams

P = 4


class Memory:
    """Slot values standing in for KV; `checksum` is what the runner would compute."""

    def __init__(self):
        self.values: dict[int, int] = {}
        self.summed: list[list[int]] = []

    def checksum(self, slots: list[int]) -> list[int]:
        self.summed.append(list(slots))
        return [self.values.get(s, 0) for s in slots]


def request(rid: str, pages: list[int], computed: int) -> Request:
    req = Request(rid, list(range(40)), SamplingParams(), 0, 8, 0.0)
    req.page_ids, req.num_computed_tokens = pages, computed
    return req


def test_seals_new_slots_and_finds_an_overwrite_at_the_end():
    mem = Memory()
    sums = KVChecksums(8, P, mem.checksum, interval=1000)
    req = request("a", [5, 2, 7], 6)
    mem.values.update({s: s * 10 for s in range(32)})
    assert sums.after_step([req]) == set()
    assert mem.summed[-1] == [20, 21, 22, 23, 8, 9]             # positions 0..5: page 5, then page 2
    req.num_computed_tokens = 9
    sums.after_step([req])
    assert mem.summed[-1] == [10, 11, 28]                        # only the new positions 6..8
    mem.values[9] = -1                                           # page 2, offset 1: overwritten
    assert sums.at_end(req) == {2}
    assert sums.num_mismatched_slots == 1


def test_a_full_check_comes_every_interval_steps():
    mem = Memory()
    sums = KVChecksums(8, P, mem.checksum, interval=3)
    req = request("a", [0, 1], 5)
    for _ in range(9):
        sums.after_step([req])
    # the first step seals all 5 slots; then every third step sums them all again (the first
    # step may itself be one of those)
    assert len(mem.summed) in (3, 4) and all(len(s) == 5 for s in mem.summed)


def test_freeing_a_page_unseals_it_and_a_shared_slot_is_summed_once():
    mem = Memory()
    sums = KVChecksums(8, P, mem.checksum, interval=1)
    a, b = request("a", [3, 4], 8), request("b", [3, 6], 6)     # page 3 shared (a radix hit)
    sums.after_step([a, b])
    assert sorted(mem.summed[-1]) == sorted(set(range(12, 20)) | {24, 25})
    mem.values[13] = 99                                          # page 3 rewritten ...
    sums.unseal([3])                                             # ... after it was freed: fine
    assert sums.after_step([a]) == set()
    mem.values[13] = 100                                         # sealed again: now it is damage
    assert sums.after_step([b]) == {3}


def test_a_prefix_shared_by_many_requests_is_summed_once_per_interval_and_still_checked():
    """Eight requests map the same two prefix pages (radix hits) and one page each. Over 24
    steps at interval 4 each prefix slot is summed about once per interval, not once per
    request per interval; an overwrite there is still found within two intervals."""
    mem = Memory()
    sums = KVChecksums(16, P, mem.checksum, interval=4)
    reqs = [request(f"r{i}", [0, 1, 2 + i], 10) for i in range(8)]
    for _ in range(24):
        assert sums.after_step(reqs) == set()
    prefix_sums = sum(slot < 2 * P for summed in mem.summed for slot in summed)
    assert 2 * P * 24 // 4 <= prefix_sums <= 2 * P * (24 // 4 + 2)   # 8x this without the skip
    mem.values[5] = -1                                               # page 1, offset 1
    found = [sums.after_step(reqs) for _ in range(2 * 4)]
    assert {1} in found
    assert all(f in (set(), {1}) for f in found)


def test_after_a_preemption_the_recomputed_part_is_sealed_again():
    mem = Memory()
    sums = KVChecksums(8, P, mem.checksum, interval=1000)
    req = request("a", [0, 1, 2], 10)
    sums.after_step([req])
    sums.unseal([1, 2])                                          # preempted: its tail freed
    req.page_ids, req.num_computed_tokens = [0], 4               # re-admitted with a 4-token hit
    sums.after_step([req])
    req.page_ids, req.num_computed_tokens = [0, 5, 6], 10
    sums.after_step([req])
    assert mem.summed[-1] == [20, 21, 22, 23, 24, 25]            # positions 4..9 on the new pages
    mem.values[21] = 7
    assert sums.at_end(req) == {5}


def test_slot_sums_of_the_real_cache_depend_on_the_bytes_only():
    """KVCache.slot_checksums, per storage width: a slot's sum is the same whatever other slots
    are summed with it and in what order (fp32's int32 sums wrap, and wrap alike), and one
    changed bit in any layer, K or V, changes it."""
    import torch

    from radixserve.runner.kv_cache import KVCache

    for dtype in (torch.float32, torch.bfloat16):
        kv = KVCache(3, 4, 4, 2, 16, dtype)
        gen = torch.Generator().manual_seed(0)
        for store in kv._k + kv._v:      # large values: fp32 bit patterns near 2^30 overflow int32 sums
            store.copy_(torch.randn(store.shape, generator=gen) * 1e30)
        alone = [kv.slot_checksums([s])[0] for s in range(16)]
        assert kv.slot_checksums(list(range(16))) == alone
        assert kv.slot_checksums([9, 2, 15]) == [alone[9], alone[2], alone[15]]
        bits = {4: torch.int32, 2: torch.int16}[kv._v[2].element_size()]
        kv._v[2].view(bits)[1, 2, 1, 5] ^= 1                 # layer 2, V, head 1, slot 2 * 4 + 1
        changed = kv.slot_checksums(list(range(16)))
        assert [s for s in range(16) if changed[s] != alone[s]] == [9]
