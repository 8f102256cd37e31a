"""The fa2 recompute backward: preprocess (delta, lse2), dK/dV, and the deterministic dQ pass.

`_bwd_preprocess` computes delta = rowsum(dO * O) and lse2 = LSE * log2(e), padded to whole
blocks; `_bwd_dkdv` runs one program per (K/V block, Hkv, B) and sums the GQA group's dK/dV in
registers, optionally reduce-adding dQ through a TMA descriptor (`DQ_ATOMIC`); `_bwd_dq` runs
one program per (Q block, Hq, B). Both loop in the three stages of `mask._query_range` /
`mask._key_range`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashsuite.common.bwd_preprocess import _bwd_preprocess  # noqa: F401 (re-exported)
from flashsuite.fa2.mask import (
    _NO_SPEC,
    _key_range,
    _query_range,
    _scores,
    _visible,
)


@triton.jit
def _bwd_dkdv_inner(
    dk,  # (BLOCK_N, D_PAD) fp32
    dv,  # (BLOCK_N, DV_PAD) fp32
    k,  # (BLOCK_N, D_PAD)
    v,  # (BLOCK_N, DV_PAD)
    q_base,  # Q at (b, h, row 0)
    do_base,  # dO at (b, h, row 0)
    lse2_base,  # Lse2 at (b, h, row 0), padded: loads need no mask
    delta_base,  # Delta at (b, h, row 0), padded
    dq_desc,  # DQ_ATOMIC: descriptor of the fp32 dQ accumulator (B*Hq*Nq_pad, D), block (M, D)
    dq_row0,  # DQ_ATOMIC: its row of (b, h, query 0), int32
    stride_qn,
    stride_don,
    offs_m,  # (BLOCK_M,) 0..BLOCK_M-1
    offs_n,  # (BLOCK_N,) key indices
    offs_d,  # (D_PAD,)
    offs_dv,  # (DV_PAD,)
    lo,
    hi,
    seqlen_q,
    seqlen_k,
    shift,
    window_left,
    window_right,
    qk_scale,
    softcap_log2,
    scale,
    MASKED: tl.constexpr,
    LOOP_STAGES: tl.constexpr,  # None: the kernel's num_stages
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WANT_DK: tl.constexpr,
    WANT_DV: tl.constexpr,
):
    """Accumulate dK, dV of one key block over the Q blocks [lo, hi) of one query head.

    Works on transposed tiles (keys x queries) so that dV += P^T dO and dK += dS^T Q are plain
    dots. Q rows past seqlen_q load zeros and a padded lse2 of +inf: P = 0, no contribution.
    WANT_DK / WANT_DV: which of the two this launch accumulates (a split launch does dV with
    2 GEMMs per step, then dK with 3, so only one fp32 accumulator lives in registers).
    """
    # Scalar block pointers advance; per-element offsets are loop invariant (see _fwd_inner).
    q_blk = q_base + tl.cast(lo, tl.int64) * stride_qn  # Q at row `lo`
    do_blk = do_base + tl.cast(lo, tl.int64) * stride_don
    lse2_blk = lse2_base + lo
    delta_blk = delta_base + lo
    q_offs = offs_m[:, None] * stride_qn + offs_d[None, :]  # (BLOCK_M, D_PAD)
    do_offs = offs_m[:, None] * stride_don + offs_dv[None, :]  # (BLOCK_M, DV_PAD)
    d_ok = offs_d[None, :] < HEAD_DIM  # (1, D_PAD)
    dv_ok = offs_dv[None, :] < HEAD_DIM_V  # (1, DV_PAD)
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=LOOP_STAGES):
        q_ptrs = q_blk + q_offs  # (BLOCK_M, D_PAD)
        do_ptrs = do_blk + do_offs  # (BLOCK_M, DV_PAD)
        lse2 = tl.load(lse2_blk + offs_m)  # (BLOCK_M,) log2 domain, +inf: no contribution
        delta = lse2  # a dV-only launch never reads delta
        if WANT_DK:
            delta = tl.load(delta_blk + offs_m)  # (BLOCK_M,)
        if MASKED:
            m_ok = (start_m + offs_m) < seqlen_q  # (BLOCK_M,)
            q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok, other=0.0)  # (BLOCK_M, D_PAD)
            do = tl.load(do_ptrs, mask=m_ok[:, None] & dv_ok, other=0.0)  # (BLOCK_M, DV_PAD)
        else:
            if HEAD_DIM != D_PAD:
                q = tl.load(q_ptrs, mask=d_ok, other=0.0)
            else:
                q = tl.load(q_ptrs)
            if HEAD_DIM_V != DV_PAD:
                do = tl.load(do_ptrs, mask=dv_ok, other=0.0)
            else:
                do = tl.load(do_ptrs)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) fp32
        sT, tT = _scores(qkT, qk_scale, softcap_log2, SOFTCAP)  # (BLOCK_N, BLOCK_M)
        if MASKED:
            vis = _visible(
                start_m + offs_m[None, :],
                offs_n[:, None],
                seqlen_k,
                shift,
                window_left,
                window_right,
                HAS_LEFT,
                HAS_RIGHT,
            )  # (BLOCK_N, BLOCK_M)
            sT = tl.where(vis, sT, float("-inf"))
        pT = tl.math.exp2(sT - lse2[None, :])  # (BLOCK_N, BLOCK_M); 0 where masked / lse=-inf
        if WANT_DV:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # (N, DV_PAD)
        if WANT_DK:
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
            dsT = pT * (dpT - delta[None, :])  # (BLOCK_N, BLOCK_M): dL/ds (scaled, capped)
            if SOFTCAP:
                dsT = dsT * (1.0 - tT * tT)  # d softcap*tanh(x/softcap) / dx
            dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # (N, D_PAD)
            if DQ_ATOMIC:
                # dQ^T = K^T dS^T keeps the keys as the reduction and the 64+ rows of D as
                # wgmma's M (BLOCK_M is 16-32 here). One TMA reduce-add per tile
                # (cp.reduce.async.bulk), no per-element addresses: pointer atomics cost
                # 0.2-0.3 KB of spills. Rows past seqlen_q add exact zeros (P = 0 there).
                dqT = tl.dot(tl.trans(k), dsT.to(k.dtype), input_precision=DOT_PRECISION)
                dq_desc.atomic_add([dq_row0 + start_m, 0], tl.trans(dqT) * scale)  # (M, D_PAD)
        q_blk += BLOCK_M * stride_qn
        do_blk += BLOCK_M * stride_don
        lse2_blk += BLOCK_M
        delta_blk += BLOCK_M
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dkdv(
    Q,  # (B, Nq, Hq, D)
    K,  # (B, Nk, Hkv, D)
    V,  # (B, Nk, Hkv, Dv)
    dO,  # (B, Nq, Hq, Dv)
    Lse2,  # (B, Hq, Nq_pad) fp32, LSE * log2(e), +inf on rows with no contribution
    Delta,  # (B, Hq, Nq_pad) fp32
    dK,  # (B, Nk, Hkv, D)
    dV,  # (B, Nk, Hkv, Dv)
    dQacc,  # DQ_ATOMIC: descriptor of (B*Hq*Nq_pad, D) fp32 zeros, block (BLOCK_M, D_PAD)
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    stride_dqb,  # the fp32 dQ accumulator (B, Hq, Nq_pad, D), DQ_ATOMIC only
    stride_dqh,
    stride_dqn,
    seqlen_q,
    seqlen_k,
    seqlen_pad,  # row stride of Lse2 / Delta
    num_heads,  # Hq
    group,  # Hq // Hkv
    shift,
    window_left,
    window_right,
    qk_scale,
    softcap_log2,
    scale,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TAIL_STAGES: tl.constexpr,  # pipelining of the last masked stage: 1, or None (num_stages)
    WANT_DK: tl.constexpr,  # both True, or one of them: a split launch's dK / dV half
    WANT_DV: tl.constexpr,
):
    """One program per (key block, kv head, batch); loops over the GQA group's query heads.

    Stage 1 (causal diagonal / right window edge) only exists with HAS_RIGHT. The last masked
    stage (query tail, key tail, left window edge) runs unpipelined or with the kernel's
    num_stages (`TAIL_STAGES`): which of the two leaves ptxas without spills depends on the
    tile; the sm_90a probe decides per config (D128 non-causal 32x128 s2: 16 B unpipelined,
    0 B pipelined; causal: the other way round).
    """
    start_n = tl.program_id(0) * BLOCK_N
    off_hkv = tl.program_id(1)
    off_b = tl.program_id(2)

    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,) local rows
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key indices
    offs_nl = tl.arange(0, BLOCK_N)  # (BLOCK_N,) local keys
    offs_d = tl.arange(0, D_PAD)  # (D_PAD,)
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    n_ok = (offs_n < seqlen_k)[:, None]  # (BLOCK_N, 1)
    d_ok = offs_d[None, :] < HEAD_DIM  # (1, D_PAD)
    dv_ok = offs_dv[None, :] < HEAD_DIM_V  # (1, DV_PAD)

    k_ptrs = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    k_ptrs = k_ptrs + start_n.to(tl.int64) * stride_kn
    k_ptrs = k_ptrs + offs_nl[:, None] * stride_kn + offs_d[None, :]  # (BLOCK_N, D_PAD)
    v_ptrs = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    v_ptrs = v_ptrs + start_n.to(tl.int64) * stride_vn
    v_ptrs = v_ptrs + offs_nl[:, None] * stride_vn + offs_dv[None, :]  # (BLOCK_N, DV_PAD)
    k = tl.load(k_ptrs, mask=n_ok & d_ok, other=0.0)  # (BLOCK_N, D_PAD)
    v = k  # unused by a dV-only launch (dP needs V)
    if WANT_DK:
        v = tl.load(v_ptrs, mask=n_ok & dv_ok, other=0.0)  # (BLOCK_N, DV_PAD)

    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)  # (BLOCK_N, D_PAD)
    dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)  # (BLOCK_N, DV_PAD)

    lo, full_lo, full_hi, hi = _query_range(
        start_n,
        seqlen_q,
        seqlen_k,
        shift,
        window_left,
        window_right,
        BLOCK_M,
        BLOCK_N,
        HAS_LEFT,
        HAS_RIGHT,
    )
    # GQA: the whole group is summed here, in registers, in a fixed order: no atomics and
    # bitwise-reproducible dK/dV.
    for g in range(group):
        off_h = off_hkv * group + g
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        do_base = dO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        row0 = (off_b.to(tl.int64) * num_heads + off_h) * seqlen_pad
        dq_row0 = 0  # the dQ accumulator's row of (b, h, query 0)
        if DQ_ATOMIC:
            # TMA coordinates are int32 rows (interface checks B*Hq*Nq_pad < 2^31)
            dq_row0 = (off_b * stride_dqb + off_h * stride_dqh) // stride_dqn
        if HAS_RIGHT:  # below the causal diagonal / right window edge (else lo == full_lo)
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, Lse2 + row0, Delta + row0, dQacc, dq_row0,
                stride_qn, stride_don, offs_m, offs_n, offs_d, offs_dv,
                lo, full_lo, seqlen_q, seqlen_k, shift, window_left, window_right,
                qk_scale, softcap_log2, scale,
                True, 1, HAS_LEFT, HAS_RIGHT, SOFTCAP, DQ_ATOMIC, HEAD_DIM, HEAD_DIM_V, D_PAD,
                DV_PAD, BLOCK_M, DOT_PRECISION, WANT_DK, WANT_DV,
            )  # fmt: skip
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, Lse2 + row0, Delta + row0, dQacc, dq_row0,
            stride_qn, stride_don, offs_m, offs_n, offs_d, offs_dv,
            full_lo, full_hi, seqlen_q, seqlen_k, shift, window_left, window_right,
            qk_scale, softcap_log2, scale,
            False, None, HAS_LEFT, HAS_RIGHT, SOFTCAP, DQ_ATOMIC, HEAD_DIM, HEAD_DIM_V, D_PAD,
            DV_PAD, BLOCK_M, DOT_PRECISION, WANT_DK, WANT_DV,
        )  # fmt: skip
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_base, do_base, Lse2 + row0, Delta + row0, dQacc, dq_row0,
            stride_qn, stride_don, offs_m, offs_n, offs_d, offs_dv,
            full_hi, hi, seqlen_q, seqlen_k, shift, window_left, window_right,
            qk_scale, softcap_log2, scale,
            True, TAIL_STAGES, HAS_LEFT, HAS_RIGHT, SOFTCAP, DQ_ATOMIC, HEAD_DIM, HEAD_DIM_V, D_PAD,
            DV_PAD, BLOCK_M, DOT_PRECISION, WANT_DK, WANT_DV,
        )  # fmt: skip

    if WANT_DK:
        dk = dk * scale  # the softmax scale of s = scale * q·k, applied once
        dk_ptrs = dK + off_b.to(tl.int64) * stride_dkb + off_hkv.to(tl.int64) * stride_dkh
        dk_ptrs = dk_ptrs + start_n.to(tl.int64) * stride_dkn
        dk_ptrs = dk_ptrs + offs_nl[:, None] * stride_dkn + offs_d[None, :]  # (BLOCK_N, D_PAD)
        tl.store(dk_ptrs, dk.to(dK.dtype.element_ty), mask=n_ok & d_ok)
    if WANT_DV:
        dv_ptrs = dV + off_b.to(tl.int64) * stride_dvb + off_hkv.to(tl.int64) * stride_dvh
        dv_ptrs = dv_ptrs + start_n.to(tl.int64) * stride_dvn
        dv_ptrs = dv_ptrs + offs_nl[:, None] * stride_dvn + offs_dv[None, :]  # (N, DV_PAD)
        tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=n_ok & dv_ok)


@triton.jit
def _bwd_dq_inner(
    dq,  # (BLOCK_M, D_PAD) fp32
    q,  # (BLOCK_M, D_PAD)
    do,  # (BLOCK_M, DV_PAD)
    lse2,  # (BLOCK_M,) log2 domain, +inf for rows that saw nothing
    delta,  # (BLOCK_M,)
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    offs_m,  # (BLOCK_M,) query rows
    offs_n,  # (BLOCK_N,) 0..BLOCK_N-1
    offs_d,
    offs_dv,
    lo,
    hi,
    seqlen_k,
    shift,
    window_left,
    window_right,
    qk_scale,
    softcap_log2,
    MASKED: tl.constexpr,
    LOOP_STAGES: tl.constexpr,  # None: the kernel's num_stages
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate dQ of one Q block over the key blocks [lo, hi)."""
    # Scalar block pointers advance through the loop; the per-element offsets are loop
    # invariant. (Carrying (BLOCK_N, D) pointer tensors costs 2 registers per element.)
    k_blk = k_base + tl.cast(lo, tl.int64) * stride_kn  # K at key `lo`
    v_blk = v_base + tl.cast(lo, tl.int64) * stride_vn  # V at key `lo`
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]  # (BLOCK_N, D_PAD)
    v_offs = offs_n[:, None] * stride_vn + offs_dv[None, :]  # (BLOCK_N, DV_PAD)
    d_ok = offs_d[None, :] < HEAD_DIM  # (1, D_PAD)
    dv_ok = offs_dv[None, :] < HEAD_DIM_V  # (1, DV_PAD)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
        k_ptrs = k_blk + k_offs  # (BLOCK_N, D_PAD)
        v_ptrs = v_blk + v_offs  # (BLOCK_N, DV_PAD)
        if MASKED:
            n_ok = (start_n + offs_n[:, None]) < seqlen_k  # (BLOCK_N, 1)
            k = tl.load(k_ptrs, mask=n_ok & d_ok, other=0.0)  # (BLOCK_N, D_PAD)
            v = tl.load(v_ptrs, mask=n_ok & dv_ok, other=0.0)  # (BLOCK_N, DV_PAD)
        else:
            if HEAD_DIM != D_PAD:
                k = tl.load(k_ptrs, mask=d_ok, other=0.0)
            else:
                k = tl.load(k_ptrs)
            if HEAD_DIM_V != DV_PAD:
                v = tl.load(v_ptrs, mask=dv_ok, other=0.0)
            else:
                v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        s, t = _scores(qk, qk_scale, softcap_log2, SOFTCAP)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            vis = _visible(
                offs_m[:, None],
                start_n + offs_n[None, :],
                seqlen_k,
                shift,
                window_left,
                window_right,
                HAS_LEFT,
                HAS_RIGHT,
            )  # (BLOCK_M, BLOCK_N)
            s = tl.where(vis, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])  # (BLOCK_M, BLOCK_N)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # (BLOCK_M, D_PAD)
        k_blk += BLOCK_N * stride_kn
        v_blk += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dq(
    Q,  # (B, Nq, Hq, D)
    K,  # (B, Nk, Hkv, D)
    V,  # (B, Nk, Hkv, Dv)
    dO,  # (B, Nq, Hq, Dv)
    Lse2,  # (B, Hq, Nq_pad) fp32, LSE * log2(e), +inf on rows with no contribution
    Delta,  # (B, Hq, Nq_pad) fp32
    dQ,  # (B, Nq, Hq, D)
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_dob,
    stride_don,
    stride_doh,
    stride_dqb,
    stride_dqn,
    stride_dqh,
    seqlen_q,
    seqlen_k,
    seqlen_pad,
    num_heads,
    group,
    shift,
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
    """dQ for one (Q block, head, batch): recomputes S and dP from K, V (deterministic)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (causal) first
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hkv = off_h // group
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_ml = tl.arange(0, BLOCK_M)  # (BLOCK_M,) local rows
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, D_PAD)  # (D_PAD,)
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    m_ok = offs_m < seqlen_q  # (BLOCK_M,)
    d_ok = offs_d[None, :] < HEAD_DIM  # (1, D_PAD)

    q_ptrs = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    q_ptrs = q_ptrs + start_m.to(tl.int64) * stride_qn
    q_ptrs = q_ptrs + offs_ml[:, None] * stride_qn + offs_d[None, :]  # (BLOCK_M, D_PAD)
    do_ptrs = dO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    do_ptrs = do_ptrs + start_m.to(tl.int64) * stride_don
    do_ptrs = do_ptrs + offs_ml[:, None] * stride_don + offs_dv[None, :]  # (BLOCK_M, DV_PAD)
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok, other=0.0)  # (BLOCK_M, D_PAD)
    do = tl.load(do_ptrs, mask=m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    row0 = (off_b.to(tl.int64) * num_heads + off_h) * seqlen_pad
    lse2 = tl.load(Lse2 + row0 + offs_m)  # (BLOCK_M,) log2 domain; +inf -> P = 0
    delta = tl.load(Delta + row0 + offs_m)  # (BLOCK_M,)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh

    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)  # (BLOCK_M, D_PAD)
    lo, full_lo, full_hi, hi = _key_range(
        start_m,
        seqlen_q,
        seqlen_k,
        shift,
        window_left,
        window_right,
        BLOCK_M,
        BLOCK_N,
        HAS_LEFT,
        HAS_RIGHT,
    )
    dq = _bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d,
        offs_dv, lo, full_lo, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2,
        True, 1, HAS_LEFT, HAS_RIGHT, SOFTCAP, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_N,
        DOT_PRECISION,
    )  # fmt: skip
    dq = _bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d,
        offs_dv, full_lo, full_hi, seqlen_k, shift, window_left, window_right, qk_scale,
        softcap_log2, False, None, HAS_LEFT, HAS_RIGHT, SOFTCAP, HEAD_DIM, HEAD_DIM_V, D_PAD,
        DV_PAD, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    dq = _bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d,
        offs_dv, full_hi, hi, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2,
        True, 1, HAS_LEFT, HAS_RIGHT, SOFTCAP, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_N,
        DOT_PRECISION,
    )  # fmt: skip

    dq = dq * scale
    dq_ptrs = dQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
    dq_ptrs = dq_ptrs + start_m.to(tl.int64) * stride_dqn
    dq_ptrs = dq_ptrs + offs_ml[:, None] * stride_dqn + offs_d[None, :]  # (BLOCK_M, D_PAD)
    tl.store(dq_ptrs, dq.to(dQ.dtype.element_ty), mask=m_ok[:, None] & d_ok)
