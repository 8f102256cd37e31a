"""common/bwd_postprocess.py: dQ out of the tile-ordered float32 accumulator, dense and packed,
against a float64 gather of the same layout; padding rows and the memory around dQ are never
written (dQ given as a view into a NaN-filled buffer)."""

from __future__ import annotations

import pytest
import torch

from flashsuite.common.bwd_postprocess import dq_postprocess
from flashsuite.common.bwd_preprocess import varlen_pad_index, varlen_pad_rows
from tests.conftest import DEVICE

# (tile_m, head_dim, dq_split) of fa3's "warp" layouts: columns split by warpgroup, rows split,
# the transposed dQ of 80-row tiles (not a power of two), and a head_dim that is not either.
LAYOUTS = [(64, 64, "d"), (128, 64, "m"), (80, 128, "dt"), (64, 96, "d")]


def _offsets(tile_m: int, head_dim: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from flashsuite.fa3.bwd_host import _dq_offsets

    return _dq_offsets(tile_m, head_dim, 2, split, torch.device(DEVICE))


def _expected(acc: torch.Tensor, row_off, col_off, scale) -> torch.Tensor:
    """(..., n_pad, D) float64: row r of block m, column c = acc's element m·TILE_M·D +
    row_off[r] + col_off[c] of its (batch, head) slab."""
    tile_m, d = row_off.numel(), col_off.numel()
    blocks = acc.double().reshape(*acc.shape[:-2], -1, tile_m * d)  # (..., blocks, TILE_M·D)
    idx = (row_off.long()[:, None] + col_off.long()[None, :]).flatten()
    out = blocks[..., idx].reshape(*acc.shape[:-2], -1, d)
    return out * scale if scale is not None else out


@pytest.mark.parametrize(("tile_m", "head_dim", "split"), LAYOUTS)
@pytest.mark.parametrize("scale", [None, 0.125])
def test_dense_dq_from_tiles_writes_real_rows_only(tile_m, head_dim, split, scale) -> None:
    row_off, col_off = _offsets(tile_m, head_dim, split)
    b, hq, nq = 2, 3, tile_m + 7  # a ragged last block
    nq_pad = 2 * tile_m
    acc = torch.randn(b, hq, nq_pad, head_dim, device=DEVICE)
    buf = torch.full((b, nq + 2, hq, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    dq = buf[:, 1 : nq + 1]  # rows around it must stay NaN
    assert dq_postprocess(acc, row_off, col_off, dq, scale) is dq
    want = _expected(acc, row_off, col_off, scale)[:, :, :nq].transpose(1, 2)  # (B, Nq, Hq, D)
    assert torch.equal(dq.float(), want.to(torch.bfloat16).float())
    assert buf[:, 0].isnan().all() and buf[:, -1].isnan().all()


@pytest.mark.parametrize(("tile_m", "head_dim", "split"), [LAYOUTS[0], LAYOUTS[1]])
def test_packed_dq_lands_on_each_sequences_rows(tile_m, head_dim, split) -> None:
    """Sequences of 0, 5, tile_m + 1 and 1 rows (an empty one, a ragged block, two blocks)."""
    row_off, col_off = _offsets(tile_m, head_dim, split)
    lens = [0, 5, tile_m + 1, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, hq = int(cu[-1]), 2
    rows_pad = varlen_pad_rows(total, len(lens), tile_m)
    acc = torch.randn(hq, rows_pad, head_dim, device=DEVICE)
    buf = torch.full((total + 2, hq, head_dim), float("nan"), dtype=torch.float16, device=DEVICE)
    dq = buf[1 : total + 1]
    dq_postprocess(acc, row_off, col_off, dq, None, cu.to(DEVICE))
    padded = _expected(acc, row_off, col_off, None)  # (Hq, rows_pad, D)
    want = padded[:, varlen_pad_index(cu, total, tile_m).to(DEVICE)].transpose(0, 1)
    assert torch.equal(dq.float(), want.to(torch.float16).float())
    assert buf[0].isnan().all() and buf[-1].isnan().all()


def test_bad_arguments_are_named() -> None:
    row_off, col_off = _offsets(64, 64, "d")
    acc = torch.zeros(1, 1, 64, 64, device=DEVICE)
    with pytest.raises(ValueError, match="acc expected contiguous"):
        dq_postprocess(acc[..., :32], row_off, col_off, torch.empty(1, 64, 1, 32))
    with pytest.raises(ValueError, match="unit last stride"):
        dq = torch.empty(1, 64, 1, 128, device=DEVICE)[..., ::2]
        dq_postprocess(acc, row_off, col_off, dq)
    with pytest.raises(ValueError, match=r"Nq <= 64"):
        dq_postprocess(acc, row_off, col_off, torch.empty(1, 65, 1, 64, device=DEVICE))
    with pytest.raises(ValueError, match="int32"):
        dq_postprocess(acc, row_off.long(), col_off, torch.empty(1, 64, 1, 64, device=DEVICE))
