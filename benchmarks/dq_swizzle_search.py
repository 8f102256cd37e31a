"""The dQ postprocess's shared-memory swizzle (fa3/bwd_prepost.py, DQ_SWIZZLE), by a model of
its accesses: no GPU needed.

    python -m benchmarks.dq_swizzle_search          # every layout dispatch can pick: table
    python -m benchmarks.dq_swizzle_search --two    # also try pairs of XOR terms

Fa3DqPostprocess copies a TILE_M x D block of the tile-ordered float32 accumulator into shared
memory in accumulator order, then each thread gathers 8 adjacent columns of one row: lane t of
a warp reads element (row rp, column 8 * chunk + k) at row_off[r] + col_off[c] (chunk = t % (D /
8), rp = t // (D / 8)), one 4-byte load per k. A warp's load takes as many shared-memory
wavefronts as the most used of the 32 banks has distinct addresses (`wavefronts`); 32 distinct
banks is 1. For each layout the search tries XOR swizzles a ^ ((a >> (shift - base)) & mask <<
base) with base >= 2 (16-byte groups stay whole for cp.async) and shift >= base + bits, and
keeps the one with the fewest wavefronts (ties: fewer terms, then the smallest).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from types import SimpleNamespace

import numpy as np

from flashsuite.fa3.bwd_prepost import swizzle_index


def layouts() -> list[tuple[int, int, int, str]]:
    """(tile_m, D, num_wgs, dq_split) of every tile-ordered config bwd_config_for returns."""
    import torch

    from flashsuite.fa3.bwd_configs import BWD_HEAD_DIMS, bwd_config_for, dq_tiled

    out = set()
    for d in BWD_HEAD_DIMS:
        for causal, softcap, det, local in itertools.product((False, True), repeat=4):
            cfg = bwd_config_for(d, torch.bfloat16, causal, softcap, det, local=local)
            if dq_tiled(cfg):
                out.add((cfg.tile_m, d, cfg.num_mma_wgs, cfg.dq_split))
    return sorted(out)


def _addresses(tile_m: int, d: int, num_wgs: int, split: str) -> np.ndarray:
    """(loads, 32): the unswizzled float index each lane reads, one row per warp-wide load, with
    the kernel's own thread mapping (Fa3DqPostprocess for 16-bit dQ)."""
    from flashsuite.fa3.bwd_prepost import Fa3DqPostprocess, dq_offsets

    row_off, col_off = (
        t.numpy().astype(np.int64) for t in dq_offsets(tile_m, d, num_wgs, split, "cpu")
    )
    kernel = Fa3DqPostprocess(SimpleNamespace(width=16), d, tile_m, False)
    vec, chunks, rows_per_pass = kernel.VEC, kernel.CHUNKS, kernel.ROWS_PER_PASS
    threads = kernel.THREADS
    t = np.arange(threads)
    chunk, rp = t % chunks, t // chunks
    out = []
    for p in range(tile_m // rows_per_pass):
        for w in range(threads // 32):
            lanes = slice(32 * w, 32 * w + 32)
            for k in range(vec):
                out.append(row_off[p * rows_per_pass + rp[lanes]] + col_off[chunk[lanes] * vec + k])
    return np.array(out)


def _count(a: np.ndarray) -> int:
    """Wavefronts of warp loads (loads, 32) of distinct addresses: the busiest bank's count."""
    counts = np.zeros((a.shape[0], 32), dtype=np.int64)
    np.add.at(counts, (np.arange(a.shape[0])[:, None], a % 32), 1)
    return int(counts.max(axis=1).sum())


def wavefronts(tile_m: int, d: int, num_wgs: int, split: str, terms: tuple = ()) -> int:
    """Shared-memory wavefronts of the gathers of one block under swizzle `terms`."""
    return _count(swizzle_index(_addresses(tile_m, d, num_wgs, split), terms))


def candidates(top_bit: int) -> list[tuple[int, int, int]]:
    return [
        (bits, base, shift)
        for bits in (1, 2, 3)
        for base in (2, 3, 4)
        for shift in range(base + bits, top_bit)
        if base + bits <= 5  # targets within a 32-float bank row: the map stays in the block
    ]


def search(layout: tuple, two: bool) -> tuple[int, tuple]:
    tile_m, d = layout[:2]
    top = int(np.ceil(np.log2(tile_m * d)))
    a0 = _addresses(*layout)

    cands = candidates(top)
    tries = [()] + [(c,) for c in cands]
    if two:
        tries += [
            (c1, c2)
            for c1, c2 in itertools.combinations(cands, 2)
            if c1[2] >= c2[1] + c2[0]
            and c2[2] >= c1[1] + c1[0]  # sources above every target
            and not set(range(c1[1], c1[1] + c1[0])) & set(range(c2[1], c2[1] + c2[0]))
        ]
    return min((_count(swizzle_index(a0, t)), len(t), t) for t in tries)[::2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--two", action="store_true", help="also try pairs of XOR terms")
    args = ap.parse_args(argv)
    from flashsuite.fa3.bwd_prepost import dq_swizzle

    print("| layout (tile_m, D, wgs, split) | ideal | none | shipped | best found |")
    print("|---|---|---|---|---|")
    for layout in layouts():
        ideal = layout[0] * layout[1] // 32
        best = search(layout, args.two)
        shipped = dq_swizzle(*layout)
        print(
            f"| {layout} | {ideal} | {wavefronts(*layout)} | {wavefronts(*layout, shipped)} "
            f"{shipped} | {best[0]} {best[1]} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
