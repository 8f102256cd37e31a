"""A greedy-dispatch model of the fa3 backward's grid order under causal masking (no GPU).

    python -m benchmarks.bwd_order_model                  # the standard sweep's causal shapes
    python -m benchmarks.bwd_order_model --sms 132 --fixed 4
    python -m benchmarks.bwd_order_model --varlen         # the causal packed forward's plain grid

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
done and sets the tail (without causal masking the CTAs are equal and only the last wave's
empty SMs are lost, printed last); `lpt` removes the tail, but on the H200 it lost 2-24 % at
D = 64 (every head's Q and dO streamed at once: docs/results.md). A section keeps a few heads in
flight, as the default order does. The model knows nothing of L2, clocks or the per-row-block
cost of the diagonal's masked blocks: it says how much a better order can win, the GPU says
whether it does.

`--varlen` models fa3's causal packed forward on its plain grid instead (decode_bench's 64k-token
mix: 35 sequences of mean 2k, H 16, 128-row tiles): a tile's time is its key blocks + `fixed`,
the default order runs each head's virtual blocks in turn (each sequence's heaviest first),
sections take S heads' blocks together; it also prints the share of executed blocks that the
FLOP count credits (sum of L^2 / 2 per sequence), for the mix and for the dense B 32 x N 2048
shape of the same tokens.
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
    """(pair, n_block) in launch order: section 0 = the default order, section >= pairs = lpt;
    otherwise the kernel's own map (bwd_blocks.section_tile) of each CTA index."""
    if section == 0:
        return [(p, n) for p in range(pairs) for n in range(n_blocks)]
    from flashsuite.fa3.bwd_blocks import section_tile

    tiles = (section_tile(bid, n_blocks, pairs, section) for bid in range(n_blocks * pairs))
    return [(p, n) for n, p in tiles]


def efficiency(n: int, pairs: int, tile_m: int, tile_n: int, section: int, sms: int, fixed: float):
    """Ideal time over the model's makespan for one causal backward (Nq = Nk = n)."""
    n_blocks = -(-n // tile_n)
    work = [(n - nb * tile_n) / tile_m + fixed for _, nb in order(pairs, n_blocks, section)]
    return sum(work) / sms / makespan(work, sms)


def varlen_forward(sms: int, fixed: float) -> None:
    """The causal packed forward's plain grid on decode_bench's 64k mix (see the docstring)."""
    import torch

    from benchmarks.decode_bench import _mixed_lengths

    lens = _mixed_lengths(65536, 2048, torch.Generator().manual_seed(0))
    heads, tile = 16, 128
    blocks = [m + 1 for n in lens for m in range(-(-n // tile))]  # key blocks per virtual block
    tiles = [b + fixed for b in reversed(blocks)]  # a head's launch order: heaviest first

    def eff(section: int) -> float:
        work = [tiles[rank] for _, rank in order(heads, len(tiles), section)]
        return sum(work) / sms / makespan(work, sms)

    useful = sum(n * n / 2 for n in lens) / tile**2
    dense = 32 * 2048 * 2048 / 2 / tile**2 / (32 * sum(m + 1 for m in range(2048 // tile)))
    print(f"packed causal forward, {len(lens)} sequences, H {heads}, {tile}-row tiles")
    print(f"  useful / executed blocks: mix {useful / sum(blocks):.3f}, dense {dense:.3f}")
    cells = ", ".join(f"section {s} {eff(s):.3f}" for s in (2, 4, 8, 16))
    print(f"  order efficiency: default {eff(0):.3f}, {cells}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sms", type=int, default=132, help="SMs (H200: 132)")
    ap.add_argument(
        "--fixed", type=float, help="a CTA's fixed cost in row (key) blocks: 4 (--varlen: 1.5)"
    )
    ap.add_argument("--varlen", action="store_true", help="the causal packed forward instead")
    args = ap.parse_args(argv)
    if args.varlen:
        varlen_forward(args.sms, 1.5 if args.fixed is None else args.fixed)
        return 0
    args.fixed = 4.0 if args.fixed is None else args.fixed
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
    # Without causal masking every CTA costs the same and no order helps: what is lost is the
    # last wave's empty SMs (the sweep's shapes launch 2048 CTAs at D = 128, 15.5 waves).
    ctas = 2048
    waves = ctas / args.sms
    full = -(-ctas // args.sms)
    print(f"non-causal, {ctas} equal CTAs: {waves:.2f} waves, efficiency {waves / full:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
