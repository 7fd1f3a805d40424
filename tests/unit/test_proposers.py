"""The draft proposers (engine/speculative.py). NgramProposer: prompt lookup, periodic
continuation, adaptive k with back-off, the bounded shared table of finished requests' outputs.
ModelDraftProposer: a runner's draft is taken once, for the sequence length it was made for."""
from __future__ import annotations

import pytest

from radixserve.engine.speculative import (FLOAT_BREAK_EVEN, KERNEL_BREAK_EVEN, RETRY_EVERY, ModelDraftProposer,
                                           NgramProposer, resolve_break_even)


def test_prompt_lookup_copies_what_followed_the_last_three_tokens():
    p = NgramProposer(max_draft=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]
    assert p.propose("a", tokens, limit=8) == [4, 5]         # k = round(1.0) + 1 at first
    p.record("a", 2, 1)
    assert p.propose("a", tokens, limit=8) == [4, 5]         # round(1.0) + 1: partly accepted
    p.record("a", 2, 2)
    p.record("a", 3, 3)
    assert p.propose("a", tokens, limit=8) == [4, 5, 6, 7]   # all of 3 accepted: one more
    p.record("a", 4, 1)
    assert p.propose("a", tokens, limit=8) == [4, 5, 6]      # back to round(avg 1.57) + 1
    assert p.propose("a", tokens, limit=1) == [4]            # never past the limit
    assert p.propose("b", [1, 2, 3, 4], limit=8) == []       # no earlier occurrence


def test_a_match_near_the_end_continues_periodically():
    p = NgramProposer(max_draft=4)
    p.propose("a", [9], 8)
    for _ in range(4):
        p.record("a", 4, 4)
    assert p.propose("a", [9, 5, 6, 7, 5, 6, 7], limit=8) == [5, 6, 7, 5]


def test_failing_drafts_back_off_and_probe_again():
    p = NgramProposer(max_draft=4)
    tokens = [1, 2, 3, 8, 1, 2, 3]
    for _ in range(6):                                       # average 1.0 -> 0.12 < MIN_USEFUL
        assert p.propose("a", tokens, 8)
        p.record("a", 2, 0)
    silent = [p.propose("a", tokens, 8) for _ in range(RETRY_EVERY)]
    assert silent == [[]] * RETRY_EVERY
    assert p.propose("a", tokens, 8) == [8]                  # the probe


def test_shared_table_drafts_from_finished_outputs_is_bounded_and_flushed():
    p = NgramProposer(max_draft=4, shared_entries=6)
    prompt, output = [100, 101], [10, 11, 12, 13, 14, 15, 16]
    p.release("done", prompt + output, num_output=len(output))
    assert p.propose("new", [50, 51, 10, 11, 12], limit=8) == [13, 14]
    p.release("aborted", [60, 61, 62, 63], num_output=0)     # no output: nothing shared
    assert p.propose("other", [7, 60, 61, 62], limit=8) == []
    p.release("later", [70, 71, 72, 73, 74, 75, 76, 77], num_output=8)
    assert p.propose("x", [9, 100, 101, 10], limit=8) == []  # evicted (LRU, 6 entries)
    assert p.propose("y", [9, 74, 75, 76], limit=8) == [77]
    p.flush()                                                # the engine's flush_cache
    assert p.propose("z", [9, 74, 75, 76], limit=8) == []


def test_model_drafts_are_taken_once_for_the_length_they_were_made_for():
    p = ModelDraftProposer(max_draft=4)
    p.offer("a", (7, 8, 9, 10), num_tokens=5)
    assert p.propose("a", [1, 2, 3, 4, 5], limit=8) == [7, 8]      # adaptive k starts at 2
    assert p.propose("a", [1, 2, 3, 4, 5], limit=8) == []          # taken
    p.offer("a", (7, 8, 9, 10), num_tokens=5)
    assert p.propose("a", [1, 2, 3, 4, 5, 6], limit=8) == []       # made for another length
    p.offer("a", (7, 8, 9), num_tokens=3)
    p.release("a")
    assert p.propose("a", [1, 2, 3], limit=8) == []                # released with the request


def test_a_backing_off_model_draft_is_not_asked_for_until_its_probe():
    p = ModelDraftProposer(max_draft=4)
    assert p.wants_draft("a")
    for n in range(6):                                    # average 1.0 -> 0.12 < MIN_USEFUL
        p.offer("a", (7, 8), num_tokens=n)
        assert p.propose("a", list(range(n)), limit=8)
        p.record("a", 2, 0)
    asked = []
    for n in range(6, 6 + RETRY_EVERY + 1):
        asked.append(p.wants_draft("a"))
        assert p.propose("a", list(range(n)), limit=8) == []      # no offer made meanwhile
    assert asked == [False] * RETRY_EVERY + [True]                # then one probe is due


@pytest.mark.parametrize("cls", [NgramProposer, ModelDraftProposer])
def test_batch_gate_drafts_only_where_acceptance_pays_at_this_batch_size(cls):
    """With a/b = 16, a request accepting 40 % of its drafts drafts at batch 1 and 8 (bound
    8/24 = 0.33) but not at batch 32 (bound 0.67), where it only probes: every RETRY_EVERY steps for n-grams,
    every 32 x RETRY_EVERY for a model draft (its probe runs the draft's chain too)."""
    p = cls(max_draft=4, break_even_tokens=16)
    tokens = [1, 2, 3, 8, 9, 1, 2, 3]

    def drafts() -> bool:
        if isinstance(p, ModelDraftProposer):
            p.offer("a", (8, 9, 1), num_tokens=len(tokens))
        return bool(p.propose("a", tokens, limit=8))

    assert drafts()
    for _ in range(12):                      # rate 1.0 -> ~0.41, avg accepted ~1.2
        p.record("a", 3, 1) if _ % 5 else p.record("a", 3, 2)
    for batch, expected in ((1, True), (8, True), (32, False)):
        p.set_batch(batch)
        assert drafts() is expected, batch
    p.set_batch(32)
    wait = RETRY_EVERY * (32 if cls is ModelDraftProposer else 1)
    assert [drafts() for _ in range(wait)] == [False] * (wait - 1) + [True]
    for gate, expected in ((16, False), (0, True)):      # 0: the gate is off
        p = cls(max_draft=4, break_even_tokens=gate)
        drafts()
        p.record("a", 3, 0)
        p.record("a", 3, 0)                              # rate 0.49, avg 0.49 >= MIN_USEFUL
        p.set_batch(64)                                  # bound 64 / 80 = 0.8
        assert drafts() is expected, gate


def test_the_gate_defaults_by_what_a_token_costs_the_runner():
    assert resolve_break_even(None, "int4-fp32") == resolve_break_even(None, "int4-int8") == KERNEL_BREAK_EVEN
    assert resolve_break_even(None, "none") == resolve_break_even(None, None) == FLOAT_BREAK_EVEN
    assert resolve_break_even(7.0, "int4-fp32") == 7.0 and resolve_break_even(0.0, "none") == 0.0
    assert KERNEL_BREAK_EVEN < FLOAT_BREAK_EVEN


def test_a_new_request_starts_from_the_acceptance_of_earlier_ones():
    """Short requests verify too few times to learn their own rate: a new one starts from the
    average over all requests, so under a batch gate it drafts only if earlier drafts paid."""
    tokens = [1, 2, 3, 8, 9, 1, 2, 3]
    p = NgramProposer(max_draft=4, break_even_tokens=16)
    p.set_batch(32)                                       # bound 32 / 48 = 0.67
    assert p.propose("fresh", tokens, limit=8)            # no history: optimistic
    for i in range(40):                                   # earlier requests kept 1 of 4
        p.propose(f"old{i}", tokens, limit=8)
        p.record(f"old{i}", 4, 1)
        p.release(f"old{i}")
    assert p.propose("new", tokens, limit=8) == []
    p.set_batch(4)                                        # bound 0.2: a quarter kept pays
    assert p.propose("new", tokens, limit=8)
