"""EvictionHistory: a bounded memory of evicted keys that forgets the oldest key first."""

from scheduler.kv_cache.eviction_history import EvictionHistory


def _key(index: int) -> bytes:
    return index.to_bytes(16, "little")


def test_forgets_oldest_key_and_keeps_groups_of_rerecorded_one() -> None:
    history = EvictionHistory(capacity=3)
    history.record_all([(0, _key(1)), (1, _key(2)), (0, _key(3))])
    history.record_all([(2, _key(1))])  # key 1 again: now the newest, in groups 0 and 2
    history.record_all([(0, _key(4))])  # over capacity: key 2, the oldest, goes

    assert not history.was_evicted_anywhere(_key(2))
    assert history.was_evicted(0, _key(1))
    assert history.was_evicted(2, _key(1))
    assert not history.was_evicted(1, _key(1))
    assert all(history.was_evicted_anywhere(_key(i)) for i in (3, 4))


def test_long_stream_keeps_exactly_the_last_keys() -> None:
    history = EvictionHistory(capacity=100)
    history.record_all([(i % 6, _key(i)) for i in range(10_000)])

    kept = [i for i in range(10_000) if history.was_evicted_anywhere(_key(i))]
    assert kept == list(range(9_900, 10_000))
    assert history.was_evicted(9_999 % 6, _key(9_999))


def test_a_run_of_one_key_collects_every_group_and_stays_the_newest() -> None:
    """A pool pops the groups of one position in a row: each group of the run is kept, and the
    key is the newest, so the next key over capacity drops an older one."""
    history = EvictionHistory(capacity=2)
    history.record_all([(0, _key(1)), (0, _key(2)), (1, _key(2)), (3, _key(2))])
    history.record_all([(0, _key(1)), (2, _key(1)), (0, _key(3))])  # over capacity: key 2 goes

    assert [history.was_evicted(group, _key(1)) for group in range(4)] == [1, 0, 1, 0]
    assert not history.was_evicted_anywhere(_key(2))
    assert history.was_evicted(0, _key(3))


def test_a_run_of_one_key_object_and_of_equal_copies_leave_the_same_history() -> None:
    """A pool's run shares one key object; equal copies (another request's blocks) merge too."""
    shared, copies = EvictionHistory(capacity=2), EvictionHistory(capacity=2)
    key = _key(2)
    shared.record_all([(0, _key(1)), (0, key), (1, key), (3, key), (0, _key(3))])
    copies.record_all([(0, _key(1)), (0, _key(2)), (1, _key(2)), (3, _key(2)), (0, _key(3))])
    assert list(shared._groups.items()) == list(copies._groups.items())
    assert [shared.was_evicted(group, key) for group in range(4)] == [1, 1, 0, 1]
