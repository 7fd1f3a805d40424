"""PagePool: allocation is all-or-nothing, frees return pages, ids stay in range."""
import pytest

from radixserve.engine.radix_cache import PagePool


def test_allocate_free_roundtrip():
    pool = PagePool(8)
    a = pool.allocate(5)
    assert len(a) == 5 and len(set(a)) == 5 and pool.num_free == 3
    assert pool.allocate(4) is None and pool.num_free == 3  # nothing taken on failure
    pool.free(a)
    assert pool.num_free == 8 and sorted(pool.free_ids()) == list(range(8))


def test_free_out_of_range_is_a_bug():
    pool = PagePool(2)
    with pytest.raises(AssertionError):
        pool.free([2])


def test_zero_pages_rejected():
    with pytest.raises(ValueError):
        PagePool(0)
