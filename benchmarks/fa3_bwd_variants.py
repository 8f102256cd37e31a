"""Named BwdConfig variants of the fa3 backward, for side-by-side checks on the GPU.

`benchmarks/fa3_bwd_check.py --variant NAME` runs correctness and timing per variant through
`fa3.interface.backward(..., cfg=...)`; `benchmarks/fa3_bwd_probe.py --variant NAME` compiles
them for sm_90a and reports PTX facts. "base" is the first config (per-element dQ atomics,
one sdS buffer, serial issue); "pipe_stm_tma" is what bwd_config_for ships at D = 96 and 128 for
windows and packed sequences, "pipe_wgdq_tma" at non-causal D = 96, "pipe_sec4_wgdq_tma" at
causal D = 96 and 128, "pipe80_wgs_wgdq_tma_dvf" at non-causal D = 128,
"pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf" at D = 64 (FA4's route, bwd_configs.D64_FA4_ROUTE;
"pipe128_dqm_sec4_..." causal; "pipe128_dqm_tma" / "pipe128_dqm_sec4_tma" the D = 64 builds
before it), "warp_stm2" their softcap build; "pipe128_dqm", "pipe_wgdq",
"pipe128_wgdq" and "pipe128_dqm_wgdq" build two differences from FA4's SM90 backward
(dq_split, dq_handoff; docs/design.md, "Next to FA4's SM90 backward"). The "_sout" variants
take the softmax scale out of dS (scale_out), the "_sreg" ones load LSE and D into registers
under the S^T / dP^T wgmmas (stats_regs; tile_m 64 only: at 128 rows the 64 extra registers
spill). "pipe80" is pipe_stm with FA4's 80-row tile at D = 128 (timed non-causal: NON_CAUSAL), dQ
computed as dQ^T = K^T dS^T (dq_split "dt"); "pipe80_tma" / "pipe80_wgs_tma" add the TMA epilogue
and are built causal too (FA4 keeps 64 rows there). The "wide256_" variants past "wide256_det" give
D = 256 more keys per CTA by shrinking sdQ to one warpgroup's chunk (dq_handoff "turn") or dropping
it (dq_mode "red", dQ by red.global.add.v4.f32; with dq_slices 2 at 80 keys, FA3's
hdim-256 tile; docs/design.md, "D = 256 with more keys per CTA"). The "_wgs" variants (wg_slice)
partition the shared-memory operands with the warpgroup's warp-uniform slice, so their wgmma
descriptors stay in uniform registers (benchmarks/fa3_bwd_sass.py counts what that saves per row
block). The "_tma" variants store dK and dV through shared memory by TMA (dkv_tma), as the
"dkv_t" layout does. The "_sec" variants launch the grid in sections of S (kv head, batch)
pairs, column block 0 of each pair first (head_section: the causal tail of the default order,
benchmarks/bwd_order_model.py; shipped at causal D = 64, 96 and 128). The "_pdl" variants are
shipped configs whose three launches (preprocess, kernel, dQ postprocess) are programmatic
dependents of the one before (BwdConfig.pdl); the "_dvf" variants issue dV's wgmma between
the dS^T stores to sdS and their proxy fence (BwdConfig.dv_before_fence, FA4's order). (The
"bulk" dQ mode, per-row bulk reduces issued by MMA warp 0, the "dv_early" order and
"dq_convert", dQ converted in the kernel without the postprocess launch, were measured and
removed: docs/results.md.)
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from flashsuite.fa3.bwd_configs import BwdConfig

# The shipped "sdp_t" mechanisms (pipe_stm), for the variants built on them.
_PIPE = {"dq_mode": "warp", "overlap": True, "ds_stages": 2, "ds_store": "stmatrix"}

# name -> (config, what it changes relative to "base")
VARIANTS: dict[str, tuple[BwdConfig, str]] = {
    "base": (BwdConfig(), "dQ by per-element atom.global.add.f32, 2-stage Q/dO ring"),
    "stages3": (BwdConfig(stages=3), "3-stage Q/dO/LSE/D ring"),
    "stmatrix": (BwdConfig(ds_store="stmatrix"), "dS^T to sdS by stmatrix.trans"),
    "det": (
        BwdConfig(deterministic=True),
        "base with dQ added in column-block order (turn counter per row block): deterministic",
    ),
    "warp": (
        BwdConfig(dq_mode="warp"),
        "dQ tile to smem in fragment order, one cp.reduce.async.bulk a row block by a writer warp",
    ),
    "overlap": (
        BwdConfig(overlap=True),
        "P^T under dP^T's wgmma; dV, dQ, dK issued, dQ added while dK runs",
    ),
    "ds2": (BwdConfig(ds_stages=2), "two sdS buffers: no DS_FREE barrier"),
    "pipe": (
        BwdConfig(dq_mode="warp", overlap=True, ds_stages=2),
        "writer-warp dQ, the overlapped issue order and two sdS buffers",
    ),
    "pipe_stm": (
        BwdConfig(dq_mode="warp", overlap=True, ds_stages=2, ds_store="stmatrix"),
        "pipe with dS^T by stmatrix.trans",
    ),
    "pipe128": (
        BwdConfig(tile_m=128, dq_mode="warp", overlap=True, ds_stages=2, ds_store="stmatrix"),
        "pipe_stm with 128-row Q tiles (D = 64 only)",
    ),
    "warp_stm2": (
        BwdConfig(dq_mode="warp", ds_stages=2, ds_store="stmatrix"),
        "pipe_stm in the serial issue order: the shipped softcap config",
    ),
    "pipe_atomic": (
        BwdConfig(overlap=True, ds_stages=2),
        "the overlapped issue order and two sdS buffers, dQ by per-element atomics under dK",
    ),
    "pipe3": (
        BwdConfig(dq_mode="warp", overlap=True, ds_stages=2, ds_store="stmatrix", stages=3),
        "pipe_stm with a 3-stage Q/dO/LSE/D ring (231 KiB of shared memory at D = 128)",
    ),
    "pipe_lpt": (
        BwdConfig(dq_mode="warp", overlap=True, ds_stages=2, ds_store="stmatrix", lpt=True),
        "pipe_stm with the grid ordered longest-first (every head's n_block 0 first)",
    ),
    "pipe128_lpt": (
        BwdConfig(
            tile_m=128, dq_mode="warp", overlap=True, ds_stages=2, ds_store="stmatrix", lpt=True
        ),
        "pipe128 with the grid ordered longest-first (D = 64 only)",
    ),
    "pipe128_dqm": (
        BwdConfig(tile_m=128, dq_split="m", **_PIPE),
        "pipe128 with dQ split by rows: each WG one m64n64 atom (n64 wgmmas, half as many, a "
        "third less smem read) instead of two m64n32 (D = 64 only)",
    ),
    "pipe_stm_tma": (
        BwdConfig(dkv_tma=True, **_PIPE),
        "pipe_stm with dK and dV stored through sK / sV by TMA (dkv_tma)",
    ),
    "pipe128_dqm_tma": (
        BwdConfig(tile_m=128, dq_split="m", dkv_tma=True, **_PIPE),
        "pipe128_dqm with dK and dV stored through sK / sV by TMA (dkv_tma; D = 64)",
    ),
    **{
        f"pipe_sec{s}_tma": (
            BwdConfig(dkv_tma=True, head_section=s, **_PIPE),
            f"pipe_stm_tma with the grid in sections of {s} (kv head, batch) pairs, column "
            "block 0 of each first (head_section)",
        )
        for s in (2, 4, 8, 16)
    },
    "pipe128_dqm_sec4_tma": (
        BwdConfig(tile_m=128, dq_split="m", dkv_tma=True, head_section=4, **_PIPE),
        "pipe128_dqm_tma with the grid in sections of 4 (kv head, batch) pairs (D = 64)",
    ),
    "pipe_wgs_tma": (
        BwdConfig(dkv_tma=True, wg_slice=True, **_PIPE),
        "pipe_stm_tma with the wgmma fragments sliced per warpgroup (uniform descriptors)",
    ),
    "pipe128_dqm_wgs_tma": (
        BwdConfig(tile_m=128, dq_split="m", dkv_tma=True, wg_slice=True, **_PIPE),
        "pipe128_dqm_tma with the wgmma fragments sliced per warpgroup (D = 64)",
    ),
    "pipe_wgs_ng_tma": (
        BwdConfig(dkv_tma=True, wg_slice=True, lse_guard=False, **_PIPE),
        "pipe_wgs_tma without the kernel's -inf LSE guard (the preprocess writes +inf)",
    ),
    "pipe128_dqm_wgs_ng_tma": (
        BwdConfig(tile_m=128, dq_split="m", dkv_tma=True, wg_slice=True, lse_guard=False, **_PIPE),
        "pipe128_dqm_wgs_tma without the kernel's -inf LSE guard (D = 64)",
    ),
    "pipe_dve_tma": (
        BwdConfig(dkv_tma=True, dv_early=True, **_PIPE),
        "pipe_stm_tma with dV issued once P is packed, before dP^T retires (dv_early)",
    ),
    "pipe_lser_tma": (
        BwdConfig(dkv_tma=True, lse_regs=True, **_PIPE),
        "pipe_stm_tma with the LSE rows in registers, loaded before S^T's wgmma (lse_regs)",
    ),
    "pipe_dve_lser_tma": (
        BwdConfig(dkv_tma=True, lse_regs=True, dv_early=True, **_PIPE),
        "pipe_lser_tma with dV issued once P^T is packed, before dP^T retires (dv_early)",
    ),
    "pipe_dve_sreg_tma": (
        BwdConfig(dkv_tma=True, stats_regs=True, dv_early=True, **_PIPE),
        "pipe_dve_tma with LSE and D in registers, loaded under the S^T / dP^T wgmmas",
    ),
    "pipe_wgs_lser_ng_tma": (
        BwdConfig(dkv_tma=True, lse_regs=True, wg_slice=True, lse_guard=False, **_PIPE),
        "pipe_wgs_ng_tma with the LSE rows in registers, loaded before S^T's wgmma",
    ),
    "pipe_wgdq_tma": (
        BwdConfig(dkv_tma=True, dq_handoff="wg", **_PIPE),
        "pipe_stm_tma with sdQ handed to the writer per warpgroup (FA4's D = 128 hand-off; "
        "shipped at non-causal D = 96)",
    ),
    "pipe_sec4_wgdq_tma": (
        BwdConfig(dkv_tma=True, dq_handoff="wg", head_section=4, **_PIPE),
        "pipe_wgdq_tma with the grid in sections of 4 (kv head, batch) pairs (head_section)",
    ),
    "pipe_wgs_lser_ng_wgdq_tma": (
        BwdConfig(
            dkv_tma=True, lse_regs=True, wg_slice=True, lse_guard=False, dq_handoff="wg", **_PIPE
        ),
        "pipe_wgs_lser_ng_tma with sdQ handed over per warpgroup (every FA4-like choice at once)",
    ),
    "pipe_wgdq": (
        BwdConfig(dq_handoff="wg", **_PIPE),
        "pipe_stm with sdQ handed to the writer per warpgroup (own barriers, own bulk reduce)",
    ),
    "pipe128_wgdq": (
        BwdConfig(tile_m=128, dq_handoff="wg", **_PIPE),
        "pipe128 with sdQ handed to the writer per warpgroup (D = 64 only)",
    ),
    "pipe128_dqm_wgdq": (
        BwdConfig(tile_m=128, dq_split="m", dq_handoff="wg", **_PIPE),
        "pipe128 with both: dQ split by rows, handed over per warpgroup (FA4's D = 64 dQ route)",
    ),
    "pipe128_sout": (
        BwdConfig(tile_m=128, scale_out=True, **_PIPE),
        "pipe128 with dS = P (dP - D), the softmax scale on dK's epilogue and dQ's conversion "
        "(one multiply per score less; D = 64 only)",
    ),
    "pipe_sout": (
        BwdConfig(scale_out=True, **_PIPE),
        "pipe_stm with dS = P (dP - D), the softmax scale on dK's epilogue and dQ's conversion",
    ),
    "pipe128_dqm_sout": (
        BwdConfig(tile_m=128, dq_split="m", scale_out=True, **_PIPE),
        "pipe128_dqm with the softmax scale out of dS (D = 64 only)",
    ),
    "warp_stm2_sout": (
        BwdConfig(dq_mode="warp", ds_stages=2, ds_store="stmatrix", scale_out=True),
        "warp_stm2 (the softcap build's config) with the softmax scale out of dS",
    ),
    "pipe_sreg": (
        BwdConfig(stats_regs=True, **_PIPE),
        "pipe_stm with the row block's LSE and D in registers, loaded under the S^T / dP^T wgmmas",
    ),
    "pipe_sout_sreg": (
        BwdConfig(scale_out=True, stats_regs=True, **_PIPE),
        "pipe_stm with both: the scale out of dS, LSE and D in registers",
    ),
    "pipe_wgs": (
        BwdConfig(wg_slice=True, **_PIPE),
        "pipe_stm with the smem operands' wgmma fragments sliced per warpgroup (warp-uniform): "
        "descriptors in uniform registers, not rebuilt per wgmma in vector registers",
    ),
    "pipe_wgs_sout": (
        BwdConfig(wg_slice=True, scale_out=True, **_PIPE),
        "pipe_wgs with the softmax scale out of dS (on dK's epilogue and dQ's conversion)",
    ),
    "pipe_wgs_sout_ng": (
        BwdConfig(wg_slice=True, scale_out=True, lse_guard=False, **_PIPE),
        "pipe_wgs_sout without the kernel's -inf LSE guard (the preprocess writes +inf)",
    ),
    "pipe128_dqm_wgs_ng": (
        BwdConfig(tile_m=128, dq_split="m", wg_slice=True, lse_guard=False, **_PIPE),
        "pipe128_dqm_wgs without the kernel's -inf LSE guard (the preprocess writes +inf)",
    ),
    "pipe128_dqm_wgs": (
        BwdConfig(tile_m=128, dq_split="m", wg_slice=True, **_PIPE),
        "pipe128_dqm (shipped at D = 64) with the wgmma fragments sliced per warpgroup",
    ),
    "pipe80_wgs": (
        BwdConfig(tile_m=80, dq_split="dt", wg_slice=True, **_PIPE),
        "pipe80 with the wgmma fragments sliced per warpgroup (D = 128, non-causal only)",
    ),
    "pipe80": (
        BwdConfig(tile_m=80, dq_split="dt", **_PIPE),
        "pipe_stm with 80-row Q tiles (FA4's non-causal tile at D = 128): S^T / dP^T m64n80, "
        "dV / dK over 5 k-steps, dQ^T = K^T dS^T with D on M (D = 128, non-causal only)",
    ),
    "pipe80_tma": (
        BwdConfig(tile_m=80, dq_split="dt", dkv_tma=True, **_PIPE),
        "pipe80 with dK and dV stored through sK / sV by TMA (dkv_tma, the shipped D = 128 "
        "epilogue): FA4's non-causal D = 128 tile and epilogue, built causal too",
    ),
    "pipe80_wgs_tma": (
        BwdConfig(tile_m=80, dq_split="dt", dkv_tma=True, wg_slice=True, **_PIPE),
        "pipe80_tma with the wgmma fragments sliced per warpgroup (uniform descriptors)",
    ),
    "pipe80_wgs_wgdq_tma": (
        BwdConfig(tile_m=80, dq_split="dt", dkv_tma=True, wg_slice=True, dq_handoff="wg", **_PIPE),
        "pipe80_wgs_tma with sdQ handed over per warpgroup (non-causal D = 128 ships its _dvf)",
    ),
    "pipe80_wgs_ng_tma": (
        BwdConfig(tile_m=80, dq_split="dt", dkv_tma=True, wg_slice=True, lse_guard=False, **_PIPE),
        "pipe80_wgs_tma without the kernel's -inf LSE guard (the preprocess writes +inf)",
    ),
    "pipe80_wgs_sout_ng_tma": (
        BwdConfig(
            tile_m=80,
            dq_split="dt",
            dkv_tma=True,
            wg_slice=True,
            lse_guard=False,
            scale_out=True,
            **_PIPE,
        ),
        "pipe80_wgs_ng_tma with the softmax scale out of dS (on dK's epilogue and dQ's "
        "conversion): FA4's elementwise work per score",
    ),
    "det_pipe": (
        BwdConfig(
            dq_mode="warp", overlap=True, ds_stages=2, ds_store="stmatrix", deterministic=True
        ),
        "pipe_stm with dQ added in column-block order by the writer warp: deterministic",
    ),
}
# Programmatic dependent launch on the shipped configs (BwdConfig.pdl).
VARIANTS.update(
    {
        f"{name}_pdl": (replace(VARIANTS[name][0], pdl=True), f"{name} with pdl")
        for name in ("pipe80_wgs_wgdq_tma", "pipe_sec4_wgdq_tma", "pipe128_dqm_tma")
    }
)
# dV's wgmma issued before the proxy fence of the dS^T stores (BwdConfig.dv_before_fence), on
# the shipped configs.
VARIANTS.update(
    {
        f"{name}_dvf": (
            replace(VARIANTS[name][0], dv_before_fence=True),
            f"{name} with dV issued between the sdS stores and their fence",
        )
        for name in ("pipe80_wgs_wgdq_tma", "pipe_sec4_wgdq_tma", "pipe128_dqm_tma")
    }
)
# D = 64 with FA4's per-warpgroup sdQ hand-off, its elementwise work per score (no softmax
# scale on dS, no -inf LSE guard, descriptors per warpgroup) and both (with dV before the fence).
VARIANTS["pipe128_dqm_wgdq_tma"] = (
    replace(VARIANTS["pipe128_dqm_tma"][0], dq_handoff="wg"),
    "pipe128_dqm_tma with sdQ handed to the writer per warpgroup (D = 64)",
)
VARIANTS["pipe128_dqm_wgs_sout_ng_tma"] = (
    replace(VARIANTS["pipe128_dqm_wgs_ng_tma"][0], scale_out=True),
    "pipe128_dqm_wgs_ng_tma with the softmax scale out of dS: FA4's elementwise work (D = 64)",
)
VARIANTS["pipe128_dqm_wgs_sout_ng_wgdq_tma_dvf"] = (
    replace(VARIANTS["pipe128_dqm_wgs_sout_ng_tma"][0], dq_handoff="wg", dv_before_fence=True),
    "pipe128_dqm_wgs_sout_ng_tma with the per-warpgroup hand-off and dV before the fence (D = 64)",
)
# LSE and D by warp shuffle (stats_shfl, FA4's route) on the D = 64 build and on the last one.
VARIANTS["pipe128_dqm_shfl_tma"] = (
    replace(VARIANTS["pipe128_dqm_tma"][0], stats_shfl=True),
    "pipe128_dqm_tma with LSE and D by warp shuffle (D = 64)",
)
VARIANTS["pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf"] = (
    replace(VARIANTS["pipe128_dqm_wgs_sout_ng_wgdq_tma_dvf"][0], stats_shfl=True),
    "pipe128_dqm_wgs_sout_ng_wgdq_tma_dvf with LSE and D by warp shuffle (D = 64)",
)
# Causal D = 96 / 128 (64-row tiles, the sectioned grid, the hand-off: pipe_sec4_wgdq_tma) with
# D = 64's route: FA4's elementwise work, dV before the fence, and with the shuffles (two rows
# per lane at 64 rows; FA4 shuffles at D <= 64 only).
VARIANTS["pipe_sec4_wgs_sout_ng_wgdq_tma_dvf"] = (
    replace(
        VARIANTS["pipe_sec4_wgdq_tma"][0],
        wg_slice=True,
        scale_out=True,
        lse_guard=False,
        dv_before_fence=True,
    ),
    "pipe_sec4_wgdq_tma with FA4's elementwise work and dV before the fence (causal D = 96, 128)",
)
VARIANTS["pipe_sec4_wgs_sout_ng_shfl_wgdq_tma_dvf"] = (
    replace(VARIANTS["pipe_sec4_wgs_sout_ng_wgdq_tma_dvf"][0], stats_shfl=True),
    "pipe_sec4_wgs_sout_ng_wgdq_tma_dvf with LSE and D by warp shuffle (causal D = 96, 128)",
)
# The same without the sections (packed sequences take no head_section): D = 128's route for
# the varlen backward, with and without the shuffles (benchmarks/varlen_bwd_ab.py).
VARIANTS["pipe_wgs_sout_ng_wgdq_tma_dvf"] = (
    replace(VARIANTS["pipe_sec4_wgs_sout_ng_wgdq_tma_dvf"][0], head_section=0),
    "pipe_wgdq_tma with FA4's elementwise work and dV before the fence (D = 96, 128)",
)
VARIANTS["pipe_wgs_sout_ng_shfl_wgdq_tma_dvf"] = (
    replace(VARIANTS["pipe_wgs_sout_ng_wgdq_tma_dvf"][0], stats_shfl=True),
    "pipe_wgs_sout_ng_wgdq_tma_dvf with LSE and D by warp shuffle (D = 96, 128)",
)
# The same on the causal build's sectioned grid (pipe128_dqm_sec4_tma); the last is shipped.
VARIANTS.update(
    {
        name.replace("_dqm_", "_dqm_sec4_"): (
            replace(VARIANTS[name][0], head_section=4),
            VARIANTS[name][1].replace("(D = 64)", "in sections of 4 pairs (D = 64, causal)"),
        )
        for name in (
            "pipe128_dqm_wgdq_tma",
            "pipe128_dqm_wgs_sout_ng_tma",
            "pipe128_dqm_wgs_sout_ng_wgdq_tma_dvf",
            "pipe128_dqm_shfl_tma",
            "pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf",
        )
    }
)
VARIANTS["pipe80_wgs_sout_ng_wgdq_tma_dvf"] = (
    replace(VARIANTS["pipe80_wgs_wgdq_tma_dvf"][0], scale_out=True, lse_guard=False),
    "pipe80_wgs_wgdq_tma_dvf with the softmax scale out of dS and no -inf LSE guard: FA4's "
    "elementwise work per score and its issue order around dV",
)

# The "dkv_t" layout (D = 192 and 256; bwd_configs._bwd_wide_config): S not transposed, P and dS
# through smem, dK^T / dV^T with D on wgmma's M, a 2-stage Q ring and a 1-stage dO ring.
_WIDE = {"tile_m": 64, "stages": 2, "do_stages": 1, "dq_mode": "warp", "layout": "dkv_t"}
_WIDE192 = {**_WIDE, "tile_n": 96, "dkv_split": "keys"}
_WIDE256 = {**_WIDE, "tile_n": 48, "dkv_split": "d"}
_DET = {"dq_mode": "atomic", "overlap": False, "deterministic": True}
VARIANTS.update(
    {
        "wide192": (
            BwdConfig(**_WIDE192, overlap=True),
            "D = 192: 64 x 96 tiles, the WGs split the keys of dK^T / dV^T",
        ),
        "wide256": (
            BwdConfig(**_WIDE256, overlap=True),
            "D = 256: 64 x 48 tiles, the WGs split D of dK^T / dV^T",
        ),
        "wide192_serial": (
            BwdConfig(**_WIDE192),
            "wide192 in the serial issue order: the shipped D = 192 softcap config",
        ),
        "wide256_serial": (
            BwdConfig(**_WIDE256),
            "wide256 in the serial issue order: the shipped D = 256 softcap config",
        ),
        "wide192_det": (
            BwdConfig(**{**_WIDE192, **_DET}),
            "wide192 with dQ by atomics in column-block order: the deterministic build",
        ),
        "wide256_det": (
            BwdConfig(**{**_WIDE256, **_DET}),
            "wide256 with dQ by atomics in column-block order: the deterministic build",
        ),
        "wide192_ring": (
            BwdConfig(**{**_WIDE192, "tile_n": 64, "do_stages": 0}, overlap=True),
            "D = 192 with a 2-stage dO ring and 64 x 64 tiles (210 KiB)",
        ),
        "wide192_n80": (
            BwdConfig(**{**_WIDE192, "tile_n": 80}, ds_stages=2, overlap=True),
            "D = 192 with 64 x 80 tiles and two sP / sdS buffers (221 KiB)",
        ),
        # D = 256 with more keys per CTA than wide256's 48: Q, dO, LSE and D are streamed once
        # per column block, so their traffic and TMA issues per FLOP fall as tile_n grows, and
        # the dQ GEMM's K (the keys) deepens. The 64 KiB fp32 sdQ tile is what keeps tile_n at
        # 48; these shrink it (dq_handoff "turn") or drop it (dq_mode "red").
        "wide256_n64_turn": (
            BwdConfig(**{**_WIDE256, "tile_n": 64}, dq_handoff="turn", overlap=True),
            "D = 256, 64 x 64 tiles; sdQ one warpgroup's 32 KiB chunk, filled by the WGs in turn "
            "(209 KiB)",
        ),
        "wide256_n64_turn_ds2": (
            BwdConfig(**{**_WIDE256, "tile_n": 64}, dq_handoff="turn", ds_stages=2, overlap=True),
            "wide256_n64_turn with two sP / sdS buffers: no DS_FREE barrier (225 KiB)",
        ),
        "wide256_ring_turn": (
            BwdConfig(**{**_WIDE256, "do_stages": 0}, dq_handoff="turn", overlap=True),
            "D = 256, 64 x 48 tiles with a 2-stage dO ring in the 32 KiB the half sdQ frees "
            "(222 KiB)",
        ),
        "wide256_red": (
            BwdConfig(**{**_WIDE256, "tile_n": 64, "dq_mode": "red"}, overlap=True),
            "D = 256, 64 x 64 tiles; dQ by red.global.add.v4.f32 from the MMA threads, no sdQ "
            "(178 KiB)",
        ),
        "wide256_red80": (
            BwdConfig(**{**_WIDE256, "tile_n": 80, "dq_mode": "red"}, dq_slices=2, overlap=True),
            "D = 256, 64 x 80 tiles (FA3's hdim-256 tile): dQ by red.global.add.v4.f32 in two "
            "column slices (m64n64 each, the first beside dK^T), no sdQ (198 KiB)",
        ),
        "wide256_red80_ds2": (
            BwdConfig(
                **{**_WIDE256, "tile_n": 80, "dq_mode": "red"},
                dq_slices=2,
                ds_stages=2,
                overlap=True,
            ),
            "wide256_red80 with two sP / sdS buffers: no DS_FREE barrier (218 KiB)",
        ),
        "wide256_red_ring": (
            BwdConfig(**{**_WIDE256, "tile_n": 64, "dq_mode": "red", "do_stages": 0}, overlap=True),
            "wide256_red with a 2-stage dO ring (211 KiB)",
        ),
        # The "dkv_t" layout with its smem operands sliced per warpgroup (wg_slice): the
        # descriptors in uniform registers (benchmarks/fa3_bwd_sass.py counts the R2UR and
        # descriptor arithmetic this removes per row block).
        "wide192_wgs": (
            BwdConfig(**_WIDE192, overlap=True, wg_slice=True),
            "wide192 with the wgmma fragments sliced per warpgroup: shipped at D = 192",
        ),
        "wide256_wgs": (
            BwdConfig(**_WIDE256, overlap=True, wg_slice=True),
            "wide256 with the wgmma fragments sliced per warpgroup",
        ),
        "wide256_red80_wgs": (
            BwdConfig(
                **{**_WIDE256, "tile_n": 80, "dq_mode": "red"},
                dq_slices=2,
                overlap=True,
                wg_slice=True,
            ),
            "wide256_red80 with the wgmma fragments sliced per warpgroup: shipped at D = 256",
        ),
        "wide256_red80_wgs_sec8": (
            BwdConfig(
                **{**_WIDE256, "tile_n": 80, "dq_mode": "red"},
                dq_slices=2,
                overlap=True,
                wg_slice=True,
                head_section=8,
            ),
            "wide256_red80_wgs with the grid in sections of 8 (kv head, batch) pairs",
        ),
        **{
            f"wide256_red80_wgs_sec{s}": (
                BwdConfig(
                    **{**_WIDE256, "tile_n": 80, "dq_mode": "red"},
                    dq_slices=2,
                    overlap=True,
                    wg_slice=True,
                    head_section=s,
                ),
                f"wide256_red80_wgs with the grid in sections of {s} (kv head, batch) pairs",
            )
            for s in (2, 4)
        },
    }
)


# The head dims a variant is built and checked for where HEAD_DIMS does not say otherwise.
DEFAULT_HEAD_DIMS = (64, 128)
HEAD_DIMS: dict[str, tuple[int, ...]] = {
    "pipe128": (64,),
    "pipe128_lpt": (64,),
    "pipe80": (128,),
    "pipe80_wgs": (128,),
    "pipe80_tma": (128,),
    "pipe80_wgs_tma": (128,),
    "pipe80_wgs_wgdq_tma": (128,),
    "pipe80_wgs_wgdq_tma_pdl": (128,),
    "pipe_sec4_wgdq_tma_pdl": (96, 128),
    "pipe128_dqm_tma_pdl": (64,),
    "pipe80_wgs_wgdq_tma_dvf": (128,),
    "pipe80_wgs_sout_ng_wgdq_tma_dvf": (128,),
    "pipe_sec4_wgdq_tma_dvf": (96, 128),
    "pipe128_dqm_tma_dvf": (64,),
    "pipe80_wgs_ng_tma": (128,),
    "pipe80_wgs_sout_ng_tma": (128,),
    "pipe_wgs": (96, 128),
    "pipe_wgs_sout": (128,),
    "pipe_wgs_sout_ng": (128,),
    "pipe128_dqm_wgs_ng": (64,),
    "pipe128_dqm_wgs": (64,),
    "pipe128_dqm": (64,),
    "pipe128_dqm_tma": (64,),
    "pipe128_dqm_sec4_tma": (64,),
    **{f"pipe_sec{s}_tma": (128,) for s in (2, 8, 16)},
    "pipe_sec4_tma": (96, 128),
    "pipe_stm_tma": (96, 128),
    "pipe_wgs_tma": (96, 128),
    "pipe128_dqm_wgs_tma": (64,),
    "pipe_wgs_ng_tma": (96, 128),
    # dv_early at 128-row tiles (D = 64's pipe128_dqm) spills 48 B and serialises its wgmmas
    # (C7512): P^T held under dV on top of 64 + 64 fp32 of S^T and dP^T. At 64 rows it fits.
    "pipe_dve_tma": (64, 96, 128),
    "pipe128_dqm_wgs_ng_tma": (64,),
    "pipe128_dqm_wgdq_tma": (64,),
    "pipe128_dqm_wgs_sout_ng_tma": (64,),
    "pipe128_dqm_wgs_sout_ng_wgdq_tma_dvf": (64,),
    "pipe128_dqm_sec4_wgdq_tma": (64,),
    "pipe_sec4_wgs_sout_ng_wgdq_tma_dvf": (96, 128),
    "pipe_sec4_wgs_sout_ng_shfl_wgdq_tma_dvf": (96, 128),
    "pipe_wgs_sout_ng_wgdq_tma_dvf": (96, 128),
    "pipe_wgs_sout_ng_shfl_wgdq_tma_dvf": (96, 128),
    "pipe128_dqm_shfl_tma": (64,),
    "pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf": (64,),
    "pipe128_dqm_sec4_wgs_sout_ng_tma": (64,),
    "pipe128_dqm_sec4_wgs_sout_ng_wgdq_tma_dvf": (64,),
    "pipe128_dqm_sec4_shfl_tma": (64,),
    "pipe128_dqm_sec4_wgs_sout_ng_shfl_wgdq_tma_dvf": (64,),
    "pipe_lser_tma": (96, 128),
    "pipe_dve_lser_tma": (96, 128),
    "pipe_dve_sreg_tma": (96, 128),
    "pipe_wgs_lser_ng_tma": (96, 128),
    "pipe_wgdq_tma": (96, 128),
    "pipe_sec4_wgdq_tma": (96, 128),
    "pipe_wgs_lser_ng_wgdq_tma": (96, 128),
    "pipe128_wgdq": (64,),
    "pipe128_dqm_wgdq": (64,),
    "pipe128_sout": (64,),
    "pipe128_dqm_sout": (64,),
    "warp_stm2_sout": (64, 96, 128),
    "pipe_stm": (64, 96, 128),  # D = 96 ships it too
    "warp_stm2": (64, 96, 128),
    **{name: (int(name[4:7]),) for name in VARIANTS if name.startswith("wide")},
}


def variant_head_dims(name: str) -> tuple[int, ...]:
    """The head dims a named variant is built and checked for."""
    return HEAD_DIMS.get(name, DEFAULT_HEAD_DIMS)


# Variants built and timed for non-causal problems only (the 80-row tile's first two, measured
# that way): their probes, hashes and timings skip the causal builds.
NON_CAUSAL = (
    "pipe80",
    "pipe80_wgs",
    "pipe80_wgs_wgdq_tma",
    "pipe80_wgs_wgdq_tma_pdl",
    "pipe80_wgs_wgdq_tma_dvf",
    "pipe80_wgs_sout_ng_wgdq_tma_dvf",
    "pipe80_wgs_ng_tma",
    "pipe80_wgs_sout_ng_tma",
)


def variant_causal(name: str) -> tuple[bool, ...]:
    """The causal settings a named variant is built and timed for."""
    return (False,) if name in NON_CAUSAL else (False, True)


def variant_name(name: str) -> str:
    """argparse `type` of a --variant option: `name` if it names a variant, else a clear error."""
    if name not in VARIANTS:
        raise argparse.ArgumentTypeError(
            f"expected a name in benchmarks/fa3_bwd_variants.py, got {name!r}"
        )
    return name


def add_variant_option(ap: argparse.ArgumentParser) -> None:
    """The repeatable --variant NAME option of the backward A/B tools (args.variant: names)."""
    ap.add_argument(
        "--variant", action="append", default=[], type=variant_name,
        help="a backward variant of benchmarks/fa3_bwd_variants.py by name (repeat)",
    )  # fmt: skip


def variant(name: str) -> BwdConfig:
    """The config of a named variant; a clear error for an unknown name."""
    if name not in VARIANTS:
        raise ValueError(f"fa3 backward variant: name {name!r} not in {sorted(VARIANTS)}")
    return VARIANTS[name][0]
