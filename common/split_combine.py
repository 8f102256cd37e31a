"""Split-KV decode's shared pieces, used by fa2's Triton and fa3's CuTe DSL decode kernels: the
combine of the splits' partial results (a memory-bound Triton kernel) and the split count.

Each split of a row's key range writes its normalised partial O (float32) and its LSE; rows are
numbered (b, token, head) like a contiguous out. The combine gives lse = logsumexp_s lse_s and
out = sum_s exp(lse_s - lse) O_s in one pass with a running maximum; a split that saw no key
has lse_s = -inf and weight 0, and a row without any key gives out 0, lse -inf.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_launch import launch, next_power_of_2

COMBINE_ROWS = 16  # rows per combine program


@triton.jit(do_not_specialize=["total_rows", "seqlen_q", "num_splits"])
def _combine(
    OPart,  # (num_splits, R, Dv) fp32, R = B * Nq * Hq rows numbered (b, token, head)
    LsePart,  # (num_splits, R) fp32
    Out,  # (B, Nq, Hq, Dv) contiguous
    Lse,  # (B, Hq, Nq) fp32 contiguous
    total_rows,  # R
    seqlen_q,
    num_heads,
    num_splits,
    HEAD_DIM_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) * O_s with lse = logsumexp_s lse_s, one pass over splits
    with a running maximum (splits that saw no key have lse_s = -inf and weigh 0)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    row_ok = rows < total_rows
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)  # (BLOCK_R, DV_PAD)
    rows64 = rows.to(tl.int64)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)  # (BLOCK_R,) running max lse
    den = tl.zeros([BLOCK_R], dtype=tl.float32)  # (BLOCK_R,) sum exp(lse_s - m)
    acc = tl.zeros([BLOCK_R, DV_PAD], dtype=tl.float32)  # (BLOCK_R, DV_PAD)
    for s in range(num_splits):
        lse_s = tl.load(LsePart + s * total_rows + rows64, mask=row_ok, other=float("-inf"))
        o_s = tl.load(OPart + (s * total_rows + rows64)[:, None] * HEAD_DIM_V + offs_dv[None, :],
                      mask=mask, other=0.0)  # fmt: skip
        m_new = tl.maximum(m, lse_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)  # (BLOCK_R,)
        w = tl.exp(lse_s - m_use)  # (BLOCK_R,)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_s
        m = m_new
    seen = den > 0.0
    out = acc / tl.where(seen, den, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, den, 1.0)), float("-inf"))
    tl.store(Out + rows64[:, None] * HEAD_DIM_V + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=mask)  # fmt: skip
    # lse is (B, Hq, Nq): row (b, t, h) -> b * Hq * Nq + h * Nq + t
    tok = (rows // num_heads) % seqlen_q
    b = rows // (num_heads * seqlen_q)
    head = rows % num_heads
    tl.store(Lse + (b.to(tl.int64) * num_heads + head) * seqlen_q + tok, lse, mask=row_ok)


def combine_splits(
    o_part: torch.Tensor,  # (S, R, Dv) fp32, R = B * Nq * Hq rows numbered (b, token, head)
    lse_part: torch.Tensor,  # (S, R) fp32
    out: torch.Tensor,  # (B, Nq, Hq, Dv) contiguous
    lse: torch.Tensor,  # (B, Hq, Nq) fp32 contiguous
) -> None:
    """Merge S splits into out and lse (`_combine`), in place."""
    splits, rows, dv = o_part.shape
    _, nq, hq, _ = out.shape
    launch(
        _combine, (-(-rows // COMBINE_ROWS),),
        (o_part, lse_part, out, lse, rows, nq, hq, splits),
        dict(HEAD_DIM_V=dv, DV_PAD=next_power_of_2(dv), BLOCK_R=COMBINE_ROWS, num_warps=4),
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)  # pure; a decode loop asks the same question every step
def split_count(
    tiles: int, key_blocks: int, target: int, min_blocks_per_split: int, max_splits: int
) -> int:
    """Splits of the key range so that tiles * splits programs reach `target` programs in
    flight (the SM count times what one SM holds) without making a split shorter than
    min_blocks_per_split key blocks.

    tiles = B * Hkv * m_blocks programs without splitting; key_blocks = key blocks of the
    longest row. Among the split counts up to that bound, the largest whose wave efficiency
    (programs / (waves * target)) is within 5% of the best wins: more programs in flight, up
    to the target, without a mostly idle last wave.
    """
    if tiles >= target or key_blocks < 2 * min_blocks_per_split:
        return 1
    bound = min(max_splits, -(-target // tiles), key_blocks // min_blocks_per_split)

    def efficiency(s: int) -> float:
        programs = tiles * s
        waves = -(-programs // target)
        return programs / (waves * target)

    best = max(efficiency(s) for s in range(1, bound + 1))
    return next(s for s in range(bound, 0, -1) if efficiency(s) >= 0.95 * best)
