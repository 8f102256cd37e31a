"""A model of the fa3 forward's DRAM reads and makespan under its tile orders (no GPU).

    python -m benchmarks.fwd_l2_model                      # D 128 and 64, N 1k / 4k / 16k
    python -m benchmarks.fwd_l2_model --head-dim 64 --seqlen 1024 --section 32 --section 4
    python -m benchmarks.fwd_l2_model --causal --l2-mib 25

Each SM runs one CTA; a tile (m_block, head, batch) reads its Q tile, then its K/V blocks
one after another, one block per time unit (plus `--fixed` units of prologue and epilogue).
The plain grid hands tiles to SMs in launch order (m_block fastest, then head, then batch) as
SMs free up; the persistent scheduler gives CTA i the tiles of `cta_tile` (round-robin, or the
balanced snake) in the `tile_coords` order: (batch, head) pairs in sections of
`--section` MiB of K/V, heads fastest inside a section, causal tiles heaviest first, every
other section reversed when balanced. These mirror fa3/tile_scheduler.py in Python.

Every K or V block read goes through a least-recently-used cache of `--l2-mib` (blocks of one
(batch, kv head) pair are shared by its query heads); a miss reads the block from DRAM. Q is
read once per tile. The model prints, per order, the DRAM bytes of one call (Q, K and V are
B·N·H·D·2 bytes each: the plain grid's ideal is 3x that), the reads of K/V over their size,
and the makespan's efficiency (ideal time, the total work over the SMs, over the makespan).

What it leaves out: the L2's hashing over two partitions and its replacement policy (the
hardware's capacity for a streaming pattern is less than its 50 MiB: `--l2-mib`, 30 by
default, puts the two measured orders at 522 and 201 MB), the time a miss takes, the writes.
It says which orders re-read K/V and by how much, the GPU how much that costs
(docs/results.md, "The persistent order's L2 sections": the H200 read 201 MB on the plain
grid, 496 MB on the persistent 32 MiB order and 204 MB on 8 MiB at D = 128, N = 1k).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The standard sweep's shape: B·N = tokens, Hq·D = width, Hq = Hkv."""

    head_dim: int
    seqlen: int
    causal: bool
    tokens: int = 16384
    width: int = 2048

    @property
    def batch(self) -> int:
        return self.tokens // self.seqlen

    @property
    def heads(self) -> int:
        return self.width // self.head_dim


def block_range(m: int, tile_m: int, tile_n: int, seqlen: int, causal: bool) -> range:
    """The K/V blocks a row tile sees (Nq = Nk, causal bottom-right aligned)."""
    n_max = -(-seqlen // tile_n)
    if causal:
        last_row = min((m + 1) * tile_m, seqlen) - 1
        n_max = min(n_max, -(-(last_row + 1) // tile_n))
    return range(n_max)


def tile_coords(
    tile: int, m_blocks: int, hb_total: int, heads: int, section: int, longest_first: bool,
    balanced: bool,
) -> tuple[int, int, int]:  # fmt: skip
    """TileScheduler.tile_coords in Python: persistent tile index -> (m_block, head, batch)."""
    section = max(min(section, hb_total), 1)
    sec, r = divmod(tile, section * m_blocks)
    in_sec = min(section, hb_total - sec * section)
    m_block = r // in_sec
    if longest_first:
        if balanced:
            n_sec = -(-hb_total // section)
            if (n_sec - 1 - sec) % 2 == 0:
                m_block = m_blocks - 1 - m_block
        else:
            m_block = m_blocks - 1 - m_block
    hb = sec * section + r % in_sec
    return m_block, hb % heads, hb // heads


def cta_tiles(bid: int, grid: int, num_tiles: int, balanced: bool) -> list[int]:
    """TileScheduler.cta_tile_count / cta_tile in Python: the order positions CTA `bid` runs."""
    out, k = [], 0
    while True:
        off = grid - 1 - bid if balanced and k % 2 else bid
        pos = k * grid + off
        if pos >= num_tiles:
            # The last round may be partial; a reversed one can still reach later CTAs' slots.
            if k * grid >= num_tiles:
                return out
        else:
            out.append(pos)
        k += 1


class Lru:
    """A byte-capacity LRU cache that counts the bytes of its misses."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used, self.missed = capacity, 0, 0
        self.lines: OrderedDict = OrderedDict()

    def read(self, key, size: int) -> None:
        if key in self.lines:
            self.lines.move_to_end(key)
            return
        self.missed += size
        self.lines[key] = size
        self.used += size
        while self.used > self.capacity:
            _, old = self.lines.popitem(last=False)
            self.used -= old


def simulate(
    shape: Shape, tile_m: int, tile_n: int, persistent: bool, section_mib: int,
    balanced: bool = True, l2_mib: float = 30.0, sms: int = 132, fixed: int = 1,
    dynamic: bool = False,
) -> dict:  # fmt: skip
    """DRAM bytes of one call and the makespan's efficiency for one order (see the module).
    `dynamic`: the persistent order's tiles (sections, heaviest first, no balancing) handed
    out one at a time to whichever SM frees first, as a tile counter would (or the plain grid
    launched in that order: `Fa3Config.lpt_grid`)."""
    d, n = shape.head_dim, shape.seqlen
    m_blocks = -(-n // tile_m)
    hb_total = shape.batch * shape.heads
    num_tiles = m_blocks * hb_total
    kv_block = 2 * tile_n * d * 2  # one K and one V block, 16-bit
    q_tile = tile_m * d * 2
    section = (section_mib << 20) // (2 * d * 2) // n
    if dynamic:
        grid, queues = sms, None
        launch = [tile_coords(t, m_blocks, hb_total, shape.heads, section, shape.causal, False)
                  for t in range(num_tiles)]  # fmt: skip
    elif persistent:
        grid = min(sms, num_tiles)
        coords = [
            tile_coords(t, m_blocks, hb_total, shape.heads, section, shape.causal, balanced)
            for t in range(num_tiles)
        ]
        queues = [[coords[p] for p in cta_tiles(b, grid, num_tiles, balanced)] for b in range(grid)]
    else:  # plain grid: launch order, the next tile to whichever SM frees first
        grid = sms
        launch = [(m, h, b) for b in range(shape.batch) for h in range(shape.heads)
                  for m in range(m_blocks)]  # fmt: skip
        queues = None
    cache = Lru(int(l2_mib * (1 << 20)))
    q_bytes, work = 0, 0
    # Events (time, sm, tile, next block index or -1 for the tile's start).
    events: list = []
    nxt = 0
    finish = [0.0] * grid
    pending = [list(reversed(q)) for q in queues] if queues else None

    def start(sm: int, t: float) -> None:
        nonlocal nxt
        if pending is not None:
            if not pending[sm]:
                finish[sm] = t
                return
            tile = pending[sm].pop()
        else:
            if nxt >= len(launch):
                finish[sm] = t
                return
            tile, nxt = launch[nxt], nxt + 1
        heapq.heappush(events, (t, sm, tile, -1))

    for sm in range(grid):
        start(sm, 0.0)
    while events:
        t, sm, tile, j = heapq.heappop(events)
        m, h, b = tile
        blocks = block_range(m, tile_m, tile_n, n, shape.causal)
        if j == -1:
            q_bytes += q_tile
            work += len(blocks) + fixed
            heapq.heappush(events, (t + fixed, sm, tile, 0))
            continue
        if j < len(blocks):
            cache.read((b, h, blocks[j]), kv_block)
            heapq.heappush(events, (t + 1, sm, tile, j + 1))
        else:
            start(sm, t)
    tensor = shape.batch * n * shape.heads * d * 2
    makespan = max(finish)
    return {
        "dram_mb": (q_bytes + cache.missed) / 1e6,
        "kv_reads": cache.missed / (2 * tensor),
        "efficiency": work / grid / makespan if makespan else 1.0,
        "ideal_mb": 3 * tensor / 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, action="append", help="default: 64 and 128")
    ap.add_argument("--seqlen", type=int, action="append", help="default: 1024, 4096, 16384")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--section", type=int, action="append", help="MiB; default: 32 8 4 2")
    ap.add_argument("--l2-mib", type=float, default=30.0)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--fixed", type=int, default=1, help="prologue + epilogue, in K/V blocks")
    ap.add_argument("--dynamic", action="store_true", help="also tiles handed out on demand")
    args = ap.parse_args(argv)
    tiles = {64: (192, 128), 96: (192, 112), 128: (128, 128), 192: (128, 112), 256: (128, 80)}
    sections = args.section or [32, 8, 4, 2]
    kind = "causal" if args.causal else "non-causal"
    print(f"L2 (LRU) {args.l2_mib} MiB, {args.sms} SMs, {kind}")
    head = f"{'DRAM MB':>8} {'ideal':>7} {'K/V reads':>9} {'eff':>6}"
    print(f"{'D':>4} {'N':>6} {'order':<22} {head}")
    for d in args.head_dim or [128, 64]:
        tm, tn = tiles[d]
        for n in args.seqlen or [1024, 4096, 16384]:
            shape = Shape(d, n, args.causal)
            rows = [("plain grid", False, 32, False)]
            rows += [(f"persistent {s} MiB", True, s, False) for s in sections]
            rows += [(f"dynamic {s} MiB", True, s, True) for s in sections if args.dynamic]
            for label, persistent, s, dyn in rows:
                r = simulate(shape, tm, tn, persistent, s, l2_mib=args.l2_mib, sms=args.sms,
                             fixed=args.fixed, dynamic=dyn)  # fmt: skip
                print(f"{d:>4} {n:>6} {label:<22} {r['dram_mb']:>8.0f} {r['ideal_mb']:>7.0f} "
                      f"{r['kv_reads']:>9.2f} {r['efficiency']:>6.3f}")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
