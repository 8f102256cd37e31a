"""FlashAttention-1 in Triton: the original loop order (Dao et al. 2022, arXiv 2205.14135).

Forward, Algorithm 1: one program per (batch, query head). The outer loop runs over K/V blocks
j (K_j, V_j are loaded once); the inner loop runs over Q blocks i and round-trips the running
output O_i and the row statistics m_i, l_i through HBM at every step. O_i stays normalised
(Alg. 1 line 12 divides by l_new at every step), unlike FA2 which defers the 1/l rescale.

Backward, Algorithm 4 (appendix B) with recompute: one program per (batch, K/V head). The outer
loop runs over K/V blocks j with dK_j, dV_j accumulated on chip; the inner loops run over the
query heads of the GQA group and the Q blocks i, recompute P_ij from Q_i, K_j and the stored
LSE, and read-modify-write dQ_i in HBM. One program owns every dQ row it touches, so there are
no atomics and the result is deterministic.

Deviations from the paper, all traffic-neutral or cheaper:
- scores are kept in the log2 domain (scale * log2(e) folded into one multiply, exp2 on chip);
  the HBM statistic m is stored in that domain, LSE is written back in natural log;
- Alg. 1 line 2 (initialise O = 0, l = 0, m = -inf in HBM) is folded into the first K/V step:
  every Q block that is visited at all is visited first by j = 0, which uses those initial
  values without reading them; blocks never visited (causal, Nq > Nk) are written as out 0,
  LSE -inf up front;
- Alg. 1 line 16 (return O) is fused into the last K/V step that visits Q block i: that step
  writes out (input dtype) and LSE instead of the fp32 scratch O_i, m_i, l_i (on the TMA path
  the j = 0 step still loads the unwritten O_i tile and discards it: a TMA load has no mask);
- lines 10-12 in fewer passes: P = exp(S - m_new) directly (the paper's P~ e^{m~ - m_new}), and
  the rescaled O_i is the accumulator of the P V product (no second O-sized tile);
- SPLIT_KV (sm90): a K/V block of B_c rows is processed as two halves, each with its own max
  and an on-chip rescale of what the first added (lines 9-12 applied twice inside one step):
  the HBM round trip of O_i, m_i, l_i happens once per B_c keys, S and P are B_c / 2 wide;
- the backward recomputes P from the stored LSE (one statistic) instead of (m, l), and reads
  D_i = rowsum(dO_i * O_i) from a preprocess kernel instead of recomputing it per step.

Causal masking is bottom-right aligned (query r sees key c iff c <= r + Nk - Nq). For K/V block
j, Q blocks that see none of it are skipped, the few near the diagonal run a masked step, the
rest an unmasked one. A K/V tail block (Nk % BLOCK_N != 0) always runs masked.

Kernels use plain pointers so they run on any CUDA arch Triton supports (sm75+) and under
TRITON_INTERPRET=1. Offsets of the (batch, head) bases and of each block's first row are
64-bit; offsets inside a block stay 32-bit. On sm90 the forward takes TMA descriptors instead
(USE_DESC; the interpreter runs that path too): Q_i and O_i then arrive through shared memory,
prefetched by the software pipeliner, and the step runs 64-row wgmma tiles. The running O_i is
stored by TMA (and m_i, l_i with plain stores) and re-read by TMA one K/V block later, so each
K/V block ends with a bulk-store wait, a proxy fence and a CTA barrier. Which steps mask and
which write the final result is decided by loop bounds (four compile-time variants of the
step), not by a branch inside the loop: Triton 3.6's pipeliner fails on a loop whose body
holds an if around the stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log(x) = log2(x) * LN2


@triton.jit
def _causal_q_range(
    j,
    n_q,
    n_k,
    shift,
    num_q_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Q blocks [lo, mid) need a mask for K/V block j, [mid, hi) do not; others are skipped."""
    if CAUSAL:
        # First row that sees key j*BLOCK_N is row j*BLOCK_N - shift (query r sees key c iff
        # c <= r + shift); every block before the one holding it sees none of block j.
        lo = tl.minimum(tl.maximum(j * BLOCK_N - shift, 0) // BLOCK_M, num_q_blocks)
        # From the first block whose first row sees the block's last key on, no causal mask.
        last_key = j * BLOCK_N + BLOCK_N - 1
        mid = tl.cdiv(tl.maximum(last_key - shift, 0), BLOCK_M)
        mid = tl.minimum(tl.maximum(mid, lo), num_q_blocks)
    else:
        lo = j * 0
        mid = j * 0
    if (j + 1) * BLOCK_N > n_k:  # K/V tail: every step masks the keys past Nk
        mid = num_q_blocks
    return lo, mid


@triton.jit
def _last_kv_block(
    i, n_q, shift, num_kv_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr
):
    """The last K/V block that Q block i visits (its last row's last visible key)."""
    if CAUSAL:
        last_row = tl.minimum((i + 1) * BLOCK_M, n_q) - 1
        return tl.minimum((last_row + shift) // BLOCK_N, num_kv_blocks - 1)
    else:
        return num_kv_blocks - 1


@triton.jit
def _final_q_end(
    j, n_q, shift, num_kv_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr
):
    """Among the Q blocks that see K/V block j, those before the returned index see no later
    block (j is their `_last_kv_block`): all of them at the last block, else (causal) the
    blocks whose last row stops short of key (j + 1) * BLOCK_N."""
    if CAUSAL:
        # Q block i sees block j + 1 iff its last row (i + 1) * BLOCK_M - 1 sees key
        # (j + 1) * BLOCK_N, i.e. (i + 1) * BLOCK_M >= (j + 1) * BLOCK_N - shift + 1.
        first_later = tl.cdiv(tl.maximum((j + 1) * BLOCK_N - shift + 1, 0), BLOCK_M) - 1
        fin = tl.maximum(first_later, 0)
    else:
        fin = j * 0
    if j == num_kv_blocks - 1:
        fin = tl.cdiv(n_q, BLOCK_M)
    return fin


@triton.jit
def _scores(
    q, kt, col0, row0, n_k, shift, qk_scale, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """S = Q_i K^T * scale (log2 domain) for keys col0 .. col0 + WIDTH, masked if MASKED."""
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, WIDTH)
    if MASKED:
        cols = col0 + tl.arange(0, WIDTH)  # (WIDTH,)
        visible = (cols < n_k)[None, :]  # (1, WIDTH)
        if CAUSAL:
            rows = row0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
            visible = visible & (cols[None, :] <= rows[:, None] + shift)
        s = tl.where(visible, s, -float("inf"))  # (BLOCK_M, WIDTH)
    return s


@triton.jit
def _online_softmax(m_i, l_i, s):
    """Fold scores s (BLOCK_M, W; log2 domain) into the running row max m_i and sum l_i.

    Returns m_new = max(m_i, rowmax(s)), alpha = e^{m_i - m_new} (what rescales earlier
    output), P = exp(s - m_new) and l_new = alpha l_i + rowsum(P). A row that has seen no key
    keeps m_new = -inf: exponentiate against 0 so P = 0 and alpha = 0, never NaN.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
    m_new_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # (BLOCK_M,)
    alpha = tl.exp2(m_i - m_new_safe)  # (BLOCK_M,): 0 when m_i = -inf
    p = tl.exp2(s - m_new_safe[:, None])  # (BLOCK_M, W)
    l_new = alpha * l_i + tl.sum(p, 1)  # (BLOCK_M,)
    return m_new, alpha, p, l_new


@triton.jit
def _tma_writes_done():
    """Make this thread's global writes visible to TMA loads that any thread of the CTA issues
    after the next CTA barrier: wait until its bulk (TMA) stores have completed, not only read
    their shared memory (Triton waits for that much after each store), then fence the generic
    proxy (plain st.global) against the async proxy."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;",
        "=r",
        [],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _fwd_step(
    q_base,  # Q at (b, h, row 0)
    out_base,  # Out at (b, h, row 0)
    lse_base,  # (Nq,) LSE of (b, h)
    acc_base,  # (Nq, HEAD_DIM_V) fp32 scratch O of (b, h)
    m_base,  # (Nq,) fp32 scratch m of (b, h), log2 domain
    l_base,  # (Nq,) fp32 scratch l of (b, h)
    q_desc,  # USE_DESC: TMA descriptor of Q as (B, Hq, Nq, D), block (1, 1, BLOCK_M, BLOCK_D)
    acc_desc,  # USE_DESC: of the O scratch (B * Hq, Nq, Dv) fp32, block (1, BLOCK_M, BLOCK_DV)
    out_desc,  # USE_DESC: of Out as (B, Hq, Nq, Dv), block (1, 1, BLOCK_M, BLOCK_DV)
    b,
    h,
    bh,  # b * Hq + h: the (batch, head) row of the scratch
    kt,  # (BLOCK_D, BLOCK_NS) K_j^T on chip (with SPLIT_KV its first half)
    v,  # (BLOCK_NS, BLOCK_DV) V_j on chip (with SPLIT_KV its first half)
    kt2,  # SPLIT_KV: the second halves of K_j^T and V_j (else unused)
    v2,
    i,
    j,
    n_q,
    n_k,
    shift,
    stride_qn,
    stride_on,
    qk_scale,  # softmax scale * log2(e)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NS: tl.constexpr,  # columns per S tile: BLOCK_N, or BLOCK_N / 2 with SPLIT_KV
    SPLIT_KV: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    FINAL: tl.constexpr,  # j is the last K/V block Q block i visits
    DOT_PRECISION: tl.constexpr,
    USE_DESC: tl.constexpr,
):
    """One (j, i) step of Alg. 1, lines 8-13, for Q block i against K/V block j."""
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)
    row0 = i * BLOCK_M
    row_ok = row0 + offs_m < n_q  # (BLOCK_M,)
    d_ok = offs_d < HEAD_DIM  # (BLOCK_D,)
    dv_ok = offs_dv < HEAD_DIM_V  # (BLOCK_DV,)
    o_mask = row_ok[:, None] & dv_ok[None, :]  # (BLOCK_M, BLOCK_DV)
    acc_ptrs = acc_base + tl.cast(row0, tl.int64) * HEAD_DIM_V
    acc_ptrs = acc_ptrs + offs_m[:, None] * HEAD_DIM_V + offs_dv[None, :]  # (BLOCK_M, BLOCK_DV)

    # Alg. 1 line 8: load Q_i, O_i, l_i, m_i from HBM (O, l, m only after the first K/V step,
    # where they are the line-2 initial values 0, 0, -inf).
    seen_before = j > 0
    if USE_DESC:
        # TMA (sm90): the software pipeliner issues step i + 1's loads while step i computes,
        # into shared memory (no registers held); rows past Nq and columns past D are zeros.
        q = q_desc.load([b, h, row0, 0]).reshape(BLOCK_M, BLOCK_D)  # (BLOCK_M, BLOCK_D)
    else:
        q_ptrs = q_base + tl.cast(row0, tl.int64) * stride_qn
        q_ptrs = q_ptrs + offs_m[:, None] * stride_qn + offs_d[None, :]  # (BLOCK_M, BLOCK_D)
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # At j = 0 the masks are all false: the loads return the initial values without touching
    # memory. Masks rather than an `if` keep the loads at the loop's top level, where Triton's
    # software pipeliner can prefetch step i + 1 (num_stages > 1).
    m_i = tl.load(
        m_base + row0 + offs_m,
        mask=row_ok & seen_before,
        other=-float("inf"),
        cache_modifier=".cg",
    )  # (BLOCK_M,)
    l_i = tl.load(
        l_base + row0 + offs_m, mask=row_ok & seen_before, other=0.0, cache_modifier=".cg"
    )  # (BLOCK_M,)

    # Alg. 1 line 9: S_ij = Q_i K_j^T (scaled, log2 domain); with SPLIT_KV, of the first half.
    s = _scores(
        q, kt, j * BLOCK_N, row0, n_k, shift, qk_scale, BLOCK_M, BLOCK_NS, CAUSAL, MASKED,
        DOT_PRECISION,
    )  # fmt: skip

    # Alg. 1 lines 10-11: m~ = rowmax(S), m_new = max(m_i, m~), P~ = exp(S - m~), l~ = rowsum(P~),
    # l_new = e^{m_i - m_new} l_i + e^{m~ - m_new} l~. The factor e^{m~ - m_new} is folded into
    # the exponent (P = P~ e^{m~ - m_new} = exp(S - m_new), one exp per score), so l_new =
    # alpha l_i + rowsum(P) (_online_softmax).
    m_new, alpha, p, l_new = _online_softmax(m_i, l_i, s)

    # Alg. 1 line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + P V_j), with O_i as
    # the accumulator of the P V product (no second (BLOCK_M, BLOCK_DV) fp32 tile is live). O_i
    # is read here, after the softmax, so that it is not live next to S (with TMA it waits in
    # shared memory until now, then lands straight in the MMA accumulator layout).
    if USE_DESC:
        o_i = acc_desc.load([bh, row0, 0]).reshape(BLOCK_M, BLOCK_DV)  # (BLOCK_M, BLOCK_DV)
        o_i = tl.where(seen_before, o_i, 0.0)  # j = 0: the scratch is not written yet
    else:
        o_i = tl.load(
            acc_ptrs, mask=o_mask & seen_before, other=0.0, cache_modifier=".cg"
        )  # (BLOCK_M, BLOCK_DV)
    if SPLIT_KV:
        # B_c = 2 x BLOCK_NS: the block's second half goes through the same update on chip
        # (its own max, a rescale of what the first half added), so O_i makes one HBM round
        # trip per BLOCK_N keys while S, P stay BLOCK_NS wide. Unnormalised until the end.
        o_new = o_i * (l_i * alpha)[:, None]  # (BLOCK_M, BLOCK_DV)
        o_new = tl.dot(p.to(v.dtype), v, acc=o_new, input_precision=DOT_PRECISION)
        s = _scores(
            q, kt2, j * BLOCK_N + BLOCK_NS, row0, n_k, shift, qk_scale, BLOCK_M, BLOCK_NS,
            CAUSAL, MASKED, DOT_PRECISION,
        )  # fmt: skip
        m_new, beta, p, l_new = _online_softmax(m_new, l_new, s)
        o_new = o_new * beta[:, None]
        o_new = tl.dot(p.to(v2.dtype), v2, acc=o_new, input_precision=DOT_PRECISION)
    seen = l_new > 0.0  # (BLOCK_M,): False for rows that have seen no key yet (they stay 0)
    l_safe = tl.where(seen, l_new, 1.0)  # (BLOCK_M,)
    inv_l = tl.where(seen, 1.0 / l_safe, 0.0)  # (BLOCK_M,)
    if SPLIT_KV:
        o_new = o_new * inv_l[:, None]
    else:
        # The 1/l_new goes onto P (rows of P / l_new lie in [0, 1]) and onto O_i.
        p = p * inv_l[:, None]  # (BLOCK_M, BLOCK_NS)
        o_new = o_i * (l_i * alpha * inv_l)[:, None]  # (BLOCK_M, BLOCK_DV)
        o_new = tl.dot(p.to(v.dtype), v, acc=o_new, input_precision=DOT_PRECISION)

    # Alg. 1 lines 12-13: write O_i, l_i, m_i back to HBM; at the last K/V block this Q block
    # visits (FINAL, sorted out by the caller's loop bounds: no branch inside the pipelined
    # loop), write the result instead (line 16): out in the input dtype, LSE = m + log l.
    if FINAL:
        if USE_DESC:
            o_out = o_new.to(out_desc.dtype).reshape(1, 1, BLOCK_M, BLOCK_DV)
            out_desc.store([b, h, row0, 0], o_out)  # clipped at Nq and Dv
        else:
            out_ptrs = out_base + tl.cast(row0, tl.int64) * stride_on
            out_ptrs = out_ptrs + offs_m[:, None] * stride_on + offs_dv[None, :]
            tl.store(out_ptrs, o_new.to(out_base.dtype.element_ty), mask=o_mask)
        lse = tl.where(seen, (m_new + tl.log2(l_safe)) * LN2, -float("inf"))  # (BLOCK_M,)
        tl.store(lse_base + row0 + offs_m, lse, mask=row_ok)
    else:
        if USE_DESC:
            # A TMA store straight from the accumulator layout (no layout conversion, no
            # address registers). The TMA load of O_i at step j + 1 is ordered after it by the
            # kernel's bulk wait, proxy fence and barrier at the end of each K/V block.
            acc_desc.store([bh, row0, 0], o_new.reshape(1, BLOCK_M, BLOCK_DV))
        else:
            tl.store(acc_ptrs, o_new, mask=o_mask)
        tl.store(m_base + row0 + offs_m, m_new, mask=row_ok)
        tl.store(l_base + row0 + offs_m, l_new, mask=row_ok)


@triton.jit
def fa1_fwd_kernel(
    Q,  # (B, Nq, Hq, D), last dim contiguous
    K,  # (B, Nk, Hkv, D), last dim contiguous
    V,  # (B, Nk, Hkv, Dv), last dim contiguous
    Out,  # (B, Nq, Hq, Dv), last dim contiguous, input dtype
    Lse,  # (B, Hq, Nq) fp32 contiguous
    OAcc,  # (B, Hq, Nq, HEAD_DIM_V) fp32 contiguous scratch: the running O of Alg. 1
    M,  # (B, Hq, Nq) fp32 contiguous scratch: running row max (log2 domain)
    L,  # (B, Hq, Nq) fp32 contiguous scratch: running row sum
    q_desc,  # USE_DESC only (else None): TMA descriptors of Q, K, V, OAcc, Out (_fwd_step)
    k_desc,  # K as (B, Hkv, Nk, D), block (1, 1, BLOCK_N, BLOCK_D)
    v_desc,  # V as (B, Hkv, Nk, Dv), block (1, 1, BLOCK_N, BLOCK_DV)
    acc_desc,
    out_desc,
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
    n_q,
    n_k,
    heads_q,
    group,  # Hq // Hkv: query head h reads K/V head h // group
    qk_scale,  # softmax scale * log2(e)
    q_blocks_per_split,  # Q blocks owned by each program along grid axis 1
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two (masked)
    BLOCK_DV: tl.constexpr,  # HEAD_DIM_V padded to a power of two (masked)
    BLOCK_M: tl.constexpr,  # B_r: Q rows per inner step
    BLOCK_N: tl.constexpr,  # B_c: K/V rows per outer step
    BLOCK_NS: tl.constexpr,  # K/V rows per S tile: BLOCK_N, or BLOCK_N / 2 with SPLIT_KV
    SPLIT_KV: tl.constexpr,  # USE_DESC only: K_j, V_j as two halves, one O_i round trip
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else the default
    USE_DESC: tl.constexpr,  # sm90: Q, K, V, O_i loads and the Out store through TMA
    PROXY_FENCE: tl.constexpr,  # USE_DESC on a GPU (the interpreter has no proxies)
):
    """Alg. 1: grid (B * Hq, splits): one program per (batch, query head) and Q-block range.

    With one split (the paper's grid) a program owns every Q block of its head. More splits
    give each program a contiguous range of Q blocks, loop order unchanged: K/V is then read
    once per split instead of once per head, which buys parallelism when B * Hq < #SMs.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // heads_q
    h = pid % heads_q
    hk = h // group
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    k_base = K + b64 * stride_kb + hk64 * stride_kh
    v_base = V + b64 * stride_vb + hk64 * stride_vh
    out_base = Out + b64 * stride_ob + h64 * stride_oh
    lse_base = Lse + pid.to(tl.int64) * n_q  # (Nq,)
    acc_base = OAcc + pid.to(tl.int64) * n_q * HEAD_DIM_V  # (Nq, HEAD_DIM_V)
    m_base = M + pid.to(tl.int64) * n_q  # (Nq,)
    l_base = L + pid.to(tl.int64) * n_q  # (Nq,)
    shift = n_k - n_q
    num_q_blocks = tl.cdiv(n_q, BLOCK_M)
    num_kv_blocks = tl.cdiv(n_k, BLOCK_N)
    q_begin = split * q_blocks_per_split
    q_end = tl.minimum(q_begin + q_blocks_per_split, num_q_blocks)
    # K/V blocks past the last one this range of Q blocks sees (causal) are not even loaded.
    last_kv = _last_kv_block(q_end - 1, n_q, shift, num_kv_blocks, BLOCK_M, BLOCK_N, CAUSAL)
    kv_end = tl.where(q_end > q_begin, last_kv + 1, 0)

    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)

    # Q blocks that see no key at all (causal with Nq > Nk) are never visited: out 0, LSE -inf.
    if CAUSAL:
        num_dead = tl.minimum(tl.maximum(-shift, 0) // BLOCK_M, num_q_blocks)
        for i in range(q_begin, tl.minimum(num_dead, q_end)):
            rows = i * BLOCK_M + offs_m  # (BLOCK_M,)
            out_ptrs = out_base + rows[:, None].to(tl.int64) * stride_on + offs_dv[None, :]
            zeros = tl.zeros([BLOCK_M, BLOCK_DV], dtype=Out.dtype.element_ty)
            tl.store(out_ptrs, zeros, mask=(rows < n_q)[:, None] & (offs_dv < HEAD_DIM_V)[None, :])
            tl.store(
                lse_base + rows, tl.full([BLOCK_M], -float("inf"), tl.float32), mask=rows < n_q
            )

    # Alg. 1 line 5: outer loop over K/V blocks j.
    for j in range(0, kv_end):
        # Alg. 1 line 6: load K_j (transposed, for S = Q K^T) and V_j from HBM, once.
        if USE_DESC:  # rows past Nk and columns past D are zero-filled
            kt = tl.trans(k_desc.load([b, hk, j * BLOCK_N, 0]).reshape(BLOCK_NS, BLOCK_D))
            v = v_desc.load([b, hk, j * BLOCK_N, 0]).reshape(BLOCK_NS, BLOCK_DV)
            if SPLIT_KV:
                half = j * BLOCK_N + BLOCK_NS
                kt2 = tl.trans(k_desc.load([b, hk, half, 0]).reshape(BLOCK_NS, BLOCK_D))
                v2 = v_desc.load([b, hk, half, 0]).reshape(BLOCK_NS, BLOCK_DV)
            else:
                kt2 = kt
                v2 = v
        else:
            col_ok = j * BLOCK_N + offs_n < n_k  # (BLOCK_N,)
            kv_row0 = tl.cast(j * BLOCK_N, tl.int64)
            kt_ptrs = k_base + kv_row0 * stride_kn + offs_n[None, :] * stride_kn
            kt_ptrs = kt_ptrs + offs_d[:, None]
            kt = tl.load(kt_ptrs, mask=col_ok[None, :] & (offs_d < HEAD_DIM)[:, None], other=0.0)
            v_ptrs = v_base + kv_row0 * stride_vn + offs_n[:, None] * stride_vn
            v_ptrs = v_ptrs + offs_dv[None, :]
            v = tl.load(v_ptrs, mask=col_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
            kt2 = kt
            v2 = v
        # kt: (BLOCK_D, BLOCK_NS), v: (BLOCK_NS, BLOCK_DV)

        # Alg. 1 line 7: inner loop over Q blocks i, skipping those that see none of block j.
        # Four ranges with the mask and the final write decided at compile time: [lo, mid)
        # needs the mask, [mid, q_end) does not; [lo, fin) is the prefix of Q blocks for which
        # j is the last K/V block they see (_last_kv_block is nondecreasing in i).
        lo, mid = _causal_q_range(j, n_q, n_k, shift, num_q_blocks, BLOCK_M, BLOCK_N, CAUSAL)
        lo = tl.maximum(lo, q_begin)
        mid = tl.minimum(tl.maximum(mid, lo), q_end)
        fin = _final_q_end(j, n_q, shift, num_kv_blocks, BLOCK_M, BLOCK_N, CAUSAL)
        fin_m = tl.minimum(tl.maximum(fin, lo), mid)
        fin_u = tl.minimum(tl.maximum(fin, mid), q_end)
        # The ranges [bounds[r], bounds[r + 1]) for r = 0..3, unrolled at compile time: masked
        # for r < 2, final for even r.
        bounds = (lo, fin_m, mid, fin_u, q_end)
        for r in tl.static_range(4):
            for i in range(bounds[r], bounds[r + 1]):
                _fwd_step(
                    q_base, out_base, lse_base, acc_base, m_base, l_base,
                    q_desc, acc_desc, out_desc, b, h, pid, kt, v, kt2, v2,
                    i, j, n_q, n_k, shift, stride_qn, stride_on, qk_scale,
                    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, BLOCK_NS, SPLIT_KV,
                    CAUSAL, r < 2, r % 2 == 0, DOT_PRECISION, USE_DESC,
                )  # fmt: skip
        # O_i, m_i, l_i written by one thread are read by another at step j + 1: make the
        # CTA's global writes visible before the next K/V block (one barrier per block j);
        # with TMA the writer and reader of O_i are the async proxy: complete and fence first.
        if PROXY_FENCE:
            _tma_writes_done()
        tl.debug_barrier()


@triton.jit
def fa1_bwd_preprocess_kernel(
    Out,  # (B, Nq, Hq, Dv), last dim contiguous
    DOut,  # (B, Nq, Hq, Dv), last dim contiguous
    Delta,  # (B, Hq, Nq) fp32 contiguous: D_i = rowsum(dO_i * O_i)
    stride_ob,
    stride_on,
    stride_oh,
    stride_db,
    stride_dn,
    stride_dh,
    n_q,
    heads_q,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Alg. 4 line 19 hoisted out of the loops: grid (cdiv(Nq, BLOCK_M), B * Hq)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads_q).to(tl.int64)
    h = (pid_bh % heads_q).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)
    mask = (rows < n_q)[:, None] & (offs_dv < HEAD_DIM_V)[None, :]  # (BLOCK_M, BLOCK_DV)
    rows64 = rows[:, None].to(tl.int64)
    o = tl.load(
        Out + b * stride_ob + h * stride_oh + rows64 * stride_on + offs_dv[None, :], mask=mask
    )
    do = tl.load(
        DOut + b * stride_db + h * stride_dh + rows64 * stride_dn + offs_dv[None, :], mask=mask
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(Delta + pid_bh.to(tl.int64) * n_q + rows, delta, mask=rows < n_q)


@triton.jit
def _bwd_step(
    q_base,  # Q at (b, h, row 0)
    do_base,  # dO at (b, h, row 0)
    dq_base,  # dQ at (b, h, row 0), input dtype: written at the last K/V step
    dqacc_base,  # (Nq, HEAD_DIM) fp32 scratch dQ of (b, h)
    lse_base,  # (Nq,) LSE of (b, h), natural log
    delta_base,  # (Nq,) D of (b, h)
    k,  # (BLOCK_N, BLOCK_D) K_j on chip
    v,  # (BLOCK_N, BLOCK_DV) V_j on chip
    dk,  # (BLOCK_N, BLOCK_D) fp32 dK_j accumulator
    dv,  # (BLOCK_N, BLOCK_DV) fp32 dV_j accumulator
    i,
    j,
    n_q,
    n_k,
    shift,
    num_kv_blocks,
    stride_qn,
    stride_don,
    stride_dqn,
    sm_scale,
    qk_scale,  # sm_scale * log2(e)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (j, i) step of Alg. 4, lines 8-22, for Q block i against K/V block j."""
    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)
    row0 = i * BLOCK_M
    row0_64 = tl.cast(row0, tl.int64)
    row_ok = row0 + offs_m < n_q  # (BLOCK_M,)
    q_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]  # (BLOCK_M, BLOCK_D)

    # Alg. 4 line 8: load Q_i, dO_i and the row statistics (LSE_i, D_i) from HBM.
    q_ptrs = q_base + row0_64 * stride_qn + offs_m[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    do_ptrs = do_base + row0_64 * stride_don + offs_m[:, None] * stride_don + offs_dv[None, :]
    do_mask = row_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]  # (BLOCK_M, BLOCK_DV)
    do = tl.load(do_ptrs, mask=do_mask, other=0.0)  # (BLOCK_M, BLOCK_DV)
    lse = tl.load(lse_base + row0 + offs_m, mask=row_ok, other=0.0)  # (BLOCK_M,)
    delta = tl.load(delta_base + row0 + offs_m, mask=row_ok, other=0.0)  # (BLOCK_M,)
    # A row that sees no key has LSE -inf and every score masked: subtract 0 so P = 0, not NaN.
    lse2 = tl.where(lse == -float("inf"), 0.0, lse * LOG2E)  # (BLOCK_M,)

    # Alg. 4 lines 9-13: recompute S_ij = scale Q_i K_j^T and P_ij = exp(S_ij - LSE_i).
    s = _scores(
        q, tl.trans(k), j * BLOCK_N, row0, n_k, shift, qk_scale, BLOCK_M, BLOCK_N, CAUSAL,
        MASKED, DOT_PRECISION,
    )  # (BLOCK_M, BLOCK_N)  # fmt: skip
    p = tl.exp2(s - lse2[:, None])  # (BLOCK_M, BLOCK_N)

    # Alg. 4 line 16: dV_j += P_ij^T dO_i.
    dv += tl.dot(tl.trans(p.to(v.dtype)), do, input_precision=DOT_PRECISION)
    # Alg. 4 lines 17-20: dP_ij = dO_i V_j^T, dS_ij = P_ij * (dP_ij - D_i).
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    ds = (p * (dp - delta[:, None])).to(k.dtype)  # (BLOCK_M, BLOCK_N)
    # Alg. 4 line 22: dK_j += scale dS_ij^T Q_i (the scale is applied once, at the store).
    dk += tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION)

    # Alg. 4 line 21: dQ_i += scale dS_ij K_j, read-modify-written in HBM. At j = 0 the fp32
    # scratch holds nothing yet (every visited block is visited first by j = 0); at the last
    # K/V block this Q block visits, write dQ_i itself in the input dtype.
    dq = tl.dot(ds, k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_D)
    acc_ptrs = dqacc_base + row0_64 * HEAD_DIM
    acc_ptrs = acc_ptrs + offs_m[:, None] * HEAD_DIM + offs_d[None, :]  # (BLOCK_M, BLOCK_D)
    if j > 0:
        dq += tl.load(acc_ptrs, mask=q_mask, other=0.0, cache_modifier=".cg")
    if j == _last_kv_block(i, n_q, shift, num_kv_blocks, BLOCK_M, BLOCK_N, CAUSAL):
        dq_ptrs = dq_base + row0_64 * stride_dqn + offs_m[:, None] * stride_dqn + offs_d[None, :]
        tl.store(dq_ptrs, (dq * sm_scale).to(dq_base.dtype.element_ty), mask=q_mask)
    else:
        tl.store(acc_ptrs, dq, mask=q_mask)
    return dk, dv


@triton.jit
def fa1_bwd_kernel(
    Q,  # (B, Nq, Hq, D), last dim contiguous
    K,  # (B, Nk, Hkv, D), last dim contiguous
    V,  # (B, Nk, Hkv, Dv), last dim contiguous
    DOut,  # (B, Nq, Hq, Dv), last dim contiguous
    Lse,  # (B, Hq, Nq) fp32 contiguous, natural log
    Delta,  # (B, Hq, Nq) fp32 contiguous: rowsum(dO * O)
    DQ,  # (B, Nq, Hq, D) contiguous, input dtype
    DK,  # (B, Nk, Hkv, D) contiguous, input dtype
    DV,  # (B, Nk, Hkv, Dv) contiguous, input dtype
    DQAcc,  # (B, Hq, Nq, HEAD_DIM) fp32 contiguous scratch: the running dQ of Alg. 4
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
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    n_q,
    n_k,
    heads_kv,
    group,  # Hq // Hkv query heads share each K/V head
    sm_scale,
    qk_scale,  # sm_scale * log2(e)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Alg. 4: grid (B * Hkv,), one program per (batch, K/V head) and its GQA group."""
    pid = tl.program_id(0)
    b64 = (pid // heads_kv).to(tl.int64)
    hk = pid % heads_kv
    hk64 = hk.to(tl.int64)
    heads_q = heads_kv * group
    k_base = K + b64 * stride_kb + hk64 * stride_kh
    v_base = V + b64 * stride_vb + hk64 * stride_vh
    dk_base = DK + b64 * stride_dkb + hk64 * stride_dkh
    dv_base = DV + b64 * stride_dvb + hk64 * stride_dvh
    shift = n_k - n_q
    num_q_blocks = tl.cdiv(n_q, BLOCK_M)
    num_kv_blocks = tl.cdiv(n_k, BLOCK_N)

    offs_m = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)
    d_ok = offs_d < HEAD_DIM  # (BLOCK_D,)
    dv_ok = offs_dv < HEAD_DIM_V  # (BLOCK_DV,)

    # dQ rows that see no key (causal, Nq > Nk) are never visited: write zeros up front.
    if CAUSAL:
        num_dead = tl.minimum(tl.maximum(-shift, 0) // BLOCK_M, num_q_blocks)
        for g in range(0, group):
            h64 = (hk * group + g).to(tl.int64)
            for i in range(0, num_dead):
                rows = i * BLOCK_M + offs_m  # (BLOCK_M,)
                dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh
                dq_ptrs = dq_ptrs + rows[:, None].to(tl.int64) * stride_dqn + offs_d[None, :]
                zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=DQ.dtype.element_ty)
                tl.store(dq_ptrs, zeros, mask=(rows < n_q)[:, None] & d_ok[None, :])

    # Alg. 4 line 6: outer loop over K/V blocks j.
    for j in range(0, num_kv_blocks):
        # Alg. 4 lines 7-8: load K_j, V_j once; dK_j, dV_j live on chip.
        cols = j * BLOCK_N + offs_n  # (BLOCK_N,)
        col_ok = cols < n_k  # (BLOCK_N,)
        kv_row0 = tl.cast(j * BLOCK_N, tl.int64)
        k_ptrs = k_base + kv_row0 * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :]
        k = tl.load(k_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        v_ptrs = v_base + kv_row0 * stride_vn + offs_n[:, None] * stride_vn + offs_dv[None, :]
        v = tl.load(v_ptrs, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_DV)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)  # (BLOCK_N, BLOCK_D)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)  # (BLOCK_N, BLOCK_DV)

        # Alg. 4 line 10: inner loop over Q blocks i (of every query head of the GQA group,
        # whose dK, dV contributions sum here on chip), skipping blocks that see none of j.
        lo, mid = _causal_q_range(j, n_q, n_k, shift, num_q_blocks, BLOCK_M, BLOCK_N, CAUSAL)
        for g in range(0, group):
            pid_bh = b64 * heads_q + hk64 * group + g
            h64 = hk64 * group + g
            q_base = Q + b64 * stride_qb + h64 * stride_qh
            do_base = DOut + b64 * stride_dob + h64 * stride_doh
            dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh
            dqacc_base = DQAcc + pid_bh * n_q * HEAD_DIM  # (Nq, HEAD_DIM)
            lse_base = Lse + pid_bh * n_q  # (Nq,)
            delta_base = Delta + pid_bh * n_q  # (Nq,)
            for i in range(lo, mid):
                dk, dv = _bwd_step(
                    q_base, do_base, dq_base, dqacc_base, lse_base, delta_base, k, v, dk, dv,
                    i, j, n_q, n_k, shift, num_kv_blocks, stride_qn, stride_don, stride_dqn,
                    sm_scale, qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    BLOCK_N, CAUSAL, True, DOT_PRECISION,
                )  # fmt: skip
            for i in range(mid, num_q_blocks):
                dk, dv = _bwd_step(
                    q_base, do_base, dq_base, dqacc_base, lse_base, delta_base, k, v, dk, dv,
                    i, j, n_q, n_k, shift, num_kv_blocks, stride_qn, stride_don, stride_dqn,
                    sm_scale, qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    BLOCK_N, CAUSAL, False, DOT_PRECISION,
                )  # fmt: skip

        # Alg. 4 line 24: write dK_j, dV_j to HBM.
        dk_ptrs = dk_base + kv_row0 * stride_dkn + offs_n[:, None] * stride_dkn + offs_d[None, :]
        dk_out = (dk * sm_scale).to(DK.dtype.element_ty)
        tl.store(dk_ptrs, dk_out, mask=col_ok[:, None] & d_ok[None, :])
        dv_ptrs = dv_base + kv_row0 * stride_dvn + offs_n[:, None] * stride_dvn + offs_dv[None, :]
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & dv_ok[None, :])
        # dQ_i written by one thread is read by another at step j + 1 (see the forward).
        tl.debug_barrier()
