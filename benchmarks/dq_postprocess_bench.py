"""fa3's dQ postprocess against the permuting torch copy it replaced (a GPU run).

    python3 -m benchmarks.dq_postprocess_bench

For a few backward shapes (the standard sweep's B·N = 16k, Hq·D = 2048 and a ragged Nq), the
accumulator in the shipped configs' tile layouts is turned into bf16 dQ by
`bwd_host.dq_from_tiles` (common/bwd_postprocess.py: one Triton pass over the real rows) and by
a torch view/permute/copy of the same layout (plus a slice copy for a ragged Nq); prints whether
the two are bit-for-bit equal, both times (triton.testing.do_bench, median) and the new one's
bandwidth over the 6 bytes per element it must move (4 read, 2 written).
"""

from __future__ import annotations

import torch
import triton

from flashsuite.fa3.bwd_configs import dq_tile_modes
from flashsuite.fa3.bwd_host import dq_from_tiles

# (B, Hq, Nq, D, tile_m, dq_split): the shipped D 128 / D 64 / D 256 layouts
SHAPES = [
    (4, 16, 4096, 128, 64, "d"),
    (1, 16, 16384, 128, 64, "d"),
    (4, 32, 4096, 64, 128, "m"),
    (2, 8, 4000, 256, 64, "d"),
]


def permute_copy(acc: torch.Tensor, nq: int, tile_m: int, dtype: torch.dtype, split: str):
    """The torch route: each block viewed in its modes sorted by stride, permuted to
    (B, block, rows.., Hq, cols..), copied with the cast, then the real rows sliced."""
    b, hq, nq_pad, d = acc.shape
    (rows, cols), (row_st, col_st) = dq_tile_modes(tile_m, d, 2, split)
    modes = [(st, "r", i, n) for i, (n, st) in enumerate(zip(rows, row_st, strict=True))]
    modes += [(st, "c", i, n) for i, (n, st) in enumerate(zip(cols, col_st, strict=True))]
    modes.sort(reverse=True)
    where = {(kind, i): 3 + pos for pos, (_, kind, i, _) in enumerate(modes)}
    row_dims = [where["r", i] for i in reversed(range(len(rows)))]
    col_dims = [where["c", i] for i in reversed(range(len(cols)))]
    tiles = acc.view(b, hq, nq_pad // tile_m, *[n for *_, n in modes])
    view = tiles.permute(0, 2, *row_dims, 1, *col_dims)
    out = torch.empty(view.shape, dtype=dtype, device=acc.device)
    out.copy_(view)
    out = out.view(b, nq_pad, hq, d)
    return out if nq == nq_pad else out[:, :nq].contiguous()


def time_shape(b: int, hq: int, nq: int, d: int, tile_m: int, split: str) -> str:
    acc = torch.randn(b, hq, -(-nq // tile_m) * tile_m, d, device="cuda")
    new = dq_from_tiles(acc, nq, tile_m, 2, torch.bfloat16, split)
    old = permute_copy(acc, nq, tile_m, torch.bfloat16, split)
    t_old = triton.testing.do_bench(lambda: permute_copy(acc, nq, tile_m, torch.bfloat16, split))
    t_new = triton.testing.do_bench(
        lambda: dq_from_tiles(acc, nq, tile_m, 2, torch.bfloat16, split)
    )
    tbps = b * hq * nq * d * 6 / (t_new * 1e-3) / 1e12
    return (
        f"B {b} Hq {hq} Nq {nq} D {d} tile_m {tile_m} split {split}: equal "
        f"{torch.equal(new, old)}, torch copy {t_old * 1e3:.1f} us, postprocess "
        f"{t_new * 1e3:.1f} us ({tbps:.2f} TB/s)"
    )


def main() -> None:
    for shape in SHAPES:
        print(time_shape(*shape), flush=True)


if __name__ == "__main__":
    main()
