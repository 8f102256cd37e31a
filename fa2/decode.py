"""Split-KV attention against a KV cache (Flash-Decoding) in Triton, contiguous or paged.

Layout: q (B, Nq, Hq, D); cache (B_cache, N_max, Hkv, D) or pages (num_pages, page_size, Hkv, D)
with block_table (B, max_pages) int32; cache_seqlens (B,) int32. The cache is q's dtype, or
float8_e4m3fn with float32 (B, Hkv) descales (converted as loaded: `KV_FP8`). Row b attends
its first seqlen_b = cache_seqlens[b] + n_new keys, bottom-right aligned (query t sits at key
t + seqlen_b - Nq).

Schedule (docs/inference.md):
- GQA packing: one program owns the G = Hq / Hkv query heads that share a K/V head, for all
  Nq query tokens: row r of its tile is token r // G, head hkv * G + r % G. Each K/V tile is
  read once per K/V head instead of once per query head.
- Split-KV: grid (num_splits, Hkv * m_blocks, B). Each row's visible key blocks are divided
  into num_splits contiguous ranges, one per program, so a short batch still fills the GPU.
  Each split writes its normalised partial O and its LSE in float32; `_combine` merges them
  (out = sum_s exp(lse_s - lse) O_s, lse = logsumexp_s lse_s; common/split_combine.py, shared
  with fa3's decode). With one split the kernel
  writes the final out and lse itself.
- Paged addressing: key j of row b is page block_table[b, j // page_size], slot
  j % page_size. When page_size is a multiple of BLOCK_N one table entry serves the whole
  tile; otherwise each key looks its page up.
Every load of K/V and of the block table is masked by the row's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from flashsuite.common.split_combine import _combine, split_count  # noqa: F401 (_combine re-exported)
from flashsuite.common.triton_launch import next_power_of_2
from flashsuite.fa2.kernels import _scores, _visible

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _kv_offsets(
    BlockTable,  # (B, max_pages) int32, PAGED only
    off_b,
    keys,  # (BLOCK_N,) key indices of the row
    key_ok,  # (BLOCK_N,) keys < seqlen
    start_n,
    page_size,
    stride_btb,
    stride_kb,
    stride_kn,
    PAGED: tl.constexpr,
    PAGE_PER_TILE: tl.constexpr,  # page_size % BLOCK_N == 0: one table entry per tile
):
    """(BLOCK_N,) int64 element offsets of the keys' (head 0, dim 0) in the cache."""
    if PAGED:
        bt = BlockTable + off_b.to(tl.int64) * stride_btb
        if PAGE_PER_TILE:
            page = tl.load(bt + start_n // page_size).to(tl.int64)  # scalar
            slot = keys - (start_n // page_size) * page_size  # (BLOCK_N,)
            return page * stride_kb + slot.to(tl.int64) * stride_kn
        else:
            page = tl.load(bt + keys // page_size, mask=key_ok, other=0).to(tl.int64)
            return page * stride_kb + (keys % page_size).to(tl.int64) * stride_kn
    else:
        return off_b.to(tl.int64) * stride_kb + keys.to(tl.int64) * stride_kn


@triton.jit(do_not_specialize=["n_new", "seqlen_q", "num_splits", "window_left", "window_right"])
def _decode_split(
    Q,  # (B, Nq, Hq, D)
    K,  # (B_cache, N_max, Hkv, D) or (num_pages, page_size, Hkv, D)
    V,  # like K, head dim Dv
    BlockTable,  # (B, max_pages) int32 (PAGED)
    CacheSeqlens,  # (B,) int32: keys in the cache before the append
    Leftpad,  # (B,) int32 (LEFTPAD): each row's first key slot
    DescaleK,  # (B, Hkv) float32 (DESCALE_K): a float8 cache's key factors
    DescaleV,  # (B, Hkv) float32 (DESCALE_V)
    Out,  # (B, Nq, Hq, Dv), without SPLIT
    Lse,  # (B, Hq, Nq) fp32, without SPLIT
    OPart,  # (num_splits, B * Nq * Hq, Dv) fp32, SPLIT
    LsePart,  # (num_splits, B * Nq * Hq) fp32, SPLIT
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    n_new,  # tokens appended to every row before attending
    seqlen_q,  # Nq
    num_heads,  # Hq
    group,  # Hq // Hkv
    m_blocks,  # ceil(Nq * group / BLOCK_M)
    num_splits,  # a runtime value: every split count shares one binary
    page_size,
    window_left,
    window_right,
    qk_scale,
    softcap_log2,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for _combine
    PAGED: tl.constexpr,
    PAGE_PER_TILE: tl.constexpr,
    LEFTPAD: tl.constexpr,  # a contiguous cache whose rows start at Leftpad[b]
    KV_FP8: tl.constexpr,  # a float8_e4m3fn cache, converted to q's dtype in registers
    DESCALE_K: tl.constexpr,  # scores times DescaleK[b, hkv] (else 1)
    DESCALE_V: tl.constexpr,  # out times DescaleV[b, hkv] (else 1)
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
    pid_s = tl.program_id(0)
    off_hkv = tl.program_id(1) // m_blocks
    start_r = (tl.program_id(1) % m_blocks) * BLOCK_M
    off_b = tl.program_id(2)

    seqlen_k = tl.load(CacheSeqlens + off_b) + n_new
    first_key = 0  # the row's first key slot; keys below are indexed from it
    if LEFTPAD:
        # Clamped so that unchecked metadata reads nothing before the row.
        first_key = tl.minimum(tl.maximum(tl.load(Leftpad + off_b), 0), seqlen_k)
        seqlen_k -= first_key
    shift = seqlen_k - seqlen_q
    rows = start_r + tl.arange(0, BLOCK_M)  # (BLOCK_M,) packed (token, head-in-group) rows
    row_ok = rows < seqlen_q * group  # (BLOCK_M,)
    tok = rows // group  # (BLOCK_M,) query token
    head = off_hkv * group + rows % group  # (BLOCK_M,) query head
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, D_PAD)  # (D_PAD,)
    offs_dv = tl.arange(0, DV_PAD)  # (DV_PAD,)
    d_ok = offs_d[None, :] < HEAD_DIM  # (1, D_PAD)
    dv_ok = offs_dv[None, :] < HEAD_DIM_V  # (1, DV_PAD)

    q_rows = tok.to(tl.int64) * stride_qn + head.to(tl.int64) * stride_qh  # (BLOCK_M,)
    q_ptrs = Q + off_b.to(tl.int64) * stride_qb + q_rows[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)  # (BLOCK_M, D_PAD)

    # Keys any row of this tile can see, in whole key blocks, divided among the splits.
    first_tok = start_r // group
    last_tok = (tl.minimum(start_r + BLOCK_M, seqlen_q * group) - 1) // group
    lo = 0
    hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(first_tok + shift - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last_tok + shift + window_right + 1, 0), seqlen_k)
    lo_blk = lo // BLOCK_N
    n_blocks = tl.maximum(tl.cdiv(hi, BLOCK_N) - lo_blk, 0)
    per_split = tl.cdiv(n_blocks, num_splits)
    split_lo = (lo_blk + pid_s * per_split) * BLOCK_N
    split_hi = tl.minimum(split_lo + per_split * BLOCK_N, hi)

    # A float8 cache: its e4m3 values are exact in fp16 / bf16, so K and V are converted to q's
    # dtype as loaded and the GEMMs run as for a 16-bit cache; K's descale folds into the
    # score scale (before the softcap, which sees the real scores), V's into the output (P·V
    # is linear in V).
    scale = qk_scale
    if DESCALE_K:
        scale = qk_scale * tl.load(DescaleK + off_b * (num_heads // group) + off_hkv)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # (BLOCK_M,) log2 domain
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # (BLOCK_M,)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)  # (BLOCK_M, DV_PAD)
    k_head = K + off_hkv.to(tl.int64) * stride_kh
    v_head = V + off_hkv.to(tl.int64) * stride_vh
    for start_n in range(split_lo, split_hi, BLOCK_N):
        keys = start_n + offs_n  # (BLOCK_N,)
        key_ok = keys < seqlen_k  # (BLOCK_N,)
        k_rows = _kv_offsets(
            BlockTable, off_b, keys + first_key, key_ok, start_n, page_size, stride_btb,
            stride_kb, stride_kn, PAGED, PAGE_PER_TILE,
        )  # fmt: skip
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok)
        if KV_FP8:
            k = k.to(Q.dtype.element_ty)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        s, _t = _scores(qk, scale, softcap_log2, SOFTCAP)  # (BLOCK_M, BLOCK_N) log2 domain
        vis = _visible(
            tok[:, None], keys[None, :], seqlen_k, shift, window_left, window_right,
            HAS_LEFT, HAS_RIGHT,
        )  # fmt: skip
        s = tl.where(vis, s, float("-inf"))  # (BLOCK_M, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.math.exp2(s - m_use[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_use)  # (BLOCK_M,)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = _kv_offsets(
            BlockTable, off_b, keys + first_key, key_ok, start_n, page_size, stride_btb,
            stride_vb, stride_vn, PAGED, PAGE_PER_TILE,
        )  # fmt: skip
        v = tl.load(v_head + v_rows[:, None] + offs_dv[None, :], mask=key_ok[:, None] & dv_ok)
        if KV_FP8:
            v = v.to(Q.dtype.element_ty)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # (BLOCK_M, DV_PAD)
        m_i = m_new

    seen = l_i > 0.0  # (BLOCK_M,)
    denom = tl.where(seen, l_i, 1.0)  # (BLOCK_M,)
    if DESCALE_V:
        denom = denom / tl.load(DescaleV + off_b * (num_heads // group) + off_hkv)
    acc = acc / denom[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    if not SPLIT:
        o_rows = tok.to(tl.int64) * stride_on + head.to(tl.int64) * stride_oh  # (BLOCK_M,)
        o_ptrs = Out + off_b.to(tl.int64) * stride_ob + o_rows[:, None] + offs_dv[None, :]
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        l_ptrs = Lse + off_b.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + tok
        tl.store(l_ptrs, lse, mask=row_ok)
    else:
        # Partial rows are numbered (b, token, head), like a contiguous out.
        part = (off_b.to(tl.int64) * seqlen_q + tok) * num_heads + head  # (BLOCK_M,)
        total = tl.num_programs(2).to(tl.int64) * seqlen_q * num_heads  # B * Nq * Hq
        part = pid_s * total + part
        o_ptrs = OPart + part[:, None] * HEAD_DIM_V + offs_dv[None, :]  # (BLOCK_M, DV_PAD)
        tl.store(o_ptrs, acc, mask=row_ok[:, None] & dv_ok)
        tl.store(LsePart + part, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    block_m: int  # packed (token, head-in-group) rows per program
    block_n: int  # keys per step
    num_warps: int
    num_stages: int


MAX_SPLITS = 128
# Split until about this many programs per SM are in flight: one 4-warp program per SM
# cannot keep enough loads in flight to approach the HBM bandwidth (a decode step is a pure
# streaming read of K and V). Untimed starting point, to be set by benchmarks/decode_bench.py.
PROGRAMS_PER_SM = 4
MIN_BLOCKS_PER_SPLIT = 4  # a split shorter than this spends more on its partial than it saves
H100_SMS = 132  # the split heuristic's SM count where there is no GPU (interpreter, tests)


def decode_config(rows: int, head_dim: int, interpreter: bool) -> DecodeConfig:
    """rows = Nq * Hq / Hkv packed rows of one program's tile (capped at 64 per tile, 32 for
    D > 128: a 64-row D = 256 tile spills 316-356 B in the sm_90a probe, 32 rows are clean at
    177-208 registers)."""
    block_m = max(16, min(64 if head_dim <= 128 else 32, next_power_of_2(rows)))
    if interpreter:
        # Small key blocks: several blocks, pages and splits in play at test sizes.
        return DecodeConfig(block_m, 16, num_warps=4, num_stages=1)
    # 64 keys x D <= 128 in 16-bit: 16 KB per K or V tile, 3 stages in 96 KB, so two programs
    # fit one SM's shared memory; D = 256 halves the key block for the same footprint.
    return DecodeConfig(block_m, 64 if head_dim <= 128 else 32, num_warps=4, num_stages=3)


def num_splits_heuristic(tiles: int, key_blocks: int, num_sms: int) -> int:
    """Splits of the key range so that tiles * splits programs fill num_sms SMs
    (PROGRAMS_PER_SM each) without making a split shorter than MIN_BLOCKS_PER_SPLIT blocks.

    tiles = B * Hkv * m_blocks programs without splitting; key_blocks = key blocks of the
    longest row. Among the split counts up to that bound, the largest whose wave efficiency
    (programs / (waves * target)) is within 5% of the best wins: more programs in flight, up
    to the target, without a mostly idle last wave.
    """
    return split_count(
        tiles, key_blocks, PROGRAMS_PER_SM * num_sms, MIN_BLOCKS_PER_SPLIT, MAX_SPLITS
    )
