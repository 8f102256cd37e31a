"""Configuration of the fa3 KV-cache decode kernel (decode.Fa3Decode, planned by decode_host):
its tiles (`decode_config`), the limits `decode_can_implement` checks, the setmaxnreg split, the
split-KV heuristic's constants and the switches that pick its builds. Each switch notes the
measurement that set it.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from flashsuite.fa3.configs import DTYPES, HEAD_DIMS, SMEM_CAPACITY, Fa3Config, smem_bytes

# Whether auto selection runs fa3 for `dispatch.attention_with_kvcache` on sm90 (else fa2's
# Triton split-KV kernel). On: the GPU oracle tests of tests/test_fa3_kvcache.py pass on the H200
# (commit cec8779) and under compute-sanitizer memcheck (commit 63c3300), and
# benchmarks/decode_bench.py --decode (CUDA-graph replay, GQA 32/8, D = 128, commit 63c3300)
# timed it at 1.00-1.51x fa2 over B 1 - 128 and 4k - 128k keys (paged, 64-token pages:
# 0.98-1.34x fa2 paged) and 0.98-1.00x SDPA cuDNN at B >= 8 (0.74 / 0.87 / 0.94x at B = 1).
KVCACHE_AUTO = True
# (producer, consumer) setmaxnreg of the decode kernel: one producer and one consumer
# warpgroup at one CTA per SM (FA3's split for a single MMA warpgroup).
DECODE_REG_SPLIT = (56, 256)
# The same at two CTAs per SM (ptxas entry count 128 a thread): 128 x 40 + 128 x 216 = 32,768.
DECODE_REG_SPLIT_2CTA = (40, 216)
# Shared memory one CTA may use when two share an SM: the SM's 233,472 bytes less the 1 KiB
# each resident CTA reserves, halved.
SMEM_PER_CTA_2 = (233_472 - 2 * 1024) // 2
DECODE_TILE_M = 64  # packed (token, head-in-group) rows: one consumer warpgroup
DECODE_MAX_STAGES = 4  # per 128-key tile; smaller page-sized tiles get up to 8 (same bytes)
# Split-KV: CTAs in flight per SM (one fits: its K/V rings fill shared memory), the fewest key
# blocks a split streams, the most splits. 4 blocks: on the H200 (B = 1, GQA 32/8, D = 128,
# CUDA-graph replay, commit 90f6261, benchmarks/decode_bench.py) 4k keys took 23.2 us in 16
# splits of 2 blocks, 19.6 in 8 of 4, 20.8 in 4; at 32k and 128k the SM count keeps 16 splits
# either way (56.0 / 145.5 us; 8 splits: 53.7 / 163.9).
DECODE_CTAS_PER_SM = 1
DECODE_MIN_BLOCKS_PER_SPLIT = 4
DECODE_MAX_SPLITS = 128
# Split partials merged by the last split of each tile inside the decode kernel (no second
# launch; decode.Fa3Decode.combine_if_last) instead of common.split_combine's Triton kernel.
# On: the GPU oracle cases of tests/test_fa3_kvcache.py pass with it (each fused case twice,
# bitwise equal), and on the H200 (benchmarks/decode_bench.py --decode, CUDA-graph replay,
# GQA 32/8, D = 128, commit 25b7562) it took B = 1 from 19.4 / 56.4 / 148 us to 17.1 / 50.4 /
# 140 us at 4k / 32k / 128k keys (cuDNN 16.5 / 49.0 / 140); at B >= 8 (1-2 splits) both
# combines time within 1 %.
DECODE_FUSED_COMBINE = True
# One-split calls with at least this many tiles (B x Hkv x m_blocks) run the decode build two
# CTAs of which share an SM (decode_config(ctas_per_sm=2)): a CTA's start (Q gather, the first
# TMA round trip) then overlaps the other's streaming. None: never. On the H200 (GQA 32/8,
# D = 128, one split, CUDA-graph replay, 3 interleaved passes, commit a21b558 with the switch
# set per pass; docs/inference.md): B 16 / 32 / 128 at 4k keys 77.5 / 139.5 / 503.9 -> 76.4 /
# 136.3 / 500.4 us, at 32k 491.1 / 974.5 / 3970.9 -> 488.6 / 971.1 / 3905.2, B 32 at 128k
# level (3850.0 / 3856.7).
DECODE_TWO_CTAS_MIN_TILES = 128
DECODE_TWO_CTAS_HEAD_DIMS = (128,)  # where the two-CTA build is measured
# Split calls whose one-CTA plan launches fewer than DECODE_TWO_CTAS_SPLITS_FILL x the SM count
# CTAs run the two-CTA build, their split count aimed at two CTAs per SM (64-key tiles, so
# twice the splits of 128-key ones at the same keys per split). Taken on every split call,
# on an H100 (2026-12-07, commit d252b34, `python -m benchmarks.decode_switch_ab --switch
# DECODE_TWO_CTAS_SPLITS` with the fill unbounded, 3 and 7 passes) B 1 took 18.4 -> 17.7 and
# 18.6 -> 17.9 us at 4k keys, where the one-CTA plan runs 64 CTAs and half the SMs idle (from
# 0.99x the faster SDPA backend to 1.03x), but 63.1 -> 64.8 at 32k and 189.9 -> 190.9 at 128k
# (128 CTAs already); B 8 x 32k level (docs/inference.md). So only calls that would leave more
# than half the SMs idle take it.
DECODE_TWO_CTAS_SPLITS = True
DECODE_TWO_CTAS_SPLITS_FILL = 0.5
# Paged caches on the contiguous cache's key tiles, a stage loaded as one TMA box per page
# (decode_host.plan, decode.Fa3Decode.BOX_N) instead of tiles cut to the page: 64-token pages
# run 64-key tiles otherwise (5-6 % slower than contiguous at B <= 8 on the H200, commit
# efc1579), 16-token pages 16-key tiles. On: its GPU oracle cases passed on the H200, also
# under compute-sanitizer memcheck (commit d8b8dd0), and on the decode sweep (GQA 32/8, D 128,
# medians of 3 interleaved passes, commit edeb6c2, docs/inference.md) it took 16-token pages
# from 0.70-1.01x the faster SDPA backend (contiguous) to 0.92-1.01x and 64-token pages from
# 0.94-1.04x to 0.95-1.01x (B 1 x 128k 144.3 -> 141.9 us; contiguous 136.1).
DECODE_PAGED_BOXES = True
# K and V loaded with an L2 evict-first hint (cp.async.bulk.tensor's .L2::cache_hint with
# CUTLASS's EVICT_FIRST policy): a decode call reads each cache block once, so its lines need
# not displace what stays in L2 (Q, the partials, the counters). Off: on the H200 (commit
# 545b933, `benchmarks/decode_switch_ab.py`, medians of 5 interleaved passes) it was slower at 7
# of 9 decode-sweep points (B 1 x 128k 136.3 -> 142.6 us, B 8 x 32k 252.1 -> 264.0, B 128 x 4k
# 489.9 -> 504.7) and faster only at B 1 x 32k (48.8 -> 46.5); docs/inference.md.
DECODE_KV_EVICT_FIRST = False
# The decode main loop's runtime mask test where nothing in the loop is masked (no causal or
# window edge: only the newest key block, peeled off before the loop, has keys past the row's
# length). On: the shipped build. Off drops the test (Fa3Config.loop_mask_test): 2840 SASS
# instructions in the contiguous D = 128 split build against 2960, bitwise the same output and
# level in time on an H100 (2026-12-05, commit 6c5318d, `benchmarks/decode_switch_ab.py --switch
# DECODE_LOOP_MASK_TEST`, B 8-128, Nk 4k-131k: 0.977-0.995x the faster SDPA backend either way;
# docs/results/h100-schedule-options-6c5318d.txt).
DECODE_LOOP_MASK_TEST = True


@functools.cache  # a frozen config per (head_dim, page_size, ctas_per_sm): every decode call asks
def decode_config(
    head_dim: int, page_size: int = 0, ctas_per_sm: int = 1, loop_mask_test: bool = True
) -> Fa3Config | None:
    """The decode kernel's tiles: 64 packed rows x tile_n keys, as many K/V stages as shared
    memory holds (up to DECODE_MAX_STAGES). tile_n is 128 keys (64 at D = 256: S, O and P of a
    128-key tile would need ~280 registers a thread), or for a paged cache the largest multiple
    of 16 up to that which divides page_size, so each key tile lies in one page.

    ctas_per_sm = 2: the build two CTAs of which share an SM: K/V tiles of at most 8192 / D keys
    (a multiple of 16: 128 at D = 64, 64 at D = 128), as many stages as half the SM's shared
    memory holds (3 at D = 64 / 128), None where not even two fit.

    loop_mask_test: Fa3Config.loop_mask_test (decode_host passes DECODE_LOOP_MASK_TEST)."""
    tile_n = 64 if head_dim > 192 else 128
    capacity = SMEM_CAPACITY
    if ctas_per_sm == 2:
        tile_n, capacity = min(tile_n, 8192 // head_dim // 16 * 16), SMEM_PER_CTA_2
    if page_size:
        tile_n = next(n for n in range(tile_n, 0, -16) if page_size % n == 0)
    cfg = Fa3Config(
        tile_m=DECODE_TILE_M,
        tile_n=tile_n,
        stages=2,
        pingpong=False,
        intra_wg_overlap=True,
        o_alias_q=True,
        num_consumer_wgs=1,
        loop_mask_test=loop_mask_test,
    )
    stages = min(8, DECODE_MAX_STAGES * 128 // tile_n)
    while stages > 2 and smem_bytes(replace(cfg, stages=stages), head_dim) > capacity:
        stages -= 1
    if smem_bytes(replace(cfg, stages=stages), head_dim) > capacity:
        return None
    return replace(cfg, stages=stages)


def decode_can_implement(cfg: Fa3Config, head_dim: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the decode kernel can be built for `cfg`: 16-bit inputs, the dense head dims, one
    64-row consumer warpgroup, wgmma-legal tile_n, shared memory within the capacity."""
    if dtype not in DTYPES:
        return False, f"fa3 decode: dtype {dtype} not in (float16, bfloat16)"
    if head_dim not in HEAD_DIMS:
        return False, f"fa3 decode: head_dim {head_dim} not in {set(HEAD_DIMS)}"
    if (cfg.tile_m, cfg.num_consumer_wgs, cfg.o_alias_q) != (DECODE_TILE_M, 1, True):
        return False, "fa3 decode: needs tile_m 64, one consumer warpgroup, no sO (o_alias_q)"
    if cfg.tile_n % 16 or not 16 <= cfg.tile_n <= 256:
        return False, f"fa3 decode: tile_n {cfg.tile_n} not a multiple of 16 in [16, 256]"
    smem = smem_bytes(cfg, head_dim, dtype)
    if smem > SMEM_CAPACITY:
        return False, f"fa3 decode: {smem} B of shared memory > {SMEM_CAPACITY}"
    return True, ""
