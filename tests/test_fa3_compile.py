"""fa3 compiles for sm_90a on a machine without a GPU, with the Hopper machinery in the PTX.

Every shipped config (configs.shipped_cases) in bf16, and in fp16 at two of them (the table
gives both 16-bit types one config, asserted below; `benchmarks.fa3_probe.ci_cases`), is
compiled by `python -m benchmarks.fa3_probe` in two subprocesses at once (the CuTe DSL reads
its CUTE_DSL_* settings at import, so the compile runs outside this interpreter); every
non-default flag variant
(benchmarks/fa3_variants.py flag_variants: 3 consumer warpgroups, the persistent scheduler old
and new: tile overlap with per-WG epilogues, balanced order) likewise by `--only-variants`
under the `lab` marker (deselected by default: `pytest -m lab`). Each config must
show wgmma, TMA loads and store, setmaxnreg and the named barriers in its PTX, with 0 spill
bytes and no serialised wgmma.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")

from benchmarks.fa3_probe import ci_cases
from benchmarks.fa3_variants import flag_variants
from flashsuite.fa3.configs import (
    SMEM_CAPACITY,
    can_implement,
    shipped_cases,
    shipped_configs,
    smem_bytes,
)
from tests.conftest import run_fa3_probe

SHARDS = 2  # the CI machine has 2 cores; each shard is one compiler process
CASES = shipped_cases() + flag_variants()


def _id(case) -> str:
    name, d, dt, causal, _ = case
    return f"{name}-D{d}-{str(dt).removeprefix('torch.')}-{'causal' if causal else 'full'}"


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict]:
    return run_fa3_probe(tmp_path_factory.mktemp("fa3_probe"), shards=SHARDS)


@pytest.fixture(scope="module")
def variant_probes(tmp_path_factory) -> dict[str, dict]:
    return run_fa3_probe(tmp_path_factory.mktemp("fa3_probe"), "--only-variants", shards=SHARDS)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_config_can_implement(case) -> None:
    _, d, dt, _, cfg = case
    ok, reason = can_implement(cfg, d, dt)
    assert ok, reason
    assert smem_bytes(cfg, d) <= SMEM_CAPACITY


@pytest.mark.parametrize("case", ci_cases(), ids=_id)
def test_compiles_with_hopper_machinery(case, probes) -> None:
    _check_machinery(case, probes)


@pytest.mark.lab
@pytest.mark.parametrize("case", flag_variants(), ids=_id)
def test_flag_variants_compile_with_hopper_machinery(case, variant_probes) -> None:
    _check_machinery(case, variant_probes)


def _check_machinery(case, probes: dict[str, dict]) -> None:
    cfg = case[4]
    r = probes[_id(case)]
    ptx = r["ptx"]
    assert ptx["wgmma"] > 0, "no wgmma.mma_async in the PTX"
    assert ptx["wgmma_rs"] > 0, "P·V is not an RS wgmma (P should come from registers)"
    assert ptx["tma_load"] > 0, "no cp.async.bulk.tensor load"
    if cfg.o_direct_store:  # O by the consumer threads' 16-byte stores, no TMA store
        assert ptx["tma_store"] == 0 and ptx["st_global_v4"] > 0, ptx
    else:
        assert ptx["tma_store"] > 0, "no cp.async.bulk.tensor store"
    assert ptx["setmaxnreg"] >= 2, "setmaxnreg dec/inc missing"
    assert ptx["stmatrix"] > 0, "epilogue does not use stmatrix"
    assert ptx["bar_sync"] > 0
    if cfg.pingpong:
        assert ptx["bar_arrive"] > 0, "ping-pong named-barrier arrives missing"
    assert r["registers"] is not None, "no ptxas report captured"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_lines"]
    # C7508: setmaxnreg ignored. C7512/C7515: every wgmma serialised (a silent 2x slowdown).
    # C7519: a warpgroup.arrive injected between wgmmas (P not packed in registers).
    for code in ("C7508", "C7512", "C7515", "C7519"):
        assert code not in r["remarks"], f"ptxas remark {code}: {r['ptxas_lines']}"


def test_dtype_table_covers_both_16bit_types() -> None:
    dtypes = {dt for _, dt, _, _ in shipped_configs()}
    assert dtypes == {torch.float16, torch.bfloat16}


def test_both_16bit_types_share_each_config() -> None:
    """What lets CI compile fp16 at two configs only (ci_cases): each shipped (name, head_dim,
    causal) has one config for fp16 and bf16. A dtype-specific entry fails here first."""
    by_case: dict[tuple, dict] = {}
    for name, d, dt, causal, cfg in shipped_cases():
        by_case.setdefault((name, d, causal), {})[dt] = cfg
    for case, cfgs in by_case.items():
        assert set(cfgs) == {torch.float16, torch.bfloat16}, case
        assert cfgs[torch.float16] == cfgs[torch.bfloat16], case
    cases = ci_cases()
    assert {c[2] for c in cases} == {torch.float16, torch.bfloat16}
    assert len([c for c in cases if c[2] == torch.bfloat16]) == len(by_case)


def test_flag_variants_cover_new_flags() -> None:
    cfgs = [c[4] for c in flag_variants()]
    assert any(c.num_consumer_wgs == 3 for c in cfgs)
    assert any(c.persistent for c in cfgs)
    overlap = [c for c in cfgs if c.overlap_tiles]
    # Both epilogues (per-WG slabs of a separate sO, sO on sQ), both main loops, 2 and 3 WGs.
    assert {c.o_alias_q for c in overlap} == {False, True}
    assert {c.intra_wg_overlap for c in overlap} == {False, True}
    assert {c.num_consumer_wgs for c in overlap} == {2, 3}
    assert all(c.balanced_order for c in overlap)


def test_shipped_persistent_entries_are_v2() -> None:
    """The persistent scheduler ships only as v2 (tile overlap + balanced order), only where it
    was measured faster: causal, every head_dim, short non-causal D = 64 and dense non-causal
    D = 128 (configs.get_config and configs.config_for quote the numbers)."""
    persistent = set()
    for name, d, _, causal, cfg in shipped_cases():
        if cfg.persistent:
            assert cfg.overlap_tiles and cfg.balanced_order, cfg
            persistent.add((name, d, causal))
        else:
            assert not (cfg.overlap_tiles or cfg.balanced_order), cfg
    causal = {("shipped", d, True) for d in (64, 96, 128, 192, 256)}
    # Short non-causal D = 64 (seqlen_k <= SHORT_SEQLEN_K) measured faster on v2 too; causal
    # D = 96's short build (128-row tiles) and causal D = 64's (two Q buffers) stay on it.
    short = {("shipped-short", 64, False), ("shipped-short", 96, True), ("shipped-short", 64, True)}
    # config_for's dense builds: Q in registers (D = 64 short, D = 128), D = 64's 8 MiB sections,
    # the causal tile counter and causal D = 256's 64-key tiles (configs._dense_choice).
    dense = {
        ("shipped-dense-1024", d, c) for d, c in ((64, 0), (128, 0), (64, 1), (128, 1), (256, 1))
    }
    dense |= {("shipped-dense-4096", d, c) for d, c in ((64, False), (64, True), (256, True))}
    assert persistent == causal | short | dense


def test_overlap_needs_persistent() -> None:
    cfg = shipped_configs()[0][3]
    ok, reason = can_implement(replace(cfg, overlap_tiles=True), 64, torch.bfloat16)
    assert not ok and "persistent" in reason


@pytest.mark.parametrize("case", [c for c in ci_cases() if c[4].overlap_tiles], ids=_id)
def test_overlap_epilogue_barriers(case, probes) -> None:
    """Tile overlap with a separate sO: each consumer WG syncs only its own 128 threads around
    its sO slab (no all-consumer EPILOGUE barrier), and the store's smem reads are waited for
    twice in the code: before the slab is written again and once after the last tile."""
    _check_overlap_barriers(case, probes)


@pytest.mark.lab
@pytest.mark.parametrize("case", [c for c in flag_variants() if c[4].overlap_tiles], ids=_id)
def test_flag_variants_overlap_epilogue_barriers(case, variant_probes) -> None:
    """`test_overlap_epilogue_barriers` for the flag variants (sO on sQ among them)."""
    _check_overlap_barriers(case, variant_probes)


def _check_overlap_barriers(case, probes: dict[str, dict]) -> None:
    ptx = probes[_id(case)]["ptx"]
    if case[4].o_alias_q:  # sO on sQ: the other WG's Q·Kᵀ must be done, all consumers sync
        assert ptx["bar_sync_epilogue_all"] > 0, ptx
    else:
        assert ptx["bar_sync_wg"] > 0 and ptx["bar_sync_epilogue_all"] == 0, ptx
        assert ptx["bulk_wait_read"] == 2, ptx


def test_short_keys_pick_their_own_config() -> None:
    """The key length picks the schedule only where measured (D = 64 and causal D = 96, short
    keys); every other entry is the same for any seqlen_k."""
    from flashsuite.fa3.configs import (
        SHORT_CAUSAL_SEQLEN_K,
        SHORT_CAUSAL_TWO_Q,
        SHORT_SEQLEN_K,
        get_config,
    )

    bf16 = torch.bfloat16
    short = get_config(64, bf16, False, SHORT_SEQLEN_K)
    assert short.persistent and short.overlap_tiles and short.q_stages == 2, short
    assert not get_config(64, bf16, False, SHORT_SEQLEN_K + 1).persistent
    assert get_config(64, bf16, False, None) == get_config(64, bf16, False, 16384)
    # Causal D = 64: the same entry with two Q buffers up to SHORT_CAUSAL_TWO_Q keys, which
    # covers the 1k and 2k keys they were measured faster at.
    n = SHORT_CAUSAL_TWO_Q[64]
    assert n >= 2048, n
    two, one = get_config(64, bf16, True, n), get_config(64, bf16, True, n + 1)
    assert two == replace(one, q_stages=2, o_alias_q=False) and two != one
    assert one == get_config(64, bf16, True, None)
    # Measured at 1k (128-row tiles ahead) and 2k (192-row tiles ahead): configs._tiles.
    short, tall = (get_config(96, bf16, True, n) for n in (1024, 2048))
    assert get_config(96, bf16, True, SHORT_CAUSAL_SEQLEN_K + 1) == tall
    assert (short.tile_m, short.num_consumer_wgs, short.tile_n) == (128, 2, 128), short
    assert short.persistent and not (short.skip_masked_wg or short.split_loops or short.wg_slice)
    assert (tall.tile_m, tall.num_consumer_wgs, tall.tile_n) == (192, 3, 112), tall
    assert tall.skip_masked_wg and tall.split_loops and tall.wg_slice and tall.persistent
    assert get_config(96, bf16, True, None) == tall == get_config(96, bf16, True, 16384)
    for d, dt, causal, cfg in shipped_configs():
        if (d, causal) not in ((64, False), (64, True), (96, True)):
            assert get_config(d, dt, causal, 512) == cfg == get_config(d, dt, causal, 16384)


def test_short_queries_take_the_shorter_row_tile_where_measured() -> None:
    """D = 96 runs 192-row tiles (three warpgroups) unless the query length fills them badly
    (N = 1k: 6 tiles for 5.3 of work), where the 128-row tile of two warpgroups measured
    faster (causal: on the persistent scheduler, as its short-key build); fp8 and the other
    head dims never switch."""
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.configs import FP8_DTYPE, config_for, get_config

    bf16 = torch.bfloat16

    def cfg(nq: int, d: int = 96, causal: bool = False, dt=bf16):
        q = torch.zeros(1, nq, 2, d, dtype=dt)
        k = torch.zeros(1, 2048, 2, d, dtype=dt)
        return config_for(check_inputs(q, k, k, causal=causal))

    tall = get_config(96, bf16, False)
    assert tall.tile_m == 192 and tall.num_consumer_wgs == 3
    for nq in (1, 100, 1000, 1024):
        assert (cfg(nq).tile_m, cfg(nq).num_consumer_wgs) == (128, 2), nq
    for nq in (192, 1536, 2048, 4096, 8192):
        assert cfg(nq) == tall, nq
    for nq in (100, 1024):
        assert cfg(nq, causal=True) == get_config(96, bf16, True, 1024), nq
    assert cfg(2048, causal=True) == get_config(96, bf16, True, 2048)
    assert get_config(96, bf16, True, 2048).tile_m == 192
    assert cfg(1024, d=64).tile_m == 192  # 2048 keys: the 8 MiB sections build (config_for)
    assert cfg(1024, dt=FP8_DTYPE) == get_config(96, FP8_DTYPE, False, 2048)
