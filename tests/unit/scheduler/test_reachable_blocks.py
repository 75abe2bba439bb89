"""The blocks a group registers: `reachable_indices` reads one period of `is_reachable` and must
agree with asking every block, for each layer type and hit alignment."""

from __future__ import annotations

import pytest
from kv_cache_helpers import chunked, full, make_manager, mamba, window

from scheduler.kv_cache.spec import KVCacheSpec

LAYOUTS = {
    "full + window, one block size": [full(4), window(4, 12)],
    "window with a coarser hit alignment": [full(16), window(4, 8)],
    "window shorter than the alignment": [full(48), window(8, 8)],
    "chunked local": [full(4), chunked(4, 24)],
    "chunked local, aligned chunks": [full(8), chunked(8, 32)],
    "mamba every 64 tokens": [full(16), mamba(64)],
    "mamba with full blocks of 12": [full(12), window(4, 20), mamba(16)],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reachable_indices_match_is_reachable_block_by_block(layout: str) -> None:
    specs: list[KVCacheSpec] = LAYOUTS[layout]
    manager = make_manager(64, *specs)
    for group in manager.coordinator.managers:
        for start, stop in [(0, 200), (3, 97), (17, 18), (40, 40)]:
            expected = [i for i in range(start, stop) if group.is_reachable(i)]
            assert list(group.reachable_indices(start, stop)) == expected, (layout, group)


def test_some_layouts_register_only_part_of_their_blocks() -> None:
    """The pattern is not trivially all-true: a window group under a coarse alignment skips."""
    manager = make_manager(64, full(16), window(4, 8))
    windowed = manager.coordinator.managers[1]
    assert 0 < len(windowed.reachable_indices(0, 40)) < 40
