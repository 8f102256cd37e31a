"""The fa3 tile variants that the lab scripts time and compile next to the shipped table.

Catalogues only: `fa3_ablate` times `ablation_configs`, `final_variants` and
`persistent_variants` on the H200, `fa3_probe --variants` (and tests/test_fa3_compile.py)
compiles `flag_variants` for sm_90a so every barrier protocol of the kernel is built, and
`fa3_fp8_check --ablate` times `fp8_variants`; `fa3_probe --varlen` (and
tests/test_fa3_varlen.py) compiles the packed-sequence builds of `varlen_cases`. The shipped
tables live in flashsuite.fa3.configs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashsuite.fa3.configs import (
    FP8_CAUSAL_CONFIGS,
    FP8_CONFIGS,
    FP8_DTYPE,
    HEAD_DIMS,
    Fa3Config,
    _overlap,
    _tiles,
    can_implement,
    fp8_smem_transpose_config,
    get_config,
)
from flashsuite.fa3.varlen_configs import varlen_config


def _three_wgs(cfg: Fa3Config) -> Fa3Config:
    return replace(cfg, num_consumer_wgs=3, tile_m=192)


def _two_wgs(cfg: Fa3Config) -> Fa3Config:
    return replace(cfg, num_consumer_wgs=2, tile_m=128)


def ablation_configs(head_dim: int = 128, causal: bool = False) -> dict[str, Fa3Config]:
    """Variants of the shipped config at one head_dim, each switching one feature."""
    base = get_config(head_dim, torch.bfloat16, causal)
    variants = {
        "shipped": base,
        "no_pingpong": replace(base, pingpong=False),
        "no_intra_wg_overlap": replace(base, intra_wg_overlap=False),
        "neither": replace(base, pingpong=False, intra_wg_overlap=False),
        "tile_n_128": replace(base, tile_n=128, o_alias_q=False),
        "tile_n_128_stages3": replace(base, tile_n=128, stages=3, o_alias_q=True),
        "tile_n_128_o_on_q": replace(base, tile_n=128, o_alias_q=True),
        "tile_n_64": replace(base, tile_n=64, o_alias_q=False),
        "tile_n_64_stages4": replace(base, tile_n=64, stages=4, o_alias_q=True),
        "tile_n_176_o_on_q": replace(base, tile_n=176, o_alias_q=True),
        "tile_n_192": replace(_two_wgs(base), tile_n=192, stages=2),
        "wg2": _two_wgs(base),
        "wg3": _three_wgs(base),
        "wg3_no_pingpong": replace(_three_wgs(base), pingpong=False),
        "wg3_stages2": replace(_three_wgs(base), stages=2),
        "persistent": replace(base, persistent=True),
    }
    out: dict[str, Fa3Config] = {}
    for name, cfg in variants.items():
        if cfg not in out.values() and can_implement(cfg, head_dim, torch.bfloat16)[0]:
            out[name] = cfg
    return out


def final_variants() -> list[tuple[str, int, bool, Fa3Config]]:
    """(name, head_dim, causal, config) that `ablate --final` times: the shipped config next to
    the candidates it may be replaced by (3 consumer WGs / wider tile_n at D=64, the D=128
    ablation winners, the persistent LPT scheduler)."""
    out = []
    for d, causal in ((64, False), (64, True), (128, False), (128, True), (256, True)):
        base = get_config(d, torch.bfloat16, causal)
        cands = {"shipped": base}
        if causal or d == 128:
            cands["persistent"] = replace(_plain(base), persistent=True)  # v1, round-robin
        if d == 64:
            cands["wg3"] = _three_wgs(base)
            cands["wg2"] = _two_wgs(base)
            if causal:
                cands["wg3_persistent"] = replace(_three_wgs(_plain(base)), persistent=True)
            else:
                cands["tile_n_192"] = replace(_two_wgs(base), tile_n=192, stages=2)
        if d == 128 and not causal:
            cands["no_intra_wg_overlap"] = replace(base, intra_wg_overlap=False)
            cands["tile_n_128_o_on_q"] = replace(base, tile_n=128, o_alias_q=True)
        for name, cfg in cands.items():
            if can_implement(cfg, d, torch.bfloat16)[0]:
                out.append((name, d, causal, cfg))
    return out


# The persistent build as Q in registers takes it (its loop otherwise computes most
# exponentials twice): its own sO, the LSE by TMA, the softmax in place, no loop mask test.
_Q_IN_REGS_V2 = dict(
    o_alias_q=False, lse_tma=True, q_in_regs=True, softmax_apart=False, loop_mask_test=False
)


def flag_variants() -> list[tuple[str, int, torch.dtype, bool, Fa3Config]]:
    """Configs with the non-default flags (3 consumer WGs, persistent, the schedule options)
    that CI compiles too, with and without ping-pong / intra-WG overlap so every barrier
    protocol is built."""
    bf16 = torch.bfloat16
    d64 = get_config(64, bf16, False)
    d128c = _tiles(128, True)
    d128 = get_config(128, bf16, False)
    d256 = get_config(256, bf16, False)
    return [
        ("wg3", 64, bf16, False, _three_wgs(d64)),
        ("wg3-causal-fp16", 64, torch.float16, True, _three_wgs(d64)),
        (
            "wg3-no-overlap",
            64,
            bf16,
            False,
            replace(_three_wgs(d64), intra_wg_overlap=False, pv_wait_after_max=False),
        ),
        ("wg3-no-pingpong", 64, bf16, True, replace(_three_wgs(d64), pingpong=False)),
        ("wg3-persistent-causal", 64, bf16, True, replace(_three_wgs(d64), persistent=True)),
        ("wg2", 64, bf16, False, _two_wgs(d64)),
        ("wg2-causal", 64, bf16, True, _two_wgs(d64)),
        ("tile_n_192", 64, bf16, False, replace(_two_wgs(d64), tile_n=192, stages=2)),
        ("persistent-causal", 128, bf16, True, replace(d128c, persistent=True)),
        ("persistent-o-on-q", 128, bf16, False, replace(d128, persistent=True)),
        (
            "persistent-no-overlap",
            128,
            bf16,
            True,
            replace(d128c, persistent=True, intra_wg_overlap=False),
        ),
        ("persistent-d256-causal", 256, bf16, True, replace(d256, persistent=True)),
        *(
            (f"persistent-{name}", d, bf16, causal, cfg)
            for name, d, causal, cfg in persistent_variants()
            if cfg.overlap_tiles and cfg.balanced_order  # new_rr: the same code, old order
        ),
        ("no-skip-masked-wg", 64, torch.float16, True, _overlap(_tiles(64, True))),
        # The schedule options (Fa3Config.wg_slice, loop_mask_test, split_loops) at D = 256,
        # without ping-pong as FA4 runs it there; D 64 / 128 compile in
        # tests/test_fa3_softmax_overlap.py.
        (
            "schedule-new-no-pingpong",
            256,
            bf16,
            False,
            replace(d256, wg_slice=True, loop_mask_test=False, pingpong=False),
        ),
        (
            "schedule-split-causal",
            256,
            torch.float16,
            True,
            replace(get_config(256, bf16, True), split_loops=True, wg_slice=True),
        ),
        (
            "persistent-new-no-iwo",
            128,
            torch.float16,
            True,
            _overlap(replace(d128c, intra_wg_overlap=False)),
        ),
        # Two Q buffers (Fa3Config.q_stages): the non-causal D = 128 options with their own
        # sO, and 3 consumer WGs causal; the plain grid's prefetch of the next wave's Q.
        (
            "persistent-two-q",
            128,
            bf16,
            False,
            _overlap(replace(d128, o_alias_q=False, q_stages=2)),
        ),
        (
            "persistent-two-q-wg3-causal",
            64,
            torch.float16,
            True,
            _overlap(replace(_tiles(64, True), q_stages=2)),
        ),
        ("prefetch-next-q", 128, bf16, False, replace(d128, prefetch_next_q=True)),
        # The LSE by TMA from shared memory (Fa3Config.lse_tma): non-causal D = 128 with two Q
        # buffers (no recomputed exponentials: 132 MUFU.EX2, 64 under P·V), causal D = 64 on
        # three warpgroups (three LSE slabs).
        (
            "persistent-lse-tma",
            128,
            bf16,
            False,
            _overlap(replace(d128, o_alias_q=False, q_stages=2, lse_tma=True)),
        ),
        (
            "persistent-lse-tma-wg3-causal",
            64,
            bf16,
            True,
            _overlap(replace(_tiles(64, True), lse_tma=True)),
        ),
        # Per-tile clock stamps (Fa3Config.trace, benchmarks/fa3_timeline): the plain grid, the
        # persistent build with two Q buffers, causal D = 64 as the table builds it.
        ("trace", 128, bf16, False, replace(d128, trace=True)),
        (
            "trace-persistent-two-q",
            128,
            bf16,
            False,
            _overlap(replace(d128, o_alias_q=False, q_stages=2, trace=True)),
        ),
        ("trace-causal", 64, bf16, True, replace(_tiles(64, True), trace=True)),
        # Q·Kᵀ with Q in registers (Fa3Config.q_in_regs): the plain grid, causal, and the
        # persistent build (softmax in place, no loop mask test) with sQ released at the load.
        ("q-in-regs", 128, bf16, False, replace(d128, q_in_regs=True)),
        ("q-in-regs-causal", 128, bf16, True, replace(d128c, q_in_regs=True)),
        (
            "q-in-regs-persistent",
            128,
            torch.float16,
            False,
            _overlap(replace(d128, **_Q_IN_REGS_V2)),
        ),
        # Tiles from a global counter (Fa3Config.tile_counter): causal D = 128 as the table
        # builds it (its own sO) and causal D = 256 (sO on sQ), with 16 MiB L2 sections.
        (
            "tile-counter-causal",
            128,
            bf16,
            True,
            replace(get_config(128, bf16, True), tile_counter=True, l2_section_mib=16),
        ),
        (
            "tile-counter-causal-o-on-q",
            256,
            torch.float16,
            True,
            replace(get_config(256, bf16, True), tile_counter=True, l2_section_mib=16),
        ),
        # ... with clock stamps: the producer stamps each counted tile's loads too.
        (
            "trace-tile-counter-causal",
            128,
            bf16,
            True,
            replace(get_config(128, bf16, True), tile_counter=True, l2_section_mib=16, trace=True),
        ),
        # O by the consumer threads' 16-byte stores (no TMA store): 192-row tiles on 3 WGs and
        # D = 192, whose 24 threads a row leave 64 consumer threads idle.
        ("direct-o-store", 64, bf16, False, replace(_tiles(64, False), o_direct_store=True)),
        ("direct-o-store", 192, bf16, False, replace(_tiles(192, False), o_direct_store=True)),
    ]


def varlen_cases() -> list[tuple[str, int, torch.dtype, bool, Fa3Config, bool, bool]]:
    """(name, head_dim, dtype, causal, config, local, softcap) of the varlen builds CI
    compiles: every head_dim, causal and not, in bf16 (varlen_configs.varlen_config's tiles), and
    fp16 causal with a window and softcap (the mask and score paths those flags add)."""
    bf, f16 = torch.bfloat16, torch.float16
    out = [
        ("varlen", d, bf, causal, varlen_config(d, bf, causal), False, False)
        for d in HEAD_DIMS
        for causal in (False, True)
    ]
    out.append(("varlen-window-softcap", 128, f16, True, varlen_config(128, f16, True), True, True))
    plain = replace(varlen_config(128, bf, True), head_section=0)
    out.append(("varlen-causal-plain-order", 128, bf, True, plain, False, False))
    return out


def _plain(cfg: Fa3Config) -> Fa3Config:
    """The same tiles on the plain grid (one CTA per tile)."""
    return replace(cfg, persistent=False, overlap_tiles=False, balanced_order=False)


def persistent_variants() -> list[tuple[str, int, bool, Fa3Config]]:
    """(name, head_dim, causal, config) that `ablate --persistent` times: per shape the plain
    grid ("plain": the shipped tiles, one CTA per tile), the round-robin persistent scheduler
    ("old") and the overlapped one with the balanced order ("new"; a separate sO wherever it
    fits; what every causal entry ships).

    D=128 non-causal ships tile_n 176 with sO on sQ (208 KiB); a separate sO needs tile_n <= 160
    (Q 32 + K/V 2 x 2 x 40 + sO 32 KiB = 225 KiB) or 128 (193 KiB). D=256 cannot have one at
    tile_m 128 (Q 64 + sO 64 + K/V >= 128 KiB): it keeps sO on sQ and gets the K-first producer
    order and the balanced order only.
    """
    out = []
    shapes = ((64, True), (96, True), (128, True), (192, True), (256, True))
    shapes += ((64, False), (128, False), (256, False))
    for d, causal in shapes:
        base = _tiles(d, causal)
        out.append(("plain", d, causal, base))
        out.append(("old", d, causal, replace(base, persistent=True)))
        out.append(("new", d, causal, _overlap(base)))
        if d in (64, 192, 256) and causal:
            # Tiles taller than tile_n leave a WG a whole block short on the diagonal.
            out.append(("new_skip", d, causal, replace(_overlap(base), skip_masked_wg=True)))
        if d == 64 and causal:
            # 3 consumer WGs mask a taller diagonal (192 x 128) on causal tiles: against
            # two WGs (128 x 128), and 3 WGs with a shallower ring.
            out.append(("new_wg2", d, causal, _overlap(_two_wgs(base))))
            out.append(("new_s2", d, causal, replace(_overlap(base), stages=2)))
        if d == 128 and causal:
            # Tile overlap without the balanced order: which of the two a gain comes from.
            out.append(("new_rr", d, causal, replace(_overlap(base), balanced_order=False)))
        if d == 128 and not causal:
            # "new" keeps the shipped tile's sO on sQ (K-first producer order only); these
            # narrower tiles make room for a separate sO (per-WG epilogue, early Q release).
            for tile_n in (160, 128):
                cfg = _overlap(replace(base, tile_n=tile_n, o_alias_q=False))
                out.append((f"new_n{tile_n}", d, causal, cfg))
            # 176 leaves a ragged last K/V block at every power-of-two N (2048 = 11 x 176 + 112):
            # the plain grid with a tile_n that divides N.
            out.append(("plain_n128", d, causal, replace(base, tile_n=128)))
            # Intra-WG overlap was measured off at N = 8k/16k; short tiles (few K/V blocks) pay
            # the un-overlapped first and last blocks more often.
            out.append(("plain_iwo", d, causal, replace(base, intra_wg_overlap=True)))
            cfg = _overlap(replace(base, tile_n=128, o_alias_q=False, intra_wg_overlap=True))
            out.append(("new_n128_iwo", d, causal, cfg))
    return out


def fp8_variants() -> list[tuple[str, int, Fa3Config]]:
    """(name, head_dim, config): the table entries and the candidates to time against them
    (`fp8_check --ablate`; `fp8_check --probe --variants` compiles them: all 0 spills, R145 to
    R224). Wider S tiles amortise the softmax and the P exchange over more keys; a third stage
    hides more load latency."""
    out = []
    for d, cfg in FP8_CONFIGS.items():
        out.append(("shipped", d, cfg))
        if d in FP8_CAUSAL_CONFIGS:
            out.append(("shipped_causal", d, FP8_CAUSAL_CONFIGS[d]))
        cands = {
            "no_intra_wg_overlap": replace(cfg, intra_wg_overlap=False),
            "no_pingpong": replace(cfg, pingpong=False),
            "stages3": replace(cfg, stages=3),
        }
        if d <= 128:
            cands["tile_n_128"] = replace(cfg, tile_n=128)
        # The persistent scheduler v2 (tile overlap, balanced order, per-WG epilogue) that
        # every causal bf16 entry ships; descales are read per tile (`tile_scales`).
        cands["persistent_v2"] = replace(
            cfg, persistent=True, overlap_tiles=True, balanced_order=True
        )
        if d == 64:
            # The bf16 kernel's D = 64 shape: three consumer WGs (192 query rows, 160
            # registers each: S 64 + O 32 + P 16 at tile_n 128).
            cands["wg3_n128"] = replace(cfg, num_consumer_wgs=3, tile_m=192, tile_n=128)
            cands["wg3_n96"] = replace(cfg, num_consumer_wgs=3, tile_m=192, tile_n=96)
            # FA3's e4m3 D = 64 tile: 192 x 160 on three consumer warpgroups.
            cands["wg3_n160"] = replace(cfg, num_consumer_wgs=3, tile_m=192, tile_n=160)
        if d == 128:
            cands["tile_n_256"] = replace(cfg, tile_n=256)
            # Three consumer WGs (160 registers each: S 48 + O 64 + P 12 at tile_n 96), so
            # two softmaxes run beside one warpgroup's GEMMs: the ping-pong softmax of one
            # warp per scheduler is bound by latency (docs/design.md, Fa3Config.row_chains).
            cands["wg3_n96"] = replace(cfg, num_consumer_wgs=3, tile_m=192, tile_n=96)
            # FA3's e4m3 tile (hopper/tile_size.h): 128 x 224, S 112 + O 64 + P 28 registers.
            cands["tile_n_224"] = replace(cfg, tile_n=224)
        if d == 256:
            cands["tile_n_64"] = replace(cfg, tile_n=64)
            cands["tile_n_112"] = replace(cfg, tile_n=112)
            cands["tile_n_128"] = replace(cfg, tile_n=128)  # FA3's: S 64 + O 128 + P 16
        # V transposed in shared memory by the producer WG instead of the host's Vᵀ copy
        # (`fp8_check --vt` times the user's whole call of both builds).
        cands["vt_smem"] = fp8_smem_transpose_config(d, False)
        # V's keys in slot order, so P needs no quad exchange (Fa3Config.permute_v_keys), with
        # V transposed on the host and in shared memory.
        cands["permuted_keys"] = replace(cfg, permute_v_keys=True)
        cands["vt_smem_permuted_keys"] = replace(cands["vt_smem"], permute_v_keys=True)
        # O's rescale skipped where no row of the warp moved its max (bit for bit the table's).
        cands["skip_unit_rescale"] = replace(cfg, skip_unit_rescale=True)
        # The in-place softmax's row max and sum in four dependency chains (Fa3Config.row_chains).
        cands["row_chains"] = replace(cfg, row_chains=True)
        if d in (64, 128, 256):
            out += [(n, d, c) for n, c in cands.items() if can_implement(c, d, FP8_DTYPE)[0]]
    return out


def bench_sweep(bench_one, describe) -> list[dict]:
    """`bench_one(d, n, causal)` over the lab's forward sweep (D 64 / 128 / 256, causal or not,
    N 8k / 16k); a failing point becomes a row with its error. `describe(row)` is printed
    after each point. What `fa3_ablate --bench` and `fa3_fp8_check --bench` time."""
    import traceback

    rows = []
    for d in (64, 128, 256):
        for causal in (False, True):
            for n in (8192, 16384):
                try:
                    r = bench_one(d, n, causal)
                except Exception as e:
                    r = {"D": d, "N": n, "causal": causal, "error": f"{type(e).__name__}: {e}"}
                    traceback.print_exc()
                print(f"[bench] {describe(r)}", flush=True)
                rows.append(r)
    return rows
