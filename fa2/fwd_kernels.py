"""The fa2 forward kernel: one program per (Q block, query head, batch).

Each program owns one Q tile for the whole K/V loop, keeps O and the running (m, l) in
registers and rescales by 1/l once at the end; the softmax runs in base 2 with the softmax
scale and log2(e) folded into one multiply. The K/V loop runs as the three stages of
`mask._key_range`; the masked stages (one or two blocks per tile) run unpipelined.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashsuite.fa2.mask import _NO_SPEC, LN2, _key_range, _scores, _visible


@triton.jit
def _fwd_inner(
    acc,  # (BLOCK_M, DV_PAD) fp32
    l_i,  # (BLOCK_M,) fp32
    m_i,  # (BLOCK_M,) fp32, log2 domain
    q,  # (BLOCK_M, D_PAD)
    k_base,  # K at (b, kv head, key 0)
    v_base,  # V at (b, kv head, key 0)
    stride_kn,
    stride_vn,
    offs_m,  # (BLOCK_M,) query rows
    offs_n,  # (BLOCK_N,) 0..BLOCK_N-1
    offs_d,  # (D_PAD,)
    offs_dv,  # (DV_PAD,)
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
    """One stage of the K/V loop over key blocks [lo, hi)."""
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
        elif HEAD_DIM != D_PAD:
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)  # (BLOCK_N, D_PAD)
        else:
            k = tl.load(k_ptrs)  # (BLOCK_N, D_PAD)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        s, _t = _scores(qk, qk_scale, softcap_log2, SOFTCAP)  # (BLOCK_M, BLOCK_N) log2 domain
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
            m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
            # A row that has seen no key yet keeps m = -inf: subtract 0 instead (no inf - inf).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # (BLOCK_M,)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_use)  # (BLOCK_M,)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=n_ok & dv_ok, other=0.0)  # (BLOCK_N, DV_PAD)
        elif HEAD_DIM_V != DV_PAD:
            v = tl.load(v_ptrs, mask=dv_ok, other=0.0)  # (BLOCK_N, DV_PAD)
        else:
            v = tl.load(v_ptrs)  # (BLOCK_N, DV_PAD)
        # P·V in the input dtype (fp16/bf16 tensor cores), fp32 accumulation.
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # (BLOCK_M, DV_PAD)
        m_i = m_new
        k_blk += BLOCK_N * stride_kn
        v_blk += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_NO_SPEC)
def _attn_fwd(
    Q,  # (B, Nq, Hq, D)
    K,  # (B, Nk, Hkv, D)
    V,  # (B, Nk, Hkv, Dv)
    Out,  # (B, Nq, Hq, Dv)
    Lse,  # (B, Hq, Nq) fp32; not touched without STORE_LSE
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    seqlen_q,
    seqlen_k,
    group,  # Hq // Hkv
    shift,  # Nk - Nq: bottom-right alignment
    window_left,
    window_right,
    qk_scale,
    softcap_log2,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM (tl.arange needs one)
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), ignored for 16-bit
    STORE_LSE: tl.constexpr,  # False where the caller discards the LSE (no allocation for it)
):
    # Last Q blocks first: with bottom-right causal they are the longest, so the tail of the
    # grid is filled by short programs.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hkv = off_h // group
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, D_PAD)  # (D_PAD,)
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    m_ok = offs_m < seqlen_q  # (BLOCK_M,)

    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    q_ptrs = q_base + start_m.to(tl.int64) * stride_qn
    q_ptrs = q_ptrs + (offs_m - start_m)[:, None] * stride_qn + offs_d[None, :]  # (M, D_PAD)
    q = tl.load(q_ptrs, mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # (BLOCK_M,) log2 domain
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # (BLOCK_M,)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)  # (BLOCK_M, DV_PAD)

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
    # Stage 1: left window boundary (masked). Stage 2: fully visible (no mask). Stage 3:
    # causal diagonal / right window boundary / key tail (masked).
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
        lo, full_lo, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2,
        True, 1, HAS_LEFT, HAS_RIGHT, SOFTCAP, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_N,
        DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
        full_lo, full_hi, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2,
        False, None, HAS_LEFT, HAS_RIGHT, SOFTCAP, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_N,
        DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv,
        full_hi, hi, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2,
        True, 1, HAS_LEFT, HAS_RIGHT, SOFTCAP, HEAD_DIM, HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_N,
        DOT_PRECISION,
    )  # fmt: skip

    # Epilogue: one 1/l per row; a row that saw no key has l == 0 -> out 0, lse -inf.
    seen = l_i > 0.0  # (BLOCK_M,)
    inv_l = 1.0 / tl.where(seen, l_i, 1.0)  # (BLOCK_M,)
    acc = acc * inv_l[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))

    o_base = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    o_ptrs = o_base + start_m.to(tl.int64) * stride_on
    o_ptrs = o_ptrs + (offs_m - start_m)[:, None] * stride_on + offs_dv[None, :]  # (M, DV_PAD)
    o_mask = m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=o_mask)
    if STORE_LSE:
        l_ptrs = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m
        tl.store(l_ptrs, lse, mask=m_ok)  # (BLOCK_M,)
