"""The backward's preprocess, shared by fa2 and fa3: delta = rowsum(dO * O) and
lse2 = LSE * log2(e), float32, padded to whole row blocks, in one memory-bound Triton kernel
(no float32 copies of O and dO, one launch).

`bwd_preprocess` is the launcher; `_bwd_preprocess` the kernel (fa2 launches it directly with
its own row padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e)
BLOCK_M = 64  # rows per program: memory-bound, any tile that vectorises


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_pad"])
def _bwd_preprocess(
    Out,  # (B, Nq, Hq, Dv)
    dOut,  # (B, Nq, Hq, Dv)
    Lse,  # (B, Hq, Nq) fp32, natural log
    Delta,  # (B, Hq, Nq_pad) fp32 out, contiguous
    Lse2,  # (B, Hq, Nq_pad) fp32 out, contiguous
    stride_ob,
    stride_on,
    stride_oh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_lb,
    stride_lh,
    stride_lm,
    seqlen_q,
    seqlen_pad,  # Nq rounded up to a multiple of every backward BLOCK_M
    num_heads,
    HEAD_DIM_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) (the softmax-Jacobian term of dS = P * (dP - delta)) and
    lse2 = LSE * log2(e), both fp32 and padded to seqlen_pad rows.

    lse2 is +inf for rows that saw no key (LSE = -inf) and for padding rows, so that
    P = exp2(S - lse2) is exactly 0 there; delta is 0 on padding rows. The main kernels then
    load both without masks: masked vector loads in their pipelined loops cost ~1 KB of spills.
    """
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) local rows
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    m_ok = (start_m + offs_m) < seqlen_q  # (BLOCK_M,)
    mask = m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)  # (BLOCK_M, DV_PAD)
    o_ptrs = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    o_ptrs = o_ptrs + start_m.to(tl.int64) * stride_on
    o_ptrs = o_ptrs + offs_m[:, None] * stride_on + offs_dv[None, :]  # (BLOCK_M, DV_PAD)
    do_ptrs = dOut + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    do_ptrs = do_ptrs + start_m.to(tl.int64) * stride_don
    do_ptrs = do_ptrs + offs_m[:, None] * stride_don + offs_dv[None, :]  # (BLOCK_M, DV_PAD)
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, DV_PAD)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, DV_PAD)
    delta = tl.sum(o * do, 1)  # (BLOCK_M,)
    l_ptrs = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
    lse = tl.load(l_ptrs + (start_m + offs_m) * stride_lm, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # (BLOCK_M,)
    row = (off_b.to(tl.int64) * num_heads + off_h) * seqlen_pad + start_m + offs_m  # (BLOCK_M,)
    tl.store(Delta + row, delta)
    tl.store(Lse2 + row, lse2)


def bwd_preprocess(
    out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, seqlen_pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, lse2), both (B, Hq, seqlen_pad) float32 contiguous, for out and dout
    (B, Nq, Hq, Dv) with unit last stride and lse (B, Hq, Nq) float32 (natural log).

    delta = rowsum(dO * O) (0 on padding rows); lse2 = LSE * log2(e), +inf where LSE = -inf (a
    row that sees no key) and on the padding rows, so that P = exp2(S - lse2) is exactly 0
    there. `seqlen_pad` must be a multiple of BLOCK_M and >= Nq."""
    b, nq, hq, dv = out.shape
    if seqlen_pad % BLOCK_M or seqlen_pad < nq:
        raise ValueError(
            f"bwd_preprocess: seqlen_pad expected a multiple of {BLOCK_M} >= {nq}, got {seqlen_pad}"
        )
    delta = torch.empty(b, hq, seqlen_pad, dtype=torch.float32, device=out.device)
    lse2 = torch.empty(b, hq, seqlen_pad, dtype=torch.float32, device=out.device)
    if b * hq == 0 or seqlen_pad == 0:
        return delta, lse2
    _bwd_preprocess[(seqlen_pad // BLOCK_M, hq, b)](
        out, dout, lse, delta, lse2, *out.stride()[:3], *dout.stride()[:3], *lse.stride(),
        nq, seqlen_pad, hq, HEAD_DIM_V=dv, DV_PAD=triton.next_power_of_2(dv), BLOCK_M=BLOCK_M,
    )  # fmt: skip
    return delta, lse2
