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


def test_two_free_lists_for_fp8_decode_pages():
    """--kv-history-dtype auto: ids [0, 6) model dtype, [6, 8) FP8. A decode (fp8=True) takes FP8 pages first, then
    model-dtype ones; a prefill never takes FP8 pages; frees go back to their own list."""
    pool = PagePool(8, num_fp8_pages=2)
    assert (pool.num_model_pages, pool.num_free_for(False), pool.num_free_for(True)) == (6, 6, 8)
    prefill = pool.allocate(5)
    assert prefill == [0, 1, 2, 3, 4]
    assert pool.allocate(2) is None and pool.num_free == 3                  # one model-dtype page left
    decode = pool.allocate(3, fp8=True)
    assert decode == [6, 7, 5] and pool.num_free == 0
    assert pool.num_model_prefix([0, 4, 6, 5]) == 2 and pool.num_model_prefix([1, 2]) == 2
    pool.free(decode)
    assert pool.num_free_fp8 == 2 and pool.num_free_for(False) == 1
    pool.free(prefill)
    assert sorted(pool.free_ids()) == list(range(8))
    with pytest.raises(ValueError):
        PagePool(4, num_fp8_pages=4)
