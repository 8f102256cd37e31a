"""FlashAttention-2 over packed sequences (varlen) in Triton: forward and recompute backward.

Layout: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), out like q with Dv,
lse (Hq, total_q) fp32; sequence b is rows cu_seqlens_q[b]..cu_seqlens_q[b+1] of q and
cu_seqlens_k[b]..cu_seqlens_k[b+1] of k and v, bottom-right aligned on its own lengths.

The per-tile maths is the dense kernels' (kernels._fwd_inner, _bwd_dkdv_inner, _bwd_dq_inner,
with the same three-stage masked / unmasked / masked loop); what changes is the grid: axis 2
is the sequence, whose start and length each program reads from cu_seqlens, and a program
whose tile starts past its sequence's length returns at once. Tiles never straddle two
sequences, so no work is spent on another sequence's keys or on padding; the grid is sized by
max_seqlen, which may be loose (extra programs exit at once).

The backward's per-row buffers (delta, lse2) give sequence b the rows
[cu_seqlens_q[b] + b * ROW_PAD, ...): ROW_PAD spare rows per sequence, so a tile that runs past
its sequence's end reads lse2 = +inf (P = 0) and delta = 0 without a mask.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashsuite.fa2.kernels import (
    LN2,
    LOG2E,
    _bwd_dkdv_inner,
    _bwd_dq_inner,
    _fwd_inner,
    _key_range,
    _query_range,
)

_NO_SPEC = ["window_left", "window_right", "row_pad"]


@triton.jit
def _seq_bounds(CuQ, CuK, off_b):
    """(q start, q length, k start, k length) of sequence off_b; starts in int64."""
    q0 = tl.load(CuQ + off_b)
    k0 = tl.load(CuK + off_b)
    seqlen_q = tl.load(CuQ + off_b + 1) - q0
    seqlen_k = tl.load(CuK + off_b + 1) - k0
    return q0.to(tl.int64), seqlen_q, k0.to(tl.int64), seqlen_k


@triton.jit(do_not_specialize=_NO_SPEC)
def _varlen_fwd(
    Q,  # (total_q, Hq, D)
    K,  # (total_k, Hkv, D)
    V,  # (total_k, Hkv, Dv)
    Out,  # (total_q, Hq, Dv)
    Lse,  # (Hq, total_q) fp32
    CuQ,  # (B + 1,) int32
    CuK,  # (B + 1,) int32
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    stride_lh,
    group,
    window_left,
    window_right,
    qk_scale,
    softcap_log2,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    q0, seqlen_q, k0, seqlen_k = _seq_bounds(CuQ, CuK, off_b)
    start_m = tl.program_id(0) * BLOCK_M
    if start_m >= seqlen_q:
        return
    shift = seqlen_k - seqlen_q
    off_hkv = off_h // group

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of the sequence
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, D_PAD)  # (D_PAD,)
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    m_ok = offs_m < seqlen_q  # (BLOCK_M,)

    q_base = Q + q0 * stride_qn + off_h.to(tl.int64) * stride_qh  # Q at (sequence row 0, h)
    q_ptrs = q_base + offs_m[:, None] * stride_qn + offs_d[None, :]  # (BLOCK_M, D_PAD)
    q = tl.load(q_ptrs, mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + k0 * stride_kn + off_hkv.to(tl.int64) * stride_kh
    v_base = V + k0 * stride_vn + off_hkv.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # (BLOCK_M,) log2 domain
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # (BLOCK_M,)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)  # (BLOCK_M, DV_PAD)
    lo, full_lo, full_hi, hi = _key_range(
        start_m, seqlen_q, seqlen_k, shift, window_left, window_right, BLOCK_M, BLOCK_N,
        HAS_LEFT, HAS_RIGHT,
    )  # fmt: skip
    for stage in tl.static_range(3):  # masked left edge, unmasked middle, masked right edge
        s_lo = lo if stage == 0 else (full_lo if stage == 1 else full_hi)
        s_hi = full_lo if stage == 0 else (full_hi if stage == 1 else hi)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d,
            offs_dv, s_lo, s_hi, seqlen_k, shift, window_left, window_right, qk_scale,
            softcap_log2, stage != 1, 1 if stage != 1 else None, HAS_LEFT, HAS_RIGHT, SOFTCAP,
            HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip

    seen = l_i > 0.0  # (BLOCK_M,)
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o_base = Out + q0 * stride_on + off_h.to(tl.int64) * stride_oh
    o_ptrs = o_base + offs_m[:, None] * stride_on + offs_dv[None, :]  # (BLOCK_M, DV_PAD)
    tl.store(
        o_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    )
    tl.store(Lse + off_h.to(tl.int64) * stride_lh + q0 + offs_m, lse, mask=m_ok)


@triton.jit
def _varlen_bwd_preprocess(
    Out,  # (total_q, Hq, Dv)
    dOut,  # (total_q, Hq, Dv)
    Lse,  # (Hq, total_q) fp32
    Delta,  # (Hq, total_q + B * row_pad) fp32, zeros
    Lse2,  # (Hq, total_q + B * row_pad) fp32, +inf
    CuQ,
    stride_on,
    stride_oh,
    stride_don,
    stride_doh,
    stride_lh,
    stride_dh,  # row stride of Delta / Lse2
    row_pad,
    HEAD_DIM_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O), lse2 = LSE * log2(e) (+inf where LSE = -inf) on the rows of each
    sequence; the spare rows keep their zeros / +inf."""
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    q0 = tl.load(CuQ + off_b).to(tl.int64)
    seqlen_q = tl.load(CuQ + off_b + 1) - q0
    start_m = tl.program_id(0) * BLOCK_M
    if start_m >= seqlen_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    m_ok = offs_m < seqlen_q
    mask = m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)  # (BLOCK_M, DV_PAD)
    rows = q0 + offs_m  # (BLOCK_M,)
    o = tl.load(Out + off_h * stride_oh + rows[:, None] * stride_on + offs_dv[None, :], mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    do = tl.load(dOut + off_h * stride_doh + rows[:, None] * stride_don + offs_dv[None, :],
                 mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    lse = tl.load(Lse + off_h * stride_lh + rows, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # (BLOCK_M,)
    dst = off_h.to(tl.int64) * stride_dh + rows + off_b * row_pad  # (BLOCK_M,)
    tl.store(Delta + dst, tl.sum(o * do, 1), mask=m_ok)
    tl.store(Lse2 + dst, lse2, mask=m_ok)


@triton.jit(do_not_specialize=_NO_SPEC)
def _varlen_bwd_dkdv(
    Q,  # (total_q, Hq, D)
    K,  # (total_k, Hkv, D)
    V,  # (total_k, Hkv, Dv)
    dO,  # (total_q, Hq, Dv)
    Lse2,  # (Hq, total_q + B * row_pad) fp32
    Delta,  # (Hq, total_q + B * row_pad) fp32
    dK,  # (total_k, Hkv, D)
    dV,  # (total_k, Hkv, Dv)
    CuQ,
    CuK,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_don,
    stride_doh,
    stride_dkn,
    stride_dkh,
    stride_dvn,
    stride_dvh,
    stride_dh,
    row_pad,
    group,
    window_left,
    window_right,
    qk_scale,
    softcap_log2,
    scale,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TAIL_STAGES: tl.constexpr,
    WANT_DK: tl.constexpr,
    WANT_DV: tl.constexpr,
):
    """One program per (key block, kv head, sequence), the GQA group summed in registers."""
    off_hkv = tl.program_id(1)
    off_b = tl.program_id(2)
    q0, seqlen_q, k0, seqlen_k = _seq_bounds(CuQ, CuK, off_b)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= seqlen_k:
        return
    shift = seqlen_k - seqlen_q

    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) local rows
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) keys of the sequence
    offs_d = tl.arange(0, D_PAD)  # (D_PAD,)
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    offs_nl = tl.arange(0, BLOCK_N)  # (BLOCK_N,) local keys
    n_ok = (offs_n < seqlen_k)[:, None]  # (BLOCK_N, 1)
    d_ok = offs_d[None, :] < HEAD_DIM  # (1, D_PAD)
    dv_ok = offs_dv[None, :] < HEAD_DIM_V  # (1, DV_PAD)
    # Scalar int64 bases and int32 per-element offsets, as in the dense kernel: an int64
    # (BLOCK_N, 1) row index kept live to the epilogue costs registers this kernel lacks.
    key0 = k0 + start_n  # the tile's first key, int64
    k_ptrs = K + key0 * stride_kn + off_hkv.to(tl.int64) * stride_kh
    k_ptrs = k_ptrs + offs_nl[:, None] * stride_kn + offs_d[None, :]  # (BLOCK_N, D_PAD)
    k = tl.load(k_ptrs, mask=n_ok & d_ok, other=0.0)  # (BLOCK_N, D_PAD)
    v = k  # unused by a dV-only launch
    if WANT_DK:
        v_ptrs = V + key0 * stride_vn + off_hkv.to(tl.int64) * stride_vh
        v_ptrs = v_ptrs + offs_nl[:, None] * stride_vn + offs_dv[None, :]  # (BLOCK_N, DV_PAD)
        v = tl.load(v_ptrs, mask=n_ok & dv_ok, other=0.0)  # (BLOCK_N, DV_PAD)
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _query_range(
        start_n, seqlen_q, seqlen_k, shift, window_left, window_right, BLOCK_M, BLOCK_N,
        HAS_LEFT, HAS_RIGHT,
    )  # fmt: skip
    for g in range(group):
        off_h = off_hkv * group + g
        q_base = Q + q0 * stride_qn + off_h.to(tl.int64) * stride_qh
        do_base = dO + q0 * stride_don + off_h.to(tl.int64) * stride_doh
        row0 = off_h.to(tl.int64) * stride_dh + q0 + off_b * row_pad
        if HAS_RIGHT:  # below the causal diagonal / right window edge (else lo == full_lo)
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, Lse2 + row0, Delta + row0, dK, 0,
                stride_qn, stride_don, offs_m, offs_n, offs_d, offs_dv,
                lo, full_lo, seqlen_q, seqlen_k, shift, window_left, window_right,
                qk_scale, softcap_log2, scale, True, 1,
                HAS_LEFT, HAS_RIGHT, SOFTCAP, False, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD,
                BLOCK_M, DOT_PRECISION, WANT_DK, WANT_DV,
            )  # fmt: skip
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, Lse2 + row0, Delta + row0, dK, 0,
            stride_qn, stride_don, offs_m, offs_n, offs_d, offs_dv,
            full_lo, full_hi, seqlen_q, seqlen_k, shift, window_left, window_right,
            qk_scale, softcap_log2, scale, False, None,
            HAS_LEFT, HAS_RIGHT, SOFTCAP, False, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD,
            BLOCK_M, DOT_PRECISION, WANT_DK, WANT_DV,
        )  # fmt: skip
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, Lse2 + row0, Delta + row0, dK, 0,
            stride_qn, stride_don, offs_m, offs_n, offs_d, offs_dv,
            full_hi, hi, seqlen_q, seqlen_k, shift, window_left, window_right,
            qk_scale, softcap_log2, scale, True, TAIL_STAGES,
            HAS_LEFT, HAS_RIGHT, SOFTCAP, False, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD,
            BLOCK_M, DOT_PRECISION, WANT_DK, WANT_DV,
        )  # fmt: skip

    if WANT_DK:
        dk_ptrs = dK + key0 * stride_dkn + off_hkv.to(tl.int64) * stride_dkh
        dk_ptrs = dk_ptrs + offs_nl[:, None] * stride_dkn + offs_d[None, :]  # (BLOCK_N, D_PAD)
        tl.store(dk_ptrs, (dk * scale).to(dK.dtype.element_ty), mask=n_ok & d_ok)
    if WANT_DV:
        dv_ptrs = dV + key0 * stride_dvn + off_hkv.to(tl.int64) * stride_dvh
        dv_ptrs = dv_ptrs + offs_nl[:, None] * stride_dvn + offs_dv[None, :]  # (N, DV_PAD)
        tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=n_ok & dv_ok)


@triton.jit(do_not_specialize=_NO_SPEC)
def _varlen_bwd_dq(
    Q,  # (total_q, Hq, D)
    K,  # (total_k, Hkv, D)
    V,  # (total_k, Hkv, Dv)
    dO,  # (total_q, Hq, Dv)
    Lse2,  # (Hq, total_q + B * row_pad) fp32
    Delta,  # (Hq, total_q + B * row_pad) fp32
    dQ,  # (total_q, Hq, D)
    CuQ,
    CuK,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_don,
    stride_doh,
    stride_dqn,
    stride_dqh,
    stride_dh,
    row_pad,
    group,
    window_left,
    window_right,
    qk_scale,
    softcap_log2,
    scale,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dQ for one (Q block, head, sequence), recomputing S and dP (deterministic)."""
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    q0, seqlen_q, k0, seqlen_k = _seq_bounds(CuQ, CuK, off_b)
    start_m = tl.program_id(0) * BLOCK_M
    if start_m >= seqlen_q:
        return
    shift = seqlen_k - seqlen_q
    off_hkv = off_h // group

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, D_PAD)  # (D_PAD,)
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d[None, :] < HEAD_DIM
    rows = (q0 + offs_m)[:, None]  # (BLOCK_M, 1) int64
    q = tl.load(Q + off_h * stride_qh + rows * stride_qn + offs_d[None, :],
                mask=m_ok[:, None] & d_ok, other=0.0)  # fmt: skip
    do = tl.load(dO + off_h * stride_doh + rows * stride_don + offs_dv[None, :],
                 mask=m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)  # fmt: skip
    row0 = off_h.to(tl.int64) * stride_dh + q0 + off_b * row_pad
    lse2 = tl.load(Lse2 + row0 + offs_m)  # (BLOCK_M,) +inf past the sequence: P = 0
    delta = tl.load(Delta + row0 + offs_m)  # (BLOCK_M,)
    k_base = K + k0 * stride_kn + off_hkv.to(tl.int64) * stride_kh
    v_base = V + k0 * stride_vn + off_hkv.to(tl.int64) * stride_vh

    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_range(
        start_m, seqlen_q, seqlen_k, shift, window_left, window_right, BLOCK_M, BLOCK_N,
        HAS_LEFT, HAS_RIGHT,
    )  # fmt: skip
    for stage in tl.static_range(3):
        s_lo = lo if stage == 0 else (full_lo if stage == 1 else full_hi)
        s_hi = full_lo if stage == 0 else (full_hi if stage == 1 else hi)
        dq = _bwd_dq_inner(
            dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n,
            offs_d, offs_dv, s_lo, s_hi, seqlen_k, shift, window_left, window_right, qk_scale,
            softcap_log2, stage != 1, 1 if stage != 1 else None, HAS_LEFT, HAS_RIGHT, SOFTCAP,
            HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip
    dq_ptrs = dQ + off_h * stride_dqh + rows * stride_dqn + offs_d[None, :]
    tl.store(dq_ptrs, (dq * scale).to(dQ.dtype.element_ty), mask=m_ok[:, None] & d_ok)
