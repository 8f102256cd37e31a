"""benchmarks/fwd_l2_model.py: the Python mirror of the forward's persistent tile order runs
every tile once, and the LRU model reads K/V once on the plain grid and 8 MiB sections, and
more than twice on 32 MiB sections at D = 128, N = 1k (what ncu measured on the H200:
docs/results.md, "The persistent order's L2 sections")."""

from __future__ import annotations

import pytest

from benchmarks.fwd_l2_model import Lru, Shape, cta_tiles, simulate, tile_coords


def _count_like_the_kernel(bid: int, grid: int, num_tiles: int, balanced: bool) -> int:
    """TileScheduler.cta_tile_count's formula."""
    count = (num_tiles - bid + grid - 1) // grid
    if balanced:
        full = num_tiles // grid
        off = bid if full % 2 == 0 else grid - 1 - bid
        count = full + (1 if off < num_tiles - full * grid else 0)
    return count


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize(("num_tiles", "grid"), [(2048, 132), (264, 132), (1000, 132), (7, 7)])
def test_every_tile_runs_once_and_counts_match_the_kernel(num_tiles, grid, balanced) -> None:
    runs = [cta_tiles(b, grid, num_tiles, balanced) for b in range(grid)]
    assert sorted(p for r in runs for p in r) == list(range(num_tiles))
    for b, r in enumerate(runs):
        assert len(r) == _count_like_the_kernel(b, grid, num_tiles, balanced)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("section", [1, 5, 64])
def test_tile_coords_is_a_bijection(causal: bool, section: int) -> None:
    m_blocks, heads, batch = 8, 4, 16  # 64 pairs: sections of 5 end in a short one of 4
    coords = [tile_coords(t, m_blocks, heads * batch, heads, section, causal, True)
              for t in range(m_blocks * heads * batch)]  # fmt: skip
    assert len(set(coords)) == len(coords)
    assert all(0 <= m < m_blocks and 0 <= h < heads and 0 <= b < batch for m, h, b in coords)


def test_lru_counts_misses_and_evicts_the_oldest() -> None:
    cache = Lru(3)
    for key in "abcab":
        cache.read(key, 1)
    assert cache.missed == 3
    cache.read("d", 1)  # evicts c, the least recently used
    cache.read("a", 1)
    cache.read("c", 1)
    assert cache.missed == 5


def test_sections_larger_than_l2_reread_kv() -> None:
    shape = Shape(128, 1024, causal=False)
    plain = simulate(shape, 128, 128, persistent=False, section_mib=32, l2_mib=30)
    wide = simulate(shape, 128, 128, persistent=True, section_mib=32, l2_mib=30)
    narrow = simulate(shape, 128, 128, persistent=True, section_mib=8, l2_mib=30)
    assert plain["kv_reads"] == pytest.approx(1.0) and narrow["kv_reads"] == pytest.approx(1.0)
    assert wide["kv_reads"] > 2.0
    assert plain["dram_mb"] == pytest.approx(plain["ideal_mb"])
