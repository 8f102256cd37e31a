"""A greedy-dispatch model of the fa3 backward's grid order under causal masking (no GPU).

    python -m benchmarks.bwd_order_model                  # the standard sweep's causal shapes
    python -m benchmarks.bwd_order_model --sms 132 --fixed 4

The backward launches one CTA per (column block, kv head, batch), one CTA per SM. Under causal
masking column block n of a head visits the row blocks from its diagonal down: with Nq = Nk =
N, TILE_N keys and TILE_M rows, (N - n·TILE_N) / TILE_M of them, so a head's CTAs range from N /
TILE_M row blocks to TILE_N / TILE_M. The hardware hands CTAs to SMs in launch order as SMs free
up; the model does the same (list scheduling: each CTA to the SM that frees first) with a CTA's
time = its row blocks + `fixed` (prologue and epilogue, in row-block units) and reports the
efficiency, the ideal time (total work / SMs) over the makespan, of three orders:

- default: blockIdx.x = n_block, then kv head, then batch (each head's column blocks in turn,
  longest first within the head);
- lpt (`BwdConfig.lpt`): column block 0 of every head, then column block 1, ...;
- section S (`BwdConfig.head_section`): the (kv head, batch) pairs in sections of S, column
  block 0 of each pair of a section, then column block 1, ...

In the default order the last head's longest CTA starts when the other heads' work is nearly
done and sets the tail; `lpt` removes the tail, but on the H200 it lost 2-24 % at D = 64 (every
head's Q and dO streamed at once: docs/results.md). A section keeps a few heads in flight, as
the default order does. The model knows nothing of L2, clocks or the per-row-block cost of the
diagonal's masked blocks: it says how much a better order can win, the GPU says whether it does.
"""

from __future__ import annotations

import argparse
import heapq
import sys


def makespan(jobs: list[float], sms: int) -> float:
    """Finish time of list scheduling `jobs` (in launch order) on `sms` identical SMs."""
    free = [0.0] * sms
    for job in jobs:
        heapq.heappush(free, heapq.heappop(free) + job)
    return max(free)


def order(pairs: int, n_blocks: int, section: int) -> list[tuple[int, int]]:
    """(pair, n_block) in launch order: section 0 = the default order, section >= pairs = lpt."""
    if section == 0:
        return [(p, n) for p in range(pairs) for n in range(n_blocks)]
    return [
        (p, n)
        for s0 in range(0, pairs, section)
        for n in range(n_blocks)
        for p in range(s0, min(pairs, s0 + section))
    ]


def efficiency(n: int, pairs: int, tile_m: int, tile_n: int, section: int, sms: int, fixed: float):
    """Ideal time over the model's makespan for one causal backward (Nq = Nk = n)."""
    n_blocks = -(-n // tile_n)
    work = [(n - nb * tile_n) / tile_m + fixed for _, nb in order(pairs, n_blocks, section)]
    return sum(work) / sms / makespan(work, sms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sms", type=int, default=132, help="SMs (H200: 132)")
    ap.add_argument("--fixed", type=float, default=4.0, help="a CTA's fixed cost in row blocks")
    args = ap.parse_args(argv)
    sections = (2, 4, 8, 16)
    head = " | ".join(f"section {s}" for s in sections)
    print(f"| D, tile, N, kv heads x batch | default | lpt | {head} |")
    print("|---" * (3 + len(sections)) + "|---|")
    # The shipped causal tiles: D = 64 128 x 128, D = 128 64 x 128, D = 256 64 x 80.
    for d, tile_m, tile_n in ((64, 128, 128), (128, 64, 128), (256, 64, 80)):
        for n in (1024, 4096, 8192, 16384):
            pairs = 2048 // d * 16384 // n  # B * N = 16k tokens, Hq * D = 2048
            row = [
                efficiency(n, pairs, tile_m, tile_n, s, args.sms, args.fixed)
                for s in (0, pairs, *sections)
            ]
            cells = " | ".join(f"{e:.3f}" for e in row)
            print(f"| {d}, {tile_m} x {tile_n}, {n}, {pairs} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
