"""The fa3 backward compiles for sm_90a on a machine without a GPU, with the Hopper machinery in
its PTX.

`benchmarks/fa3_bwd_probe.py` compiles every shipped (head_dim, causal) backward config (bf16,
and fp16 once) in two subprocesses at once (the CuTe DSL reads its CUTE_DSL_* settings at
import). Each must show the five GEMMs as wgmma (dV and dK with P^T and dS^T from registers),
TMA loads of K, V, Q, dO, LSE and D, setmaxnreg, the named barriers around sdS and sdQ, dQ
leaving through one cp.reduce.async.bulk of the writer warp (no atomics), dS^T stored by
stmatrix, and 0 spill bytes without serialised wgmma. The "det" variant (deterministic dQ
order, the build torch.use_deterministic_algorithms takes; benchmarks/fa3_bwd_variants.py) is
compiled at D = 64 non-causal and D = 128 causal and must add dQ with atomics between an
acquiring spin and a releasing increment of its turn counter, still spill-free; "det_pipe" (the
writer warp orders the adds) at D = 128 causal. The softcap builds (the shipped softcap config,
"warp_stm2") at those two points and D = 96 causal must take one tanh per score and stay
spill-free. "pipe80" (80-row Q tiles, dQ^T = K^T dS^T) at D = 128 non-causal must show its
m64n80k16 wgmmas and dQ^T's MN-major A, spill-free. The D = 256 variants with 64 and 80 keys
(wide256_n64_turn, wide256_red, wide256_red80, the last with a window too) must show their
wgmma shapes and dQ routes (two bulk reduces from a one-chunk sdQ, or 16 red.global.add.v4.f32
and no sdQ), spill-free; the red route's fragment placement is traced on the CPU. Every build's
highest SASS register must stay within setmaxnreg's 240. "pipe_wgs" and "wide256_wgs"
(wg_slice) go through `benchmarks/fa3_bwd_sass.py` next to their bases, D = 128 and 256
non-causal: (almost) no R2UR in the MMA loop's SASS, fewer instructions per row block, the same
wgmmas and elementwise code; "pipe_wgs_sout_ng" (lse_guard off) loses only the LSE's compare
and select.
Without compiling: the configs' limits, the dQ tile order's round trip, and the host path of
`bwd_host.run_backward` around a stand-in kernel that keeps the compiled one's arguments.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")

from flashsuite.fa3.bwd_configs import (
    BwdConfig,
    bwd_can_implement,
    bwd_config_for,
    bwd_shipped_configs,
    bwd_smem_bytes,
)
from flashsuite.fa3.configs import SMEM_CAPACITY

ROOT = Path(__file__).resolve().parents[1]
SHARDS = 2  # the CI machine has 2 cores; each shard is one compiler process


def _id(r: dict) -> str:
    return f"D{r['head_dim']}-{r['dtype']}-{'causal' if r['causal'] else 'full'}"


def _probe_in_parallel(out: Path, runs: list[list[str]]) -> list[dict]:
    """benchmarks.fa3_bwd_probe once per argument list, SHARDS compiler processes at a time
    (the CuTe DSL reads its CUTE_DSL_* settings at import: each run is its own process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}

    def run(i: int) -> list[dict]:
        path = out / f"run{i}.json"
        cmd = [sys.executable, "-m", "benchmarks.fa3_bwd_probe", *runs[i], "--json", str(path)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"probe {runs[i]} failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(path.read_text())

    with ThreadPoolExecutor(SHARDS) as pool:
        return [r for part in pool.map(run, range(len(runs))) for r in part]


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> list[dict]:
    runs = [["--shard", f"{i}/{SHARDS}"] for i in range(SHARDS)]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe"), runs)


@pytest.fixture(scope="module")
def det_probes(tmp_path_factory) -> list[dict]:
    """The "det" variant's (D 64, full) and (D 128, causal) builds."""
    runs = [["--variant", "det", "--shard", shard] for shard in ("0/4", "3/4")]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_det"), runs)


@pytest.fixture(scope="module")
def det_local_probes(tmp_path_factory) -> list[dict]:
    """The same builds with a sliding window (what torch.use_deterministic_algorithms takes
    for a windowed problem)."""
    runs = [["--variant", "det", "--local", "--shard", shard] for shard in ("0/4", "3/4")]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_det_local"), runs)


@pytest.fixture(scope="module")
def wide_probes(tmp_path_factory) -> list[dict]:
    """The "dkv_t" layout's deterministic builds (wide192_det, wide256_det: D 192 and 256,
    causal) and softcap builds (wide192_serial, wide256_serial with --softcap: full)."""
    runs = [
        ["--variant", "wide192_det", "--variant", "wide256_det", "--shard", "1/2"],
        ["--variant", "wide192_serial", "--variant", "wide256_serial", "--softcap"],
    ]
    runs[1] += ["--shard", "0/2"]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_wide"), runs)


@pytest.fixture(scope="module")
def det_pipe_probes(tmp_path_factory) -> list[dict]:
    """The "det_pipe" variant's (D 128, causal) build: the writer warp orders the dQ adds."""
    runs = [["--variant", "det_pipe", "--shard", "3/4"]]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_det_pipe"), runs)


@pytest.fixture(scope="module")
def dq_route_probes(tmp_path_factory) -> list[dict]:
    """pipe128_dqm_wgdq at (D 64, causal): dQ split by rows, handed over per warpgroup;
    pipe_wgdq at (D 128, full): the per-warpgroup hand-over with dQ split by columns."""
    runs = [
        ["--variant", "pipe128_dqm_wgdq", "--shard", "1/2"],
        ["--variant", "pipe_wgdq", "--shard", "2/4"],
    ]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_dq_route"), runs)


@pytest.fixture(scope="module")
def pipe80_probes(tmp_path_factory) -> list[dict]:
    """The pipe80 variant's one build (D 128, full): 80-row Q tiles, dQ^T = K^T dS^T."""
    runs = [["--variant", "pipe80"]]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_pipe80"), runs)


@pytest.fixture(scope="module")
def pdl_probes(tmp_path_factory) -> list[dict]:
    """pipe80_wgs_wgdq_tma_pdl's one build (D 128, full): the shipped non-causal D = 128
    config launched as a programmatic dependent of the preprocess."""
    runs = [["--variant", "pipe80_wgs_wgdq_tma_pdl"]]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_pdl"), runs)


@pytest.fixture(scope="module")
def wide256_dq_probes(tmp_path_factory) -> list[dict]:
    """D = 256's dQ routes beside the shipped one (wide256_red80_wgs, compiled with the shipped
    builds): wide256_n64_turn (full), 64 keys; wide256_red80, 80 keys, causal with a window."""
    runs = [
        ["--variant", "wide256_n64_turn", "--shard", "0/2"],
        ["--variant", "wide256_red80", "--local", "--shard", "1/2"],
    ]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_wide256_dq"), runs)


@pytest.fixture(scope="module")
def wg_slice_sass(tmp_path_factory) -> list[dict]:
    """benchmarks.fa3_bwd_sass on pipe_stm and pipe_wgs at (D 128, full) and on wide256 and
    wide256_wgs (D 256, full, the "dkv_t" layout): shipped configs with and without wg_slice;
    pipe_wgs_sout with and without the kernel's -inf LSE guard (lse_guard). (The D = 64 pair,
    pipe128_dqm and pipe128_dqm_wgs, is the same change: `python -m benchmarks.fa3_bwd_sass`.)"""
    out = tmp_path_factory.mktemp("fa3_bwd_sass")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    runs = [("pipe_stm", "pipe_wgs", "128"), ("wide256", "wide256_wgs", "256")]
    runs += [("pipe_wgs_sout", "pipe_wgs_sout_ng", "128")]

    def run(i: int) -> list[dict]:
        base, wgs, d = runs[i]
        path = out / f"run{i}.json"
        cmd = [sys.executable, "-m", "benchmarks.fa3_bwd_sass", "--variant", base, "--variant"]
        cmd += [wgs, "--head-dim", d, "--json", str(path)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"fa3_bwd_sass {runs[i]} failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(path.read_text())

    with ThreadPoolExecutor(SHARDS) as pool:
        return [r for part in pool.map(run, range(len(runs))) for r in part]


@pytest.fixture(scope="module")
def ds_stats_probes(tmp_path_factory) -> list[dict]:
    """scale_out and stats_regs against their bases: pipe128, pipe128_sout and
    pipe128_dqm_sout at (D 64, causal); pipe_stm, pipe_sout, pipe_sreg and pipe_sout_sreg at
    (D 128, causal); warp_stm2 and warp_stm2_sout with softcap at (D 128, causal)."""
    runs = [
        ["--variant", "pipe128", "--variant", "pipe128_sout", "--variant", "pipe128_dqm_sout"],
        ["--variant", "pipe_sout", "--variant", "pipe_sreg", "--variant", "pipe_sout_sreg"],
        ["--variant", "pipe_stm", "--shard", "5/6"],
        ["--variant", "warp_stm2", "--softcap", "--shard", "5/6"],
        ["--variant", "warp_stm2_sout", "--softcap", "--shard", "5/6"],
    ]
    runs[0] += ["--shard", "1/2"]
    runs[1] += ["--shard", "3/4"]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_ds_stats"), runs)


@pytest.fixture(scope="module")
def softcap_probes(tmp_path_factory) -> list[dict]:
    """The softcap builds of the shipped softcap config at (D 64, full), (D 96, causal) and
    (D 128, causal): warp_stm2's cases are (64, 96, 128) x (full, causal)."""
    shards = ("0/6", "3/6", "5/6")
    runs = [["--variant", "warp_stm2", "--softcap", "--shard", shard] for shard in shards]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_softcap"), runs)


@pytest.fixture(scope="module")
def local_probes(tmp_path_factory) -> list[dict]:
    """The sliding-window builds of the shipped configs at D 64 causal and D 256 causal
    ("dkv_t"), and D 128 full."""
    runs = [["--local", "--shard", "1/8"], ["--local", "--shard", "4/8"]]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_local"), runs)


@pytest.mark.parametrize("case", bwd_shipped_configs(), ids=lambda c: f"D{c[0]}-{c[1]}-{c[2]}")
def test_bwd_config_can_implement(case) -> None:
    d, dt, _, cfg = case
    ok, reason = bwd_can_implement(cfg, d, dt)
    assert ok, reason
    assert bwd_smem_bytes(cfg, d) <= SMEM_CAPACITY


def test_bwd_can_implement_refuses_with_reason() -> None:
    ok, reason = bwd_can_implement(BwdConfig(tile_n=192), 128, torch.bfloat16)
    assert not ok and "tile_n must be 128" in reason
    ok, reason = bwd_can_implement(BwdConfig(), 256, torch.bfloat16)  # the "sdp_t" layout
    assert not ok and "B of shared memory > 232448 B" in reason
    ok, reason = bwd_can_implement(BwdConfig(dq_mode="atomic", stages=1), 256, torch.bfloat16)
    assert not ok and "registers per MMA thread > 240" in reason
    ok, reason = bwd_can_implement(BwdConfig(), 80, torch.bfloat16)
    assert not ok and "head_dim 80" in reason
    wide = BwdConfig(layout="dkv_t", tile_n=48, do_stages=1, dq_mode="warp")
    assert bwd_can_implement(wide, 256, torch.bfloat16) == (True, "")
    ok, reason = bwd_can_implement(wide, 192, torch.bfloat16)  # 96 rows of D a WG
    assert not ok and "dkv_split 'd' gives each WG 96 rows" in reason
    ok, reason = bwd_can_implement(replace(wide, tile_n=40), 256, torch.bfloat16)
    assert not ok and "tile_n 40 must be a multiple of 16" in reason
    ok, reason = bwd_can_implement(replace(wide, tile_n=64), 256, torch.bfloat16)
    assert not ok and "shared memory" in reason
    ok, reason = bwd_can_implement(replace(wide, ds_store="stmatrix"), 256, torch.bfloat16)
    assert not ok and "ds_store 'scalar'" in reason
    ok, reason = bwd_can_implement(replace(wide, layout="sd"), 256, torch.bfloat16)
    assert not ok and "layout 'sd'" in reason
    ok, reason = bwd_can_implement(BwdConfig(do_stages=1), 128, torch.bfloat16)
    assert not ok and "one Q/dO ring" in reason
    ok, reason = bwd_can_implement(BwdConfig(tile_m=128), 64, torch.bfloat16)
    assert not ok and "tile_m 128 needs head_dim 64 and dq_mode 'warp'" in reason
    ok, reason = bwd_can_implement(BwdConfig(tile_m=96), 64, torch.bfloat16)
    assert not ok and "tile_m 96 not in (64, 80, 128)" in reason
    ok, reason = bwd_can_implement(BwdConfig(), 64, torch.float32)
    assert not ok and "dtype" in reason
    # dv_early reorders the overlapped "sdp_t" issue order: nothing else has it.
    ok, reason = bwd_can_implement(BwdConfig(dv_early=True), 128, torch.bfloat16)
    assert not ok and "dv_early needs layout 'sdp_t' and overlap" in reason
    ok, reason = bwd_can_implement(replace(wide, overlap=True, dv_early=True), 256, torch.bfloat16)
    assert not ok and "dv_early needs layout 'sdp_t' and overlap" in reason
    assert bwd_can_implement(BwdConfig(overlap=True, dv_early=True), 128, torch.bfloat16)[0]
    # dQ split by rows needs 64 rows per MMA warpgroup; the per-warpgroup hand-over needs the
    # writer warp and no turn order.
    warp128 = BwdConfig(tile_m=128, dq_mode="warp")
    assert bwd_can_implement(replace(warp128, dq_split="m"), 64, torch.bfloat16) == (True, "")
    ok, reason = bwd_can_implement(BwdConfig(dq_split="m"), 64, torch.bfloat16)
    assert not ok and "dq_split 'm' needs layout 'sdp_t' and tile_m 128" in reason
    ok, reason = bwd_can_implement(replace(wide, dq_split="m"), 256, torch.bfloat16)
    assert not ok and "dq_split 'm' needs layout 'sdp_t'" in reason
    ok, reason = bwd_can_implement(BwdConfig(dq_split="n"), 64, torch.bfloat16)
    assert not ok and "dq_split 'n' not in" in reason
    ok, reason = bwd_can_implement(BwdConfig(dq_handoff="wg"), 128, torch.bfloat16)
    assert not ok and "dq_handoff 'wg' needs dq_mode 'warp'" in reason
    det_warp = BwdConfig(dq_mode="warp", dq_handoff="wg", deterministic=True)
    ok, reason = bwd_can_implement(det_warp, 128, torch.bfloat16)
    assert not ok and "deterministic False" in reason
    ok, reason = bwd_can_implement(BwdConfig(dq_mode="warp", dq_handoff="cluster"), 128,
                                   torch.bfloat16)  # fmt: skip
    assert not ok and "dq_handoff 'cluster' not in" in reason
    # The scale out of dS and LSE / D in registers are "sdp_t" mechanisms; the registers
    # take 64-row tiles.
    for field in ("scale_out", "stats_regs", "lse_regs", "stats_shfl"):
        ok, reason = bwd_can_implement(replace(wide, **{field: True}), 256, torch.bfloat16)
        assert not ok and f"{field} True" in reason and "need layout 'sdp_t'" in reason
    # The shuffles take whole 64-row halves of the tile and replace the register routes.
    assert bwd_can_implement(replace(warp128, stats_shfl=True), 64, torch.bfloat16) == (True, "")
    for bad, d in ((dict(tile_m=80, dq_split="dt"), 128), (dict(lse_regs=True), 64),
                   (dict(dv_early=True, overlap=True), 64)):  # fmt: skip
        ok, reason = bwd_can_implement(replace(warp128, stats_shfl=True, **bad), d, torch.bfloat16)
        assert not ok and "stats_shfl needs tile_m a multiple of 64" in reason, (bad, reason)
    for field in ("stats_regs", "lse_regs"):
        ok, reason = bwd_can_implement(replace(warp128, **{field: True}), 64, torch.bfloat16)
        assert not ok and f"{field} needs tile_m 64 (registers), not 128" in reason
    assert bwd_can_implement(replace(warp128, scale_out=True), 64, torch.bfloat16) == (True, "")


def test_bwd_tile_m80_limits() -> None:
    """The 80-row tile: D = 128 with dQ computed as dQ^T through the writer warp, for dense
    problems without a window, causal or not; everything else is refused with the reason."""
    from benchmarks.fa3_bwd_variants import variant

    bf16 = torch.bfloat16
    pipe80 = variant("pipe80")
    assert bwd_can_implement(pipe80, 128, bf16) == (True, "")
    # 226 KiB: Q, dO 2 x 2 x 20 + K, V 2 x 32 + sdS 2 x 20 + sdQ 40 + 2 (96-float LSE / D stages)
    assert bwd_smem_bytes(pipe80, 128) == 226 * 1024 <= SMEM_CAPACITY
    assert bwd_can_implement(pipe80, 128, bf16, causal=True) == (True, "")
    for flag, what in (("local", "a sliding window"), ("varlen", "varlen")):
        ok, reason = bwd_can_implement(pipe80, 128, bf16, **{flag: True})
        assert not ok and f"built for dense problems without a window, not {what}" in reason
    ok, reason = bwd_can_implement(replace(pipe80, deterministic=True), 128, bf16)
    assert not ok and "tile_m 80 needs deterministic False" in reason
    ok, reason = bwd_can_implement(pipe80, 64, bf16)
    assert not ok and "tile_m 80 needs head_dim 128 and dq_split 'dt', not 64" in reason
    ok, reason = bwd_can_implement(replace(pipe80, dq_split="d"), 128, bf16)
    assert not ok and "tile_m 80 needs head_dim 128 and dq_split 'dt', not 128 and 'd'" in reason
    ok, reason = bwd_can_implement(replace(pipe80, tile_m=64), 128, bf16)
    assert not ok and "dq_split 'dt' needs layout 'sdp_t', tile_m 80 and dq_mode 'warp'" in reason
    ok, reason = bwd_can_implement(replace(pipe80, dq_mode="atomic"), 128, bf16)
    assert not ok and "not 'sdp_t', 80 and 'atomic'" in reason


def test_bwd_tile_m80_refused_for_windowed_and_packed_problems() -> None:
    """interface._bwd_key and the kernel's constructor refuse the 80-row tile where it is not
    built: windowed and packed problems (causal ones take it)."""
    import cutlass

    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.bwd_kernel import Fa3Backward
    from flashsuite.fa3.interface import _bwd_key

    pipe80 = variant("pipe80")
    q = torch.empty(1, 160, 2, 128, dtype=torch.bfloat16)
    assert _bwd_key(check_inputs(q, q, q), pipe80, varlen=False).cfg == pipe80
    assert _bwd_key(check_inputs(q, q, q, causal=True), pipe80, varlen=False).cfg == pipe80
    with pytest.raises(ValueError, match=r"cannot run: .*not a sliding window"):
        _bwd_key(check_inputs(q, q, q, window_size=(64, 64)), pipe80, varlen=False)
    with pytest.raises(ValueError, match=r"cannot run: .*not varlen"):
        _bwd_key(check_inputs(q, q, q), pipe80, varlen=True)
    for causal, local, varlen in ((True, True, False), (False, True, False), (False, False, True)):
        with pytest.raises(ValueError, match="tile_m 80 needs dq_split 'dt' and a dense"):
            Fa3Backward(cutlass.BFloat16, 128, pipe80, causal, local=local, varlen=varlen)
    Fa3Backward(cutlass.BFloat16, 128, pipe80, True)  # causal: built


@pytest.mark.parametrize(
    ("n_blocks", "pairs", "section"), [(64, 32, 4), (8, 256, 16), (7, 10, 4), (5, 3, 8), (1, 1, 2)]
)
def test_head_section_order_visits_every_cta_once(n_blocks, pairs, section) -> None:
    """BwdConfig.head_section's grid order (bwd_blocks.section_tile): every (column block,
    (kv head, batch) pair) exactly once; sections one after another, and within a section the
    column blocks in order (column block 0 of each of its pairs first), a narrower last
    section included."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")
    from flashsuite.fa3.bwd_blocks import section_tile

    tiles = [section_tile(bid, n_blocks, pairs, section) for bid in range(n_blocks * pairs)]
    assert sorted(tiles) == [(n, p) for n in range(n_blocks) for p in range(pairs)]
    for (n_a, p_a), (n_b, p_b) in itertools.pairwise(tiles):
        assert p_b // section > p_a // section or (p_b // section == p_a // section and n_b >= n_a)


def test_head_section_is_refused_where_its_order_does_not_apply() -> None:
    """head_section with lpt, deterministic dQ or packed sequences is refused by name."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")
    import cutlass

    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.fa3.bwd_kernel import Fa3Backward

    sec = variant("pipe_sec4_tma")
    for bad in (replace(sec, lpt=True), replace(sec, head_section=-1)):
        with pytest.raises(ValueError, match="head_section expected >= 0 and not with lpt"):
            Fa3Backward(cutlass.BFloat16, 128, bad, True)
    with pytest.raises(ValueError, match="varlen takes neither lpt nor head_section"):
        Fa3Backward(cutlass.BFloat16, 128, sec, True, varlen=True)
    Fa3Backward(cutlass.BFloat16, 128, sec, True)  # built


def _expected_wgmma(d: int, cfg: dict) -> tuple[int, int]:
    """(wgmma, RS wgmma) instructions in the unrolled loop body of one row block: every k-step
    of every m64 atom of the five GEMMs is one instruction."""
    tm, tn, w = cfg["tile_m"], cfg["tile_n"], cfg["num_mma_wgs"]
    dq = tn // 16 * tm // 64 * cfg["dq_slices"]  # K = the keys, an m64 atom per 64 rows
    if cfg["dq_split"] in ("m", "dt"):  # each warpgroup one m64 atom (its rows, or its D)
        dq = tn // 16
    if cfg["layout"] == "dkv_t":
        # S and dP (D/16 k-steps), dV^T and dK^T (tile_m/16 k-steps per m64 atom of D a WG
        # holds: D / w / 64 when the WGs split D, D / 64 when they split the keys), all SS.
        atoms = d // w // 64 if cfg["dkv_split"] == "d" else d // 64
        return 2 * d // 16 + 2 * tm // 16 * atoms + dq, 0
    # S^T and dP^T (D/16 k-steps each), dV and dK (tile_m/16 each, RS).
    return 2 * d // 16 + 2 * tm // 16 + dq, 2 * tm // 16


def _assert_shipped_dq_route(ptx: dict, d: int, cfg: dict, where: str) -> None:
    """The shipped builds' dQ routes in the PTX."""
    if cfg["dq_mode"] == "red":
        # D = 256: the MMA threads add dQ themselves, 16 red.global.add.v4.f32 (64 registers
        # in two slices), no sdQ, no writer-warp barriers, no bulk reduce.
        assert cfg["layout"] == "dkv_t" and d == 256, where
        route = (ptx["dq_red_v4"], ptx["dq_bulk"], ptx["dq_atomic"], ptx["st_shared_v4"])
        assert route == (16, 0, 0, 0), f"{where}: dQ route {ptx}"
        return
    # DS_READY (two sdS buffers: no DS_FREE); DQ_EMPTY / DQ_FULL between the MMA threads and
    # the writer warp, which adds each tile with one bulk reduce, or (dq_handoff "wg", causal
    # D = 128) each warpgroup's chunk with its own, behind that warpgroup's barrier pair.
    per_wg = cfg["dq_handoff"] == "wg"
    assert ptx["bar_sync"] >= 3 + per_wg and ptx["bar_arrive"] >= 3 + 2 * per_wg, where
    bulk = 2 if per_wg else 1
    assert ptx["dq_bulk"] == bulk and ptx["dq_atomic"] == 0, f"{where}: dQ route {ptx}"


def test_bwd_compiles_with_hopper_machinery(probes) -> None:
    seen = {(r["head_dim"], r["causal"]) for r in probes}
    shipped = {(d, c) for d, _, c, _ in bwd_shipped_configs()}
    assert seen == shipped, f"compiled {sorted(seen)}, shipped {sorted(shipped)}"
    for r in probes:
        ptx, d, cfg = r["ptx"], r["head_dim"], r["config"]
        where = _id(r)
        expected, rs = _expected_wgmma(d, cfg)
        assert ptx["wgmma"] == expected, f"{where}: {ptx['wgmma']} wgmma, expected {expected}"
        assert ptx["wgmma_rs"] == rs, f"{where}: {ptx['wgmma_rs']} RS wgmma, expected {rs}"
        # K, V, Q, dO (one copy per 64-column swizzle atom at D = 128) and LSE, D.
        assert ptx["tma_load"] >= 6, f"{where}: {ptx['tma_load']} cp.async.bulk.tensor loads"
        assert ptx["setmaxnreg"] == 2, f"{where}: setmaxnreg missing"
        _assert_shipped_dq_route(ptx, d, cfg, where)
        if cfg["layout"] == "dkv_t":
            # P and dS by plain stores; dK and dV leave through sK / sV by TMA stores (one per
            # swizzle-atom column block of each), after the DS_FREE / DS_READY pair.
            assert ptx["stmatrix"] == 0 and ptx["tma_store"] >= 2, f"{where}: {ptx}"
            assert ptx["bar_sync"] >= 5, f"{where}: the epilogue's barriers are missing"
        else:  # dS^T by stmatrix.x4; dK and dV through sK / sV by TMA stores (dkv_tma)
            assert ptx["stmatrix"] == cfg["tile_m"] // 16, f"{where}: {ptx['stmatrix']} stmatrix"
            assert cfg["dkv_tma"] and ptx["tma_store"] >= 2, f"{where}: {ptx}"
        assert ptx["sem_acquire"] == 0 and ptx["sem_release"] == 0, f"{where}: dQ turn counter"
        assert ptx["tanh"] == 0 and not r["softcap"], f"{where}: softcap code in a plain build"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        # C7508: setmaxnreg ignored. C7512/C7515: every wgmma serialised.
        for code in ("C7508", "C7512", "C7515", "C7519"):
            assert code not in r["remarks"], f"{where}: ptxas remark {code}"


def _assert_fits_registers(r: dict) -> None:
    """The SASS's highest register (R0 .. R239) within the MMA warpgroups' setmaxnreg 240."""
    assert r["max_reg"] is not None, f"{_id(r)}: no cubin or no nvdisasm to read registers"
    assert r["max_reg"] < 240, f"{_id(r)}: R{r['max_reg']} past the 240 registers of setmaxnreg"


@pytest.mark.parametrize("which", ["det_probes", "det_local_probes"])
def test_bwd_deterministic_variant_compiles(which, request) -> None:
    """The ordered-dQ builds, without and with a window: the loop's wgmma, one f32 atomic per
    dQ fragment element between the turn's acquiring spin and its release, spill-free."""
    det_probes = request.getfixturevalue(which)
    assert {(r["head_dim"], r["causal"]) for r in det_probes} == {(64, False), (128, True)}
    for r in det_probes:
        ptx, d, where, cfg = r["ptx"], r["head_dim"], _id(r), r["config"]
        assert cfg["deterministic"] and cfg["dq_mode"] == "atomic", where
        expected = 2 * d // 16 + 2 * 64 // 16 + 128 // 16
        assert ptx["wgmma"] == expected, f"{where}: {ptx['wgmma']} wgmma, expected {expected}"
        # dQ: one f32 atomic per C-fragment element (TILE_M x D / 2 WGs / 128 threads).
        assert ptx["dq_atomic"] == 64 * d // 256 and ptx["dq_bulk"] == 0, f"{where}: {ptx}"
        # The spin (an acquiring load, possibly peeled once by the compiler) and one release.
        assert ptx["sem_acquire"] >= 1 and ptx["sem_release"] == 1, f"{where}: {ptx}"
        # DS_FREE, DS_READY, DQ_TURN and DQ_ADDED.
        assert ptx["bar_sync"] >= 4, f"{where}: the turn barriers are missing"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        for code in ("C7508", "C7512", "C7515", "C7519"):
            assert code not in r["remarks"], f"{where}: ptxas remark {code}"


@pytest.fixture(scope="module")
def section_probes(tmp_path_factory) -> list[dict]:
    """head_section's D 256 causal build with sections of 8 (wide256_red80_wgs_sec8; the
    shipped probes compile the sectioned D 64, 128 and 256 ones, the last with 4)."""
    runs = [["--variant", "wide256_red80_wgs_sec8", "--shard", "1/2"]]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_section"), runs)


def test_bwd_head_section_variant_compiles(section_probes) -> None:
    """The sectioned grid order changes only the CTA's coordinates: the loop's 58 wgmma of
    the shipped D 256 config, no spills, no serialisation remarks."""
    ((r),) = section_probes
    where = _id(r)
    assert (r["head_dim"], r["causal"]) == (256, True) and r["config"]["head_section"] == 8
    assert r["ptx"]["wgmma"] == 58, where
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
    _assert_fits_registers(r)
    for code in ("C7508", "C7512", "C7515", "C7519"):
        assert code not in r["remarks"], f"{where}: ptxas remark {code}"


def test_bwd_deterministic_writer_warp_compiles(det_pipe_probes) -> None:
    """det_pipe: one acquiring spin (possibly peeled), one bulk reduce, one release, and an
    async-proxy fence on each side of the bulk copy, all in the writer warp; no atomics;
    spill-free."""
    ((r),) = det_pipe_probes
    ptx, where = r["ptx"], _id(r)
    assert (r["head_dim"], r["causal"]) == (128, True), where
    assert r["config"]["deterministic"] and r["config"]["dq_mode"] == "warp", where
    assert ptx["sem_acquire"] >= 1 and ptx["sem_release"] == 1, f"{where}: {ptx}"
    assert ptx["fence_async_global"] == 2 and ptx["dq_bulk"] == 1, f"{where}: {ptx}"
    assert ptx["dq_atomic"] == 0, f"{where}: {ptx}"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
    _assert_fits_registers(r)


@pytest.mark.lab
def test_bwd_dq_routes_compile(dq_route_probes) -> None:
    """The dq_split / dq_handoff variants: with dq_split "m" dQ is one m64 atom per warpgroup
    (tile_n / 16 wgmmas, not twice as many of half the N); with dq_handoff "wg" the writer warp
    issues one bulk reduce per warpgroup (2) and no atomics; spill-free within 240 registers."""
    seen = {(r["config"]["dq_split"], r["head_dim"], r["causal"]) for r in dq_route_probes}
    assert seen == {("m", 64, True), ("d", 128, False)}, seen
    for r in dq_route_probes:
        ptx, d, cfg, where = r["ptx"], r["head_dim"], r["config"], _id(r)
        assert cfg["dq_handoff"] == "wg" and cfg["dq_mode"] == "warp", where
        expected, rs = _expected_wgmma(d, cfg)
        assert ptx["wgmma"] == expected, f"{where}: {ptx['wgmma']} wgmma, expected {expected}"
        assert ptx["wgmma_rs"] == rs, f"{where}: {ptx['wgmma_rs']} RS wgmma, expected {rs}"
        assert ptx["dq_bulk"] == 2 and ptx["dq_atomic"] == 0, f"{where}: dQ route {ptx}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        for code in ("C7508", "C7512", "C7515", "C7519"):
            assert code not in r["remarks"], f"{where}: ptxas remark {code}"


@pytest.mark.lab
def test_bwd_tile_m80_compiles(pipe80_probes) -> None:
    """pipe80: S^T and dP^T as 8 m64n80k16 each (both operands K-major), dV and dK as 5 RS
    m64n128k16 each (K = 80 rows; B MN-major), dQ^T = K^T dS^T as 8 m64n80k16 with A (sK) read
    MN-major; the sdQ tile written with one st.shared.v4 per 4 fragment registers (40 fp32:
    10) and added by one bulk reduce; 0 spills within 240 registers."""
    ((r),) = pipe80_probes
    ptx, cfg, where = r["ptx"], r["config"], _id(r)
    assert (r["head_dim"], r["causal"], cfg["tile_m"], cfg["dq_split"]) == (128, False, 80, "dt")
    shapes = {"m64n80k16.ss.t00": 16, "m64n128k16.rs.t1": 10, "m64n80k16.ss.t10": 8}
    assert ptx["wgmma_shapes"] == shapes, f"{where}: {ptx['wgmma_shapes']}"
    assert (ptx["wgmma"], ptx["wgmma_rs"]) == _expected_wgmma(128, cfg), where
    assert ptx["dq_bulk"] == 1 and ptx["dq_atomic"] == 0, f"{where}: dQ route {ptx}"
    assert ptx["st_shared_v4"] == 10 and ptx["stmatrix"] == 5, f"{where}: {ptx}"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
    _assert_fits_registers(r)
    for code in ("C7508", "C7512", "C7515", "C7519"):
        assert code not in r["remarks"], f"{where}: ptxas remark {code}"


@pytest.mark.lab
def test_bwd_pdl_waits_for_the_preprocess(pdl_probes, probes) -> None:
    """BwdConfig.pdl: griddepcontrol.wait twice (every warp but the loader at the CTA's start;
    the loader after its K / V loads, before the first LSE / D load) and one
    launch_dependents; the same wgmmas, 0 spills. Builds without it carry neither."""
    ((r),) = pdl_probes
    ptx, where = r["ptx"], _id(r)
    assert r["config"]["pdl"], where
    assert (ptx["griddep_wait"], ptx["griddep_launch"]) == (2, 1), f"{where}: {ptx}"
    assert (ptx["wgmma"], ptx["wgmma_rs"]) == _expected_wgmma(128, r["config"]), where
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
    _assert_fits_registers(r)
    for p in probes:
        if not p["config"]["pdl"]:
            assert p["ptx"]["griddep_wait"] == p["ptx"]["griddep_launch"] == 0, _id(p)


@pytest.mark.lab
def test_bwd_wide256_dq_routes_compile(wide256_dq_probes) -> None:
    """The D = 256 variants with 64 and 80 keys: S and dP as m64n(tile_n/2)k16, dV^T and dK^T
    as m64n(tile_n)k16 over both operands' MN-major views, dQ as m64n128k16 (m64n64k16 per
    slice with dq_slices 2). dq_handoff "turn": the 64 fragment registers to sdQ with 16
    st.shared.v4 and one bulk reduce per warpgroup's turn (2), no red; dq_mode "red": 16
    red.global.add.v4.f32 (one per 4 of dQ's 64 registers, in one piece or in two slices of
    32), no sdQ store and no bulk reduce; TMA loads and stores and setmaxnreg as shipped;
    0 spills within 240 registers, no wgmma serialised."""
    seen = {
        (r["config"]["tile_n"], r["config"]["dq_mode"], r["causal"], r["local"])
        for r in wide256_dq_probes
    }
    assert seen == {(64, "warp", False, False), (80, "red", True, True)}
    for r in wide256_dq_probes:
        ptx, cfg, where = r["ptx"], r["config"], _id(r)
        tn, slices = cfg["tile_n"], cfg["dq_slices"]
        assert r["head_dim"] == 256 and cfg["layout"] == "dkv_t", where
        shapes = {
            f"m64n{tn // 2}k16.ss.t00": 32,  # S, dP: 16 k-steps over D each
            f"m64n{tn}k16.ss.t11": 16,  # dV^T, dK^T: 2 atoms of D x 4 k-steps each
            f"m64n{128 // slices}k16.ss.t01": tn // 16 * slices,  # dQ: K = the keys
        }
        assert ptx["wgmma_shapes"] == shapes, f"{where}: {ptx['wgmma_shapes']}"
        assert (ptx["wgmma"], ptx["wgmma_rs"]) == _expected_wgmma(256, cfg), where
        assert ptx["dq_atomic"] == 0, f"{where}: {ptx}"
        if cfg["dq_mode"] == "red":
            assert (ptx["dq_red_v4"], ptx["dq_bulk"], ptx["st_shared_v4"]) == (16, 0, 0), where
        else:
            assert cfg["dq_handoff"] == "turn", where
            assert (ptx["dq_red_v4"], ptx["dq_bulk"], ptx["st_shared_v4"]) == (0, 2, 16), where
        assert ptx["tma_load"] >= 6 and ptx["tma_store"] >= 2, f"{where}: {ptx}"
        assert ptx["setmaxnreg"] == 2, where
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        for code in ("C7508", "C7512", "C7515", "C7519"):
            assert code not in r["remarks"], f"{where}: ptxas remark {code}"


def test_bwd_wide256_dq_route_limits() -> None:
    """What the D = 256 dQ routes are built for, and each refusal's reason: the shrunk sdQ
    (one warpgroup's chunk) and the red route's missing sdQ in the shared-memory sum; red and
    dq_slices outside their layout, order and split; 80 keys without slices past the
    registers."""
    from benchmarks.fa3_bwd_variants import variant

    bf16, kib = torch.bfloat16, 1024
    turn, red, red80 = (variant(n) for n in ("wide256_n64_turn", "wide256_red", "wide256_red80"))
    # Q 2 x 32 + dO 32 + K, V 2 x 32 + sP, sdS 2 x 8 + sdQ 32 (64 x 256 / 2 fp32) + 1 = 209 KiB;
    # without sdQ 178 KiB, 198 KiB at 80 keys (K, V 2 x 40, sP, sdS 2 x 10).
    assert bwd_smem_bytes(turn, 256) == 209 * kib
    assert bwd_smem_bytes(replace(turn, dq_handoff="cta"), 256) == 241 * kib
    assert (bwd_smem_bytes(red, 256), bwd_smem_bytes(red80, 256)) == (178 * kib, 198 * kib)
    for cfg in (turn, red, red80):
        assert bwd_can_implement(cfg, 256, bf16) == (True, "")
    ok, reason = bwd_can_implement(replace(turn, dq_handoff="cta"), 256, bf16)
    assert not ok and "shared memory" in reason
    ok, reason = bwd_can_implement(replace(turn, dq_mode="atomic"), 256, bf16)
    assert not ok and "dq_handoff 'turn' needs dq_mode 'warp'" in reason
    ok, reason = bwd_can_implement(replace(red, deterministic=True), 256, bf16)
    assert not ok and "dq_mode 'red' needs deterministic False" in reason
    pipe80 = variant("pipe80")
    ok, reason = bwd_can_implement(replace(pipe80, dq_mode="red"), 128, bf16)
    assert not ok and "dq_split 'dt' needs" in reason and "not 'sdp_t', 80 and 'red'" in reason
    ok, reason = bwd_can_implement(replace(red80, dq_slices=1), 256, bf16)
    assert not ok and "~248 registers per MMA thread > 240" in reason
    ok, reason = bwd_can_implement(replace(red80, dq_slices=3), 256, bf16)
    assert not ok and "dq_slices 3 not in (1, 2)" in reason
    ok, reason = bwd_can_implement(replace(red80, dq_mode="warp"), 256, bf16)
    assert not ok and "dq_slices 2 needs layout 'dkv_t' and dq_mode 'red'" in reason
    wide192 = replace(variant("wide192"), dq_mode="red", dq_slices=2)
    ok, reason = bwd_can_implement(wide192, 192, bf16)
    assert not ok and "each WG 48 columns of D per slice" in reason
    ok, reason = bwd_can_implement(replace(red80, tile_n=96), 256, bf16)
    assert not ok and "registers per MMA thread > 240" in reason


@pytest.mark.parametrize(("tile_m", "head_dim", "split"), [(64, 256, "d"), (128, 64, "m"),
                                                             (80, 128, "dt")])  # fmt: skip
def test_sdq_turn_layout_overlays_the_chunks(tile_m: int, head_dim: int, split: str) -> None:
    """dq_handoff "turn": sdQ's layout (dq_tile_modes with one_chunk) puts every warpgroup's
    chunk at offset 0 of one chunk of smem, each in the accumulator's order, so the chunk a
    warpgroup stores is the one the writer's bulk reduce adds at its place."""
    from flashsuite.fa3.bwd_configs import dq_tile_modes

    def offsets(shape, stride, n) -> torch.Tensor:  # CuTe's colexicographic decomposition
        idx, off = torch.arange(n), torch.zeros(n, dtype=torch.long)
        for size, st in zip(shape, stride, strict=True):
            off, idx = off + (idx % size) * st, idx // size
        return off

    def tile(one_chunk: bool) -> torch.Tensor:
        (rows, cols), (rs, cs) = dq_tile_modes(tile_m, head_dim, 2, split, one_chunk)
        return offsets(rows, rs, tile_m)[:, None] + offsets(cols, cs, head_dim)[None, :]

    full, one, chunk = tile(False), tile(True), tile_m * head_dim // 2
    assert torch.equal(one, full % chunk)
    wg0 = full < chunk  # warpgroup 0's chunk is the first one: the overlay is the identity there
    assert torch.equal(one[wg0], full[wg0]) and sorted(one[~wg0].tolist()) == list(range(chunk))


# Run from a file in a child process (CUTE_DSL_ARCH is read at import; the DSL compiles from a
# function's source): trace the dQ MMA of the wide256_red (64 keys, dQ in one piece) and
# wide256_red80 (80 keys, two slices) kernels and print, for every MMA thread, the (row,
# column) of each fragment register, as `BwdDq.red_dq` places it: slice c's columns shifted by
# c x D / DQ_SLICES.
_DQ_FRAGMENT_CHILD = """
import json
import cutlass
import cutlass.cute as cute

from benchmarks.fa3_bwd_variants import variant
from flashsuite.fa3.bwd_kernel import Fa3Backward

fragments = {}


def flat(t):
    return [x for e in t for x in flat(e)] if isinstance(t, tuple) else [t]


def static_modes(crd):
    # A thread's slice of an identity tensor is static: its first coordinate, and per mode of
    # its layout the extent and the step, a multiple of one coordinate's unit (CuTe's
    # ScaledBasis). Read here once a thread rather than element by element in the trace.
    modes = []
    for size, step in zip(flat(crd.layout.shape), flat(crd.layout.stride)):
        if size == 1:
            modes.append((1, 0, 0))
            continue
        assert isinstance(step, cute.ScaledBasis) and len(step.mode) == 1, step
        modes.append((size, *(step.value if step.mode == [m] else 0 for m in (0, 1))))
    return tuple(crd.iterator), modes


@cute.jit
def trace(kernel: cutlass.Constexpr, name: cutlass.Constexpr[str]):
    mma_dq = kernel._make_mmas()[2]
    width = kernel.HEAD_DIM // kernel.DQ_SLICES
    for tid in cutlass.range_constexpr(kernel.MMA_THREADS):
        crd = mma_dq.get_slice(tid).partition_C(cute.make_identity_tensor((64, width)))
        fragments[name].append((tid, width, kernel.DQ_SLICES, *static_modes(crd)))


out = {}
for name in ("wide256_red", "wide256_red80"):
    fragments[name] = []
    trace(Fa3Backward(cutlass.BFloat16, 256, variant(name), False), name)
    out[name] = []
    for tid, width, slices, (row0, col0), modes in fragments[name]:
        count = 1
        for size, _, _ in modes:
            count *= size
        for c in range(slices):
            for i in range(count):  # CuTe's colexicographic order of the fragment's elements
                row, col, n = row0, col0, i
                for size, drow, dcol in modes:
                    n, k = divmod(n, size)
                    row, col = row + k * drow, col + k * dcol
                out[name].append((tid, c, i, row, col + c * width))
print(json.dumps(out))
"""


def test_red_dq_covers_the_tile_in_whole_sectors(tmp_path) -> None:
    """dq_mode "red" at D = 256, in one piece (dQ's m64n128 per warpgroup) or in two slices
    (m64n64): the fragment's registers, placed by dq_tile_modes, hit every offset of the
    64 x 256 tile once; each group of 4 registers (one red.global.add.v4.f32) is 16
    contiguous, 16-byte-aligned bytes, and a warp's 32 lanes cover 512 contiguous bytes.
    In one piece, warpgroup g's registers land in chunk g (the chunk the writer's bulk reduce
    adds from a "turn" sdQ; the same dQ MMA at 64 keys); in slices, slice c of warpgroup g at
    columns c D / 2 + g D / 4 + [0, D / 4), a quarter of both chunks each."""
    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.fa3.bwd_configs import dq_tile_modes

    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": path}  # ROOT: `benchmarks`
    child = tmp_path / "dq_fragment.py"
    child.write_text(_DQ_FRAGMENT_CHILD)
    cmd = [sys.executable, str(child)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traced = json.loads(proc.stdout.strip().splitlines()[-1])
    (rows, cols), (rs, cs) = dq_tile_modes(64, 256, 2, "d")

    def offset(n: int, shape, stride) -> int:  # CuTe's colexicographic decomposition
        off = 0
        for size, st in zip(shape, stride, strict=True):
            off, n = off + (n % size) * st, n // size
        return off

    chunk = 64 * 256 // 2
    for name, regs in traced.items():
        off = {(t, c, i): offset(r, rows, rs) + offset(col, cols, cs) for t, c, i, r, col in regs}
        assert sorted(off.values()) == list(range(64 * 256)), f"{name}: not a bijection"
        slices = variant(name).dq_slices
        for (t, c, i), o in off.items():
            if slices == 1:  # warpgroup g's registers, all in chunk g
                assert o // chunk == t // 128, (t, i, o)
            if i % 4 == 0:
                assert o % 4 == 0, (slices, t, c, i, o)
                assert [off[t, c, i + k] for k in range(4)] == list(range(o, o + 4))
                if t % 32 == 0:  # lane 0: the warp's 32 v4 groups, 128 floats from here
                    warp = sorted(off[t + lane, c, i] for lane in range(32))
                    assert warp == list(range(o, o + 128, 4)) and o % 128 == 0, (slices, t, i)


@pytest.mark.lab
def test_bwd_scale_out_and_stats_regs_compile(ds_stats_probes) -> None:
    """scale_out drops the softmax-scale multiply of every dS^T element (TILE_M / 2 per thread
    and row block) and adds D / 2 on dK's epilogue, softcap builds included (their tanh per
    score kept); stats_regs issues every LSE / D load of the row block (TILE_M / 8 v2 loads
    each) between S^T's wgmma and its wait, where the base issues none. Same wgmmas, 0 spills,
    within 240 registers."""
    by = {}
    for r in ds_stats_probes:
        c = r["config"]
        by[(c["tile_m"], c["dq_split"], c["scale_out"], c["stats_regs"], r["softcap"])] = r
    assert len(by) == 9 and all(r["causal"] for r in ds_stats_probes), sorted(by)
    for (tm, split, sout, sreg, cap), r in by.items():
        ptx, d, where = r["ptx"], r["head_dim"], _id(r)
        assert d == (64 if tm == 128 else 128), where
        assert (ptx["wgmma"], ptx["wgmma_rs"]) == _expected_wgmma(d, r["config"]), where
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        base = by[(tm, "d", False, False, cap)]
        want = base["ptx"]["mul_f32"] + ((d - tm) // 2 if sout else 0)
        if split == "d":
            assert ptx["mul_f32"] == want, f"{where} {r['config']}: {ptx['mul_f32']} != {want}"
        assert ptx["lds_under_gemm"] == (tm // 4 if sreg else 0), f"{where}: {ptx}"
        assert ptx["tanh"] == base["ptx"]["tanh"] == (tm // 2 if cap else 0), where


@pytest.mark.lab
def test_bwd_wg_slice_compiles(wg_slice_sass) -> None:
    """wg_slice partitions the smem operands with the warpgroup's (warp-uniform) slice: in the
    SASS of the MMA warpgroups' row-block loop no descriptor crosses from a vector register
    (R2UR; "dkv_t" keeps a few others), and the loop issues at least one instruction per wgmma
    fewer than its base (the base rebuilds each descriptor in vector registers), with the same
    wgmmas and the same elementwise, shared-memory and synchronisation instructions; 0 spills
    within 240 registers."""
    by = {r["label"].split()[0]: r for r in wg_slice_sass}
    pairs = (("pipe_stm", "pipe_wgs"), ("wide256", "wide256_wgs"))
    assert set(by) >= {name for pair in pairs for name in pair}, sorted(by)
    same = ("HGMMA", "MUFU", "FP32 FFMA/FMUL/FADD/FMNMX", "F2FP pack", "LDS/LDSM/STS/STSM")
    same += ("SYNCS mbarrier", "BAR named", "MEMBAR/FENCE/DEPBAR", "WARPGROUP/WARPSYNC")
    for base, wgs in pairs:
        b, w = by[base], by[wgs]
        assert w["config"]["wg_slice"] and not b["config"]["wg_slice"], (base, wgs)
        lb, lw = b["loops"]["mma"], w["loops"]["mma"]
        if b["config"]["layout"] == "sdp_t":
            assert lw["always"].get("R2UR", 0) == 0, f"{wgs}: {lw['always']}"
            assert lw["always"]["HGMMA"] == b["minimum"]["HGMMA"] == 32, (wgs, lw["always"])
        else:  # "dkv_t": a few R2UR remain (3 of 105 per row block at D = 256)
            assert lw["always"].get("R2UR", 0) * 10 <= lb["always"]["R2UR"], (wgs, lw["always"])
        fewer = lb["always_total"] - lw["always_total"]
        assert fewer >= lw["always"]["HGMMA"], f"{wgs}: {fewer} fewer than {base}"
        for name in same:
            assert lw["always"].get(name) == lb["always"].get(name), (wgs, name)
        for r in (b, w):
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["label"]
            assert r["max_reg"] < 240, f"{r['label']}: R{r['max_reg']}"


def _sass_by_variant(tmp_path, *variants: str, head_dim: int = 128) -> dict:
    """benchmarks/fa3_bwd_sass.py's JSON of the named variants at `head_dim` (one child
    process: it sets the CUTE_DSL_* variables before cutlass is imported), by variant name."""
    path = tmp_path / "sass.json"
    cmd = [sys.executable, "-m", "benchmarks.fa3_bwd_sass", "--head-dim", str(head_dim)]
    cmd += [a for v in variants for a in ("--variant", v)] + ["--json", str(path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["label"].split()[0]: r for r in json.loads(path.read_text())}


@pytest.mark.lab
def test_bwd_dv_early_keeps_the_exponentials_ahead_of_the_dp_wait(tmp_path) -> None:
    """dv_early (variant pipe_dve_tma, D = 128): in the SASS of the MMA loop every exp2 of P^T
    and dV's wgmmas are issued before the wait that retires dP^T, so P^T is computed under
    dP^T's wgmma and dS^T under dV's; the same wgmmas and exponentials per row block as the
    shipped order, 0 spills within 240 registers."""
    by = _sass_by_variant(tmp_path, "pipe_dve_tma", "pipe_stm_tma")
    dve, base = by["pipe_dve_tma"], by["pipe_stm_tma"]
    assert dve["config"]["dv_early"] and not base["config"]["dv_early"]
    waits = dve["loops"]["mma"]["waits"]
    # S^T and dP^T issued (16 wgmmas), wait for S^T; then every exp2 and dV's 4 wgmmas
    # (TILE_M / 16 k-steps) before the wait for dP^T.
    assert [w["wait"] for w in waits[:2]] == ["gsb0, 0x1", "gsb0, 0x1"], waits
    assert waits[0]["hgmma"] == 16 and waits[1]["hgmma"] == 4, waits
    assert waits[1]["mufu"] == dve["minimum"]["MUFU"] == 32, waits
    for name in ("HGMMA", "MUFU"):
        assert dve["loops"]["mma"]["always"][name] == base["loops"]["mma"]["always"][name]
    assert dve["spill_stores"] == 0 and dve["spill_loads"] == 0
    assert dve["max_reg"] < 240, f"R{dve['max_reg']}"


@pytest.mark.lab
def test_bwd_lse_regs_loads_the_lse_ahead_of_the_first_wgmma(tmp_path) -> None:
    """lse_regs (variant pipe_lser_tma, D = 128): the row block's TILE_M / 8 LDS.64 of LSE are
    issued before its first wgmma (the shipped loop issues none there: it reads sLSE after
    S^T's wait), with the same wgmmas, exponentials and shared-memory instructions per row
    block; 0 spills within 240 registers."""
    by = _sass_by_variant(tmp_path, "pipe_lser_tma", "pipe_stm_tma")
    lser, base = by["pipe_lser_tma"], by["pipe_stm_tma"]
    assert lser["config"]["lse_regs"] and not base["config"]["lse_regs"]
    assert lser["loops"]["mma"]["lds_before_first_hgmma"] == 64 // 8
    assert base["loops"]["mma"]["lds_before_first_hgmma"] == 0
    for name in ("HGMMA", "MUFU", "LDS/LDSM/STS/STSM"):
        assert lser["loops"]["mma"]["always"][name] == base["loops"]["mma"]["always"][name]
    assert lser["spill_stores"] == 0 and lser["spill_loads"] == 0
    assert lser["max_reg"] < 240, f"R{lser['max_reg']}"


@pytest.mark.lab
def test_bwd_stats_shfl_shuffles_the_lse_and_d_rows(tmp_path) -> None:
    """stats_shfl (variant pipe128_dqm_shfl_tma, D = 64, 128-row tiles): per warp and row block
    the MMA loop loads LSE and D with TILE_M / 32 LDS.64 and takes each of a thread's
    TILE_M / 4 rows of each with one SHFL.IDX (64), where the shipped build issues TILE_M / 4
    LDS.64 (32) and no shuffle; the same wgmmas and exponentials, at least half as many
    exponentials before dP^T's wait as it (16; none when D's loads sat under the GEMMs, where
    ptxas raised that wait above them), 0 spills within 240 registers."""
    by = _sass_by_variant(tmp_path, "pipe128_dqm_shfl_tma", "pipe128_dqm_tma", head_dim=64)
    shfl, base = by["pipe128_dqm_shfl_tma"], by["pipe128_dqm_tma"]
    assert shfl["config"]["stats_shfl"] and not base["config"]["stats_shfl"]
    ops, base_ops = shfl["loops"]["mma"]["opcodes"], base["loops"]["mma"]["opcodes"]
    assert (ops.get("SHFL.IDX", 0), ops.get("LDS.64", 0)) == (64, 4), ops
    assert (base_ops.get("SHFL.IDX", 0), base_ops.get("LDS.64", 0)) == (0, 32), base_ops
    for name in ("HGMMA", "MUFU"):
        assert shfl["loops"]["mma"]["always"][name] == base["loops"]["mma"]["always"][name]
    dp_wait = next(w for w in shfl["loops"]["mma"]["waits"] if w["hgmma"] == 0)
    base_dp_wait = next(w for w in base["loops"]["mma"]["waits"] if w["hgmma"] == 0)
    assert dp_wait["mufu"] >= base_dp_wait["mufu"] // 2 > 0, (dp_wait, base_dp_wait)
    assert shfl["spill_stores"] == 0 and shfl["spill_loads"] == 0
    assert shfl["max_reg"] < 240, f"R{shfl['max_reg']}"


@pytest.mark.lab
def test_bwd_without_lse_guard_drops_only_the_compare_and_select(wg_slice_sass) -> None:
    """lse_guard False (the preprocess writes +inf for rows that see no key): the MMA loop loses
    one compare and one select per LSE row (16 + 16 per row block and warp at D = 128) and
    nothing else; 0 spills within 240 registers."""
    by = {r["label"].split()[0]: r for r in wg_slice_sass}
    b, n = by["pipe_wgs_sout"], by["pipe_wgs_sout_ng"]
    assert b["config"]["lse_guard"] and not n["config"]["lse_guard"]
    lb, ln = b["loops"]["mma"]["always"], n["loops"]["mma"]["always"]
    pred = "ISETP/FSETP/SEL/FSEL"
    assert lb[pred] - ln[pred] == 32, (lb[pred], ln[pred])
    assert {k: v for k, v in lb.items() if k != pred} == {k: v for k, v in ln.items() if k != pred}
    for r in (b, n):
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["label"]
        assert r["max_reg"] < 240, f"{r['label']}: R{r['max_reg']}"


def test_bwd_wide_deterministic_and_softcap_compile(wide_probes) -> None:
    """D = 192 / 256 ("dkv_t"): the deterministic builds add dQ by atomics between an acquiring
    spin and a releasing increment; the softcap builds take one tanh per S element. Both stay
    spill-free within 240 registers."""
    det = [r for r in wide_probes if not r["softcap"]]
    cap = [r for r in wide_probes if r["softcap"]]
    assert {(r["head_dim"], r["causal"]) for r in det} == {(192, True), (256, True)}
    assert {(r["head_dim"], r["causal"]) for r in cap} == {(192, False), (256, False)}
    for r in wide_probes:
        ptx, d, cfg, where = r["ptx"], r["head_dim"], r["config"], _id(r)
        assert cfg["layout"] == "dkv_t", where
        assert ptx["wgmma"] == _expected_wgmma(d, cfg)[0], f"{where}: {ptx}"
        if r["softcap"]:
            per_thread = cfg["tile_m"] * cfg["tile_n"] // (128 * cfg["num_mma_wgs"])
            assert ptx["tanh"] == per_thread and ptx["ex2"] >= per_thread, f"{where}: {ptx}"
            assert ptx["dq_bulk"] == 1 and ptx["dq_atomic"] == 0, f"{where}: {ptx}"
        else:
            assert cfg["deterministic"] and cfg["dq_mode"] == "atomic", where
            assert ptx["dq_atomic"] == 64 * d // 256 and ptx["dq_bulk"] == 0, f"{where}: {ptx}"
            assert ptx["sem_acquire"] >= 1 and ptx["sem_release"] == 1, f"{where}: {ptx}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        for code in ("C7508", "C7512", "C7515", "C7519"):
            assert code not in r["remarks"], f"{where}: ptxas remark {code}"


def test_bwd_softcap_compiles(softcap_probes) -> None:
    want = {(64, False), (96, True), (128, True)}
    assert {(r["head_dim"], r["causal"]) for r in softcap_probes} == want
    for r in softcap_probes:
        ptx, d, where = r["ptx"], r["head_dim"], _id(r)
        assert r["softcap"], where
        # One tanh and one exp2 per S^T element of a row block (64 keys x 64 rows / 128).
        assert ptx["tanh"] == 32 and ptx["ex2"] >= 32, f"{where}: {ptx}"
        assert ptx["wgmma"] == 2 * d // 16 + 2 * 64 // 16 + 128 // 16, f"{where}: {ptx}"
        assert ptx["tma_store"] == 0, f"{where}: softcap builds store dK / dV from registers"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        for code in ("C7508", "C7512", "C7515", "C7519"):
            assert code not in r["remarks"], f"{where}: ptxas remark {code}"


def test_bwd_local_compiles(local_probes) -> None:
    """The window's bounds (row-block range, masked-block test, per-element edges) cost no
    wgmma, spill or serialisation: the same GEMMs and dQ route as the shipped builds."""
    seen = {(r["head_dim"], r["causal"]) for r in local_probes}
    assert seen == {(64, True), (128, False), (256, True)}, seen
    for r in local_probes:
        ptx, d, cfg, where = r["ptx"], r["head_dim"], r["config"], _id(r) + "-local"
        assert r["local"], where
        expected, rs = _expected_wgmma(d, cfg)
        assert ptx["wgmma"] == expected, f"{where}: {ptx['wgmma']} wgmma, expected {expected}"
        assert ptx["wgmma_rs"] == rs, f"{where}: {ptx['wgmma_rs']} RS wgmma, expected {rs}"
        _assert_shipped_dq_route(ptx, d, cfg, where)
        assert ptx["setmaxnreg"] == 2 and ptx["tma_load"] >= 6, f"{where}: {ptx}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        for code in ("C7508", "C7512", "C7515", "C7519"):
            assert code not in r["remarks"], f"{where}: ptxas remark {code}"


def test_bwd_local_deterministic_is_taken(monkeypatch) -> None:
    """A window under the deterministic flag: fa3's backward takes it (the ordered build, its
    turn counters started at each row block's first column block), by default at a head dim
    where that build has run on a GPU (D 64); where it has not (bwd_configs.BWD_UNVERIFIED,
    patched here to list D 64) dispatch pairs fa3's forward with fa2's backward unless
    FLASHSUITE_FA3_BWD=1 asks, and says why."""
    from flashsuite import dispatch
    from flashsuite.common.arch import override_arch
    from flashsuite.common.validation import check_inputs
    from flashsuite.dispatch import registry
    from flashsuite.fa3 import bwd_interface, interface

    q = torch.empty(1, 256, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    p = check_inputs(q, q, q, window_size=(32, 0))
    feature = "deterministic order and a window"
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    monkeypatch.delenv("FLASHSUITE_FA3_BWD", raising=False)
    try:
        ok, reason = interface.supports_backward(p, 90)
        assert ok and "column-block order (deterministic)" in reason, reason
        assert interface._bwd_config(p, None).deterministic
        assert (64, feature) not in bwd_interface.BWD_UNVERIFIED
        assert interface.backward_opt_in(p) == ""
        with override_arch(90):
            if not (registry.available("fa3")[0] and registry.available("fa2")[0]):
                pytest.skip("needs fa3 and fa2 importable")
            assert dispatch.select(q, q, q, window_size=(32, 0)).backward == "fa3"
            monkeypatch.setattr(bwd_interface, "BWD_UNVERIFIED", ((64, feature),))
            opt_in = interface.backward_opt_in(p)
            assert f"{feature} compiled but not yet run" in opt_in, opt_in
            assert dispatch.select(q, q, q, window_size=(32, 0)).backward == "fa2"
            monkeypatch.setenv("FLASHSUITE_FA3_BWD", "1")
            assert dispatch.select(q, q, q, window_size=(32, 0)).backward == "fa3"
    finally:
        torch.use_deterministic_algorithms(was)
    assert interface.backward_opt_in(p) == ""  # not deterministic: the verified window build


def test_turn_counters_start_at_each_row_blocks_first_column_block() -> None:
    """bwd_host.turn_counters against the kernel's own row-block ranges (BwdBlocks.row_blocks,
    called with integers): for every row block some column block visits, the visiting column
    blocks are consecutive and the first of them is where its counter starts, so the turns
    run start, start + 1, ... with none missing; windows (one or both edges, causal), no
    window, Nq above and below Nk, both tile shapes the ordered builds use."""
    from types import SimpleNamespace

    from flashsuite.fa3.bwd_blocks import BwdBlocks
    from flashsuite.fa3.bwd_configs import BwdConfig
    from flashsuite.fa3.bwd_host import turn_counters
    from flashsuite.fa3.compile import kernel_scalars

    row_blocks = BwdBlocks.row_blocks.__wrapped__
    for tm, tn in ((64, 128), (64, 96), (64, 48)):
        for nq, nk in ((1, 1), (64, 1000), (700, 1300), (1000, 600), (1000, 1000), (257, 129)):
            for window, causal in (
                ((-1, -1), False), ((-1, -1), True), ((200, 0), True), ((130, 70), False),
                ((0, 0), False), ((64, -1), False), ((5000, 3), False),
            ):  # fmt: skip
                local = window != (-1, -1)
                blocks = SimpleNamespace(TILE_M=tm, TILE_N=tn, LOCAL=local, CAUSAL=causal)
                win = kernel_scalars(1.0, 0.0, window, causal, nq, nk)[2:] if local else None
                n_m = -(-nq // tm)
                visits: list[list[int]] = [[] for _ in range(n_m)]
                for n in range(-(-nk // tn)):
                    m_min, count, _ = row_blocks(blocks, n, nq, nk, 1, win)
                    for m in range(m_min, m_min + count):
                        visits[m].append(n)
                key = SimpleNamespace(cfg=BwdConfig(tile_m=tm, tile_n=tn), local=local,
                                      causal=causal)  # fmt: skip
                start = turn_counters(key, (2, 3, n_m * tm), nq, nk, window, "cpu")
                assert start.shape == (2, 3, n_m) and start.dtype == torch.int32
                assert (start == start[0, 0]).all()  # the same for every batch and head
                where = (tm, tn, nq, nk, window, causal)
                for m, ns in enumerate(visits):
                    if ns:
                        assert ns == list(range(ns[0], ns[0] + len(ns))), (where, m, ns)
                        assert int(start[0, 0, m]) == ns[0], (where, m, ns, start[0, 0])


def test_bwd_deterministic_config_follows_torch_flag() -> None:
    """Under torch.use_deterministic_algorithms fa3's backward takes the ordered-dQ config, and
    a config that cannot order its dQ (bulk reduces) is refused with the reason."""
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.interface import _bwd_config

    q = torch.empty(1, 128, 2, 64, dtype=torch.bfloat16)
    p = check_inputs(q, q, q)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not _bwd_config(p, None).deterministic
        torch.use_deterministic_algorithms(True)
        assert _bwd_config(p, None).deterministic
        assert _bwd_config(p, BwdConfig(stages=3)) == BwdConfig(stages=3, deterministic=True)
    finally:
        torch.use_deterministic_algorithms(was)


def test_bwd_dq_mode_refused_with_reason() -> None:
    ok, reason = bwd_can_implement(BwdConfig(dq_mode="tma"), 128, torch.bfloat16)
    assert not ok and "dq_mode 'tma'" in reason
    ok, reason = bwd_can_implement(BwdConfig(ds_store="ldmatrix"), 128, torch.bfloat16)
    assert not ok and "ds_store 'ldmatrix'" in reason
    ok, reason = bwd_can_implement(BwdConfig(dq_mode="bulk"), 128, torch.bfloat16)
    assert not ok and "dq_mode 'bulk'" in reason  # measured, lost to "warp", removed
    for stages in (2, 3):
        cfg = BwdConfig(dq_mode="warp", stages=stages)
        for d in (64, 128):
            ok, reason = bwd_can_implement(cfg, d, torch.bfloat16)
            assert ok, reason


def test_bwd_variants_can_implement(monkeypatch) -> None:
    """Every named variant the GPU check script takes is a buildable config at its head dims
    (D 64 and 128 unless fa3_bwd_variants.HEAD_DIMS says otherwise)."""
    from benchmarks.fa3_bwd_variants import VARIANTS, variant, variant_head_dims
    from flashsuite.fa3 import bwd_configs

    assert variant("base") == BwdConfig()
    # The "dkv_t" variants named after the shipped configs are those configs.
    shipped = {
        (192, False, False): "wide192_wgs",
        (192, False, True): "wide192_serial",
        (192, True, False): "wide192_wgs",
        (192, True, True): "wide192_serial",
        (256, False, False): "wide256_red80_wgs",
        (256, False, True): "wide256_serial",
        # causal D 256: the grid in sections of 4 (kv head, batch) pairs
        (256, True, False): "wide256_red80_wgs_sec4",
        (256, True, True): "wide256_serial",
    }
    for (d, causal, softcap), name in shipped.items():
        assert variant(name) == bwd_config_for(d, torch.bfloat16, causal, softcap), name
    # Causal D 96 / 128: sections of 4 pairs, the per-warpgroup sdQ hand-off, FA4's elementwise
    # work and dV before the fence (bwd_configs.FA4_ELEMENTWISE), D 128 with the LSE / D
    # shuffles too; D 64 the sections with FA4's route (bwd_configs.D64_FA4_ROUTE). Non-causal:
    # the hand-off at D 96, and at D 128 on the 80-row tile; D 64 FA4's route.
    assert variant("pipe_sec4_wgs_sout_ng_wgdq_tma_dvf") == bwd_config_for(96, torch.bfloat16, True)
    assert variant("pipe_sec4_wgs_sout_ng_shfl_wgdq_tma_dvf") == bwd_config_for(
        128, torch.bfloat16, True
    )
    assert variant("pipe128_dqm_sec4_wgs_sout_ng_shfl_wgdq_tma_dvf") == bwd_config_for(
        64, torch.bfloat16, True
    )
    # Non-causal D 128: the 80-row tile with dV issued before the sdS fence.
    assert variant("pipe80_wgs_wgdq_tma_dvf") == bwd_config_for(128, torch.bfloat16, False)
    # Packed sequences and windows: the builds without the dense routes unless
    # VARLEN_DENSE_ROUTES / the head dim in WINDOW_ROUTE_HEAD_DIMS, then the dense routes
    # without the sectioned grid or the 80-row tile.
    for d, causal, routes in itertools.product((64, 96, 128, 256), (False, True), (False, True)):
        window_dims = (64, 96, 128) if routes else ()
        switches = (
            ("VARLEN_DENSE_ROUTES", "varlen", routes),
            ("WINDOW_ROUTE_HEAD_DIMS", "local", window_dims),
        )
        for flag, problem, value in switches:
            monkeypatch.setattr(bwd_configs, flag, value)
            got = bwd_config_for(d, torch.bfloat16, causal, **{problem: True})
            where = (d, causal, routes, problem)
            if d == 256:
                assert got == bwd_config_for(d, torch.bfloat16, False), where
            elif not routes:
                assert got == variant("pipe128_dqm_tma" if d == 64 else "pipe_stm_tma"), where
            else:
                route = "pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf"
                want = variant(route if d == 64 else "pipe_wgs_sout_ng_wgdq_tma_dvf")
                assert got == want, where
        monkeypatch.undo()
    # A window on packed sequences takes the routes only when both switches say so.
    for varlen_routes, window_routes in itertools.product((False, True), (False, True)):
        monkeypatch.setattr(bwd_configs, "VARLEN_DENSE_ROUTES", varlen_routes)
        monkeypatch.setattr(bwd_configs, "WINDOW_ROUTE_HEAD_DIMS", (128,) if window_routes else ())
        got = bwd_config_for(128, torch.bfloat16, True, varlen=True, local=True)
        both = varlen_routes and window_routes
        assert got == variant("pipe_wgs_sout_ng_wgdq_tma_dvf" if both else "pipe_stm_tma")
    monkeypatch.undo()
    # As shipped, windows take the routes at every head dim that has them (each timed faster).
    assert bwd_configs.WINDOW_ROUTE_HEAD_DIMS == (64, 96, 128)
    for d, want in (
        (64, "pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf"),
        (96, "pipe_wgs_sout_ng_wgdq_tma_dvf"),
        (128, "pipe_wgs_sout_ng_wgdq_tma_dvf"),
    ):
        for causal in (False, True):
            assert bwd_config_for(d, torch.bfloat16, causal, local=True) == variant(want), d
    assert variant("pipe_wgdq_tma") == bwd_config_for(96, torch.bfloat16, False)
    assert variant("pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf") == bwd_config_for(
        64, torch.bfloat16, False
    )
    for d, causal in itertools.product((64, 96, 128, 192, 256), (False, True)):
        plain = bwd_config_for(d, torch.bfloat16, causal, softcap=True)
        assert (plain.head_section, plain.dq_handoff) == (0, "cta"), (d, causal)
    # The deterministic build starts from the tiles whose dQ goes through sdQ.
    assert bwd_config_for(256, torch.bfloat16, True, sdq=True) == variant("wide256")
    for name, (cfg, what) in VARIANTS.items():
        assert what, name
        for d in variant_head_dims(name):
            ok, reason = bwd_can_implement(cfg, d, torch.bfloat16)
            assert ok, f"{name} D={d}: {reason}"
    with pytest.raises(ValueError, match="name 'nope' not in"):
        variant("nope")


def test_preprocess_pads_rows_and_keeps_empty_rows(device) -> None:
    """LSE in base 2, +inf for rows that see no key and for padding rows (the kernel reads any
    infinite LSE as P = 0); D = rowsum(dO * O), 0 on padding; strided dO and O. On the device
    the preprocess's Triton kernel runs on (the interpreter's CPU without a GPU)."""
    from flashsuite.fa3.bwd_host import LOG2E, preprocess

    b, nq, hq, d = 2, 70, 3, 64
    dout = torch.randn(b, nq, hq, d, device=device)
    out = torch.randn(b, hq, nq, d, device=device).transpose(1, 2)
    lse = torch.randn(b, hq, nq, device=device)
    lse[0, 1, :5] = float("-inf")
    lse_log2, dsum, dq_acc = preprocess(dout, out, lse, tile_m=64)
    assert dq_acc is None
    assert lse_log2.shape == dsum.shape == (b, hq, 128)
    assert torch.isposinf(lse_log2[0, 1, :5]).all() and torch.isposinf(lse_log2[:, :, nq:]).all()
    fine = torch.isfinite(lse)
    torch.testing.assert_close(lse_log2[:, :, :nq][fine], (lse * LOG2E)[fine])
    torch.testing.assert_close(dsum[:, :, :nq], (dout * out).sum(-1).transpose(1, 2))
    assert (dsum[:, :, nq:] == 0).all()


def test_preprocess_zeroes_the_dq_accumulator(device) -> None:
    """With a dQ accumulator (fa3's row blocks, B, Hq, Nq_pad, D) the preprocess's launch sets
    every float of it to 0 (D = 96: columns past D in its power-of-two tile stay untouched),
    whatever it held; a wrong dtype, shape or layout is refused naming dq_acc."""
    from flashsuite.common.bwd_preprocess import bwd_preprocess
    from flashsuite.fa3.bwd_host import preprocess

    b, nq, hq, d = 2, 70, 3, 96
    dout = torch.randn(b, nq, hq, d, device=device)
    out = torch.randn(b, nq, hq, d, device=device)
    lse = torch.randn(b, hq, nq, device=device)
    store = torch.full((b * hq * 128 * d + 7,), float("nan"), device=device)
    acc = store[: b * hq * 128 * d].view(b, hq, 128, d)
    bwd_preprocess(out, dout, lse, 128, acc)
    assert (acc == 0).all() and store[-7:].isnan().all()  # nothing written past its end
    _, _, dq_acc = preprocess(dout, out, lse, tile_m=64, dq_d=d)
    assert dq_acc.shape == (b, hq, 128, d) and (dq_acc == 0).all()
    for bad, what in (
        (torch.zeros(b, hq, 128, d, dtype=torch.float16, device=device), "float16"),
        (torch.zeros(b, hq, 64, d, device=device), "(2, 3, 64, 96)"),
        (torch.zeros(b, hq, d, 128, device=device).transpose(2, 3), "contiguous"),
    ):
        with pytest.raises(ValueError, match=rf"dq_acc expected .*{re.escape(what)}|{what}"):
            bwd_preprocess(out, dout, lse, 128, bad)


def _tile_offsets(tile_m: int, head_dim: int, split: str) -> torch.Tensor:
    """(TILE_M, D): where each (row, column) of a dQ row block sits in its dq_tile_modes block,
    from CuTe's colexicographic decomposition of the row and column indices."""
    from flashsuite.fa3.bwd_configs import dq_tile_modes

    (rows, cols), (row_strides, col_strides) = dq_tile_modes(tile_m, head_dim, 2, split)

    def offsets(shape, stride, n) -> torch.Tensor:
        idx, off = torch.arange(n), torch.zeros(n, dtype=torch.long)
        for size, st in zip(shape, stride, strict=True):
            off += (idx % size) * st
            idx = idx // size
        return off

    row_off, col_off = offsets(rows, row_strides, tile_m), offsets(cols, col_strides, head_dim)
    return row_off[:, None] + col_off[None, :]


def _tiled(dq: torch.Tensor, tile_m: int, split: str) -> torch.Tensor:
    """The "warp" dq_mode's accumulator (B, Hq, Nq_pad, D) holding dq (B, Nq_pad, Hq, D)."""
    b, nq_pad, hq, head_dim = dq.shape
    tile_off = _tile_offsets(tile_m, head_dim, split).flatten()
    tiles = dq.view(b, nq_pad // tile_m, tile_m, hq, head_dim).permute(0, 3, 1, 2, 4)
    acc = torch.empty(b, hq, nq_pad // tile_m, tile_m * head_dim, dtype=dq.dtype, device=dq.device)
    acc[..., tile_off.to(dq.device)] = tiles.reshape(b, hq, nq_pad // tile_m, tile_m * head_dim)
    return acc.view(b, hq, nq_pad, head_dim)


_TILE_ORDERS = [
    (64, 64, "d"),
    (64, 128, "d"),
    (128, 64, "d"),
    (128, 64, "m"),
    (128, 128, "m"),
    (80, 128, "dt"),
]


@pytest.mark.parametrize(("tile_m", "head_dim", "split"), _TILE_ORDERS)
def test_dq_tile_order_round_trips(tile_m: int, head_dim: int, split: str, device) -> None:
    """The "warp" dq_mode's accumulator holds each TILE_M x D row block in dq_tile_modes order (the
    layout the kernel stores sdQ with and bulk-adds to gmem); dq_from_tiles must invert exactly
    that map, for a ragged Nq too. Each warpgroup's part is one contiguous chunk (the
    per-warpgroup bulk reduces of dq_handoff "wg" rely on it)."""
    from flashsuite.fa3.bwd_host import dq_from_tiles

    tile_off = _tile_offsets(tile_m, head_dim, split)
    assert sorted(tile_off.flatten().tolist()) == list(range(tile_m * head_dim)), "not a bijection"
    chunk = tile_m * head_dim // 2
    by_wg = tile_off[: tile_m // 2] if split == "m" else tile_off[:, : head_dim // 2]
    assert sorted(by_wg.flatten().tolist()) == list(range(chunk)), "warpgroup 0 not one chunk"
    b, hq, nq = 2, 3, 200
    nq_pad = -(-256 // tile_m) * tile_m  # whole row blocks past nq: 256, or 320 at 80 rows
    dq = torch.randn(b, nq_pad, hq, head_dim, device=device)
    acc = _tiled(dq, tile_m, split)
    got = dq_from_tiles(acc, nq, tile_m, 2, torch.float32, split)
    assert got.shape == (b, nq, hq, head_dim) and got.is_contiguous()
    assert torch.equal(got, dq[:, :nq])
    assert torch.equal(dq_from_tiles(acc, nq_pad, tile_m, 2, torch.float32, split), dq)


def _new_storages(fn) -> tuple[object, set[int]]:
    """fn()'s result and the storages (data pointers) of every tensor an aten op made while it
    ran, views of one storage counted once (each kept alive until fn returns, so that no
    address is reused)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[int] = set()
    alive: list[torch.Tensor] = []

    class Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.numel():
                    seen.add(t.untyped_storage().data_ptr())
                    alive.append(t)
            return out

    with Storages():
        result = fn()
    return result, seen


@pytest.mark.parametrize(("tile_m", "head_dim", "split"), _TILE_ORDERS)
@pytest.mark.parametrize("scale", [None, 0.125])
def test_dq_from_tiles_writes_one_tensor(tile_m, head_dim, split, scale, device) -> None:
    """A ragged Nq: dQ leaves the tiles in one tensor of exactly B x Nq rows (no padded copy
    sliced a second time), equal bit for bit to the tiles' rows cast (and scaled in fp32) by
    torch. (The offset tables are made once per layout and device: warmed first. The count of
    new tensors is checked where the kernel is compiled, not interpreted.)"""
    from flashsuite.fa3.bwd_host import dq_from_tiles

    gen = torch.Generator().manual_seed(tile_m + head_dim)
    hq = 3
    for b, nq in ((2, 1), (3, 77), (2, 2 * tile_m + tile_m // 2 + 9), (1, tile_m + 5)):
        nq_pad = -(-nq // tile_m) * tile_m
        dq = torch.randn(b, nq_pad, hq, head_dim, generator=gen).to(device)
        acc = _tiled(dq, tile_m, split)
        acc_storage = acc.untyped_storage().data_ptr()
        dq_from_tiles(acc, nq, tile_m, 2, torch.bfloat16, split, scale)
        got, made = _new_storages(
            lambda: dq_from_tiles(acc, nq, tile_m, 2, torch.bfloat16, split, scale)  # noqa: B023
        )
        want = dq[:, :nq] if scale is None else dq[:, :nq] * scale
        assert got.shape == (b, nq, hq, head_dim) and got.is_contiguous()
        assert torch.equal(got, want.to(torch.bfloat16)), (b, nq)
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # the interpreter copies
            # every kernel argument through host buffers of its own
            assert made - {acc_storage} == {got.untyped_storage().data_ptr()}, (b, nq)
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size(), (b, nq)


_SIGNATURE_KEYS = [
    ("plain", 64, True, {}),
    ("softcap-local", 128, False, dict(softcap=True, local=True)),
    ("deterministic", 64, True, dict(deterministic=True)),
    ("varlen", 64, True, dict(varlen=True)),
]

# Run in a child process: the CuTe DSL reads CUTE_DSL_ARCH at import, and only a binary built
# with it set calls its argument check on a machine without the GPU.
_SIGNATURE_CHILD = """
import json, sys
import torch
from flashsuite.fa3 import bwd_host
from flashsuite.fa3.bwd_configs import bwd_config_for
from flashsuite.fa3.bwd_interface import ordered_config
out = {}
for name, d, causal, flags in json.loads(sys.argv[1]):
    cfg = bwd_config_for(d, torch.bfloat16, causal, flags.get("softcap", False),
                         varlen=flags.get("varlen", False))
    if flags.get("deterministic"):  # the ordered-dQ build torch's deterministic flag takes
        cfg = ordered_config(cfg)
    key = bwd_host.BwdCompileKey(
        torch.bfloat16, d, causal, cfg, local=flags.get("local", False),
        softcap=flags.get("softcap", False), varlen=flags.get("varlen", False))
    t = torch.zeros(2, 2)
    args = bwd_host.launch_args(
        key, (t,) * 9, 0.125, 30.0 if key.softcap else 0.0, (64, 0) if key.local else (-1, -1),
        100, 100, t if cfg.deterministic else None, (t, t) if key.varlen else None)
    try:
        bwd_host.compile_backward(key)(*args)
        message = ""
    except ValueError as e:
        message = str(e)
    out[name] = {"message": message, "none": [a is None for a in args]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def signatures() -> dict[str, dict]:
    """Per _SIGNATURE_KEYS entry, the binary's refusal message and which launch_args are None,
    from one child process (one DSL import for the four builds)."""
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "FLASHSUITE_CACHE_DIR": "off"}
    cmd = [sys.executable, "-c", _SIGNATURE_CHILD, json.dumps(_SIGNATURE_KEYS)]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name, d, causal, flags", _SIGNATURE_KEYS, ids=[k[0] for k in _SIGNATURE_KEYS]
)
def test_binary_takes_launch_args(name, d, causal, flags, signatures) -> None:
    """The compiled binary's parameter list (as the DSL's argument check prints it when it
    refuses the first argument, before anything touches a device) against what
    `bwd_host.launch_args` passes: the same parameters in the same order, None exactly where
    the build has no such parameter.
    The stand-ins of the host-path tests take that list too, so they cannot drift from the
    binary unseen."""
    import re

    result = signatures[name]
    assert "when calling" in result["message"], result["message"][-2000:]
    params = re.search(r"__call__\((.*)\)`", result["message"]).group(1)
    found = re.findall(r"(\w+): (Tensor\(\[[^]]*\], \w+\)|\w+)", params)
    names = [n for n, _ in found]
    assert len(found) == len(result["none"]), (names, len(result["none"]))
    assert names[9:] == ["scale_log2", "scale", "mSem", "softcap_pre", "window_left",
                         "window_right", "mCuSeqlensQ", "mCuSeqlensK"], names  # fmt: skip
    kinds_none = [kind == "None" for _, kind in found]
    assert kinds_none == result["none"], list(zip(names, kinds_none, result["none"], strict=True))


@pytest.mark.parametrize("varlen", [False, True])
def test_launch_refuses_options_the_key_lacks(varlen) -> None:
    """A softcap or a window the binary was not built for is refused before any work (the
    tensors are never touched: empty stand-ins)."""
    from flashsuite.fa3 import bwd_host

    key = bwd_host.BwdCompileKey(
        torch.bfloat16, 64, False, bwd_config_for(64, torch.bfloat16, False), varlen=varlen
    )
    t = torch.empty(0)
    run = bwd_host.run_varlen_backward if varlen else bwd_host.run_backward
    extra = (t, t) if varlen else ()
    with pytest.raises(ValueError, match=r"softcap 30\.0 with a key built for False"):
        run(key, t, t, t, t, t, t, *extra, 0.125, 30.0)
    with pytest.raises(ValueError, match=r"window \(64, 0\) with a key built without one"):
        run(key, t, t, t, t, t, t, *extra, 0.125, 0.0, (64, 0))


def _kernel_contract(key, causal: bool):
    """A stand-in for the compiled backward that keeps its argument contract, in float64 torch:
    it reads only what the host hands it (lse_log2 with +inf rows, dsum, the scales) and writes
    dQ into the accumulator in the config's layout ("warp": TILE_M x D blocks in dq_tile_modes
    order); dK and dV summed over each GQA group."""
    from flashsuite.common.reference import visibility_mask
    from flashsuite.fa3.bwd_configs import dq_tile_modes, dq_tiled

    def run(q, k, v, dout, lse_log2, dsum, dq_acc, dk, dv, scale_log2, scale, sem, softcap_pre,
            window_left, window_right, cu_seqlens_q, cu_seqlens_k):  # fmt: skip
        assert softcap_pre is None and (sem is None) == (not key.cfg.deterministic)
        assert window_left is None and window_right is None
        assert cu_seqlens_q is None and cu_seqlens_k is None
        b, nq, hq, d = q.shape
        nk, hkv = k.shape[1], k.shape[2]
        g = hq // hkv
        qh, doh = (t.double().transpose(1, 2) for t in (q, dout))  # (B, Hq, Nq, D)
        kh, vh = (t.double().transpose(1, 2).repeat_interleave(g, 1) for t in (k, v))
        s = qh @ kh.transpose(-1, -2) * scale_log2  # (B, Hq, Nq, Nk), base 2
        s = s.masked_fill(~visibility_mask(nq, nk, causal=causal).to(s.device), float("-inf"))
        p = torch.exp2(s - lse_log2[:, :, :nq, None].double())  # +inf LSE: P = 0
        ds = p * (doh @ vh.transpose(-1, -2) - dsum[:, :, :nq, None].double())
        dk_scale = scale  # scale_out: dS and the dQ accumulator without it, dK with it
        if not key.cfg.scale_out:
            ds, dk_scale = ds * scale, 1.0
        dq = ds @ kh  # (B, Hq, Nq, D)
        dk_ = (ds.transpose(-1, -2) @ qh).view(b, hkv, g, nk, d).sum(2).transpose(1, 2)
        dk.copy_(dk_ * dk_scale)
        dv.copy_((p.transpose(-1, -2) @ doh).view(b, hkv, g, nk, d).sum(2).transpose(1, 2))
        if not dq_tiled(key.cfg):
            dq_acc.copy_(dq.transpose(1, 2))
            return
        tm = key.cfg.tile_m
        (rows, cols), (rs, cs) = dq_tile_modes(tm, d, key.cfg.num_mma_wgs, key.cfg.dq_split)

        def offsets(shape, stride, n):
            idx, off = torch.arange(n), torch.zeros(n, dtype=torch.long)
            for size, st in zip(shape, stride, strict=True):
                off, idx = off + (idx % size) * st, idx // size
            return off

        tile = (offsets(rows, rs, tm)[:, None] + offsets(cols, cs, d)[None, :]).flatten()
        tile = tile.to(dq_acc.device)
        padded = torch.zeros(b, hq, dq_acc.shape[2], d, dtype=torch.float64, device=dq.device)
        padded[:, :, :nq] = dq
        blocks = padded.view(b, hq, -1, tm * d)
        flat = dq_acc.view(b, hq, -1, tm * d)
        flat[..., tile] = blocks.float()

    return run


@pytest.mark.parametrize(
    ("tile_m", "dq_mode", "deterministic", "causal", "shape"),
    [
        (64, "warp", False, True, (2, 100, 70, 4, 2, 64)),  # Nq > Nk: rows with no key
        (128, "warp", False, False, (1, 130, 200, 2, 1, 64)),  # MQA, ragged row blocks
        (128, "warp-m", False, True, (2, 200, 130, 2, 1, 64)),  # dQ split by rows
        (64, "warp", False, False, (1, 64, 64, 2, 2, 128)),
        (64, "atomic", True, True, (2, 90, 120, 4, 4, 64)),
        (64, "warp", False, True, (1, 70, 100, 4, 2, 256)),  # "dkv_t": the same host path
        (64, "red", False, False, (2, 130, 90, 4, 2, 256)),  # the tiled accumulator, no sdQ
        (128, "warp-m+sout", False, True, (2, 200, 130, 2, 1, 64)),  # dQ scaled by the host
        (64, "warp+sout", False, False, (1, 64, 64, 2, 2, 128)),
        (64, "atomic+sout", True, True, (2, 90, 120, 4, 4, 64)),
        (80, "warp-dt", False, False, (2, 170, 130, 4, 2, 128)),  # dQ^T: 80-row blocks
    ],
)
def test_run_backward_host_path(monkeypatch, device, tile_m, dq_mode, deterministic, causal, shape):
    """The host side of the fa3 backward around a stand-in kernel that keeps the compiled one's
    argument contract: preprocess (padding, +inf LSE rows), the accumulator's shape and layout,
    dq_from_tiles, the turn counters' presence. Gradients against autograd of the float64
    oracle; the host path runs on the device the preprocess's Triton kernel runs on."""
    from flashsuite.common.reference import attention_reference
    from flashsuite.fa3 import bwd_host

    b, nq, nk, hq, hkv, d = shape
    dq_mode, _, extra = dq_mode.partition("+")  # "+sout": scale_out
    dq_mode, _, split = dq_mode.partition("-")  # "warp-m": dq_split "m"
    cfg = BwdConfig(tile_m=tile_m, dq_mode=dq_mode, dq_split=split or "d",
                    deterministic=deterministic, scale_out=extra == "sout")  # fmt: skip
    if d > 128:
        cfg = replace(bwd_config_for(d, torch.bfloat16, causal), deterministic=deterministic)
        if dq_mode == "red":  # wide256_red80: 80 keys, dQ in two slices
            cfg = replace(cfg, tile_n=80, dq_mode="red", dq_slices=2)
    key = bwd_host.BwdCompileKey(torch.float32, d, causal, cfg)
    monkeypatch.setattr(bwd_host, "get_backward", lambda k: _kernel_contract(k, causal))
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, nq, hq, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, nk, hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, nk, hkv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, nq, hq, d, generator=gen, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=causal, compute_dtype=torch.float64)
    want = torch.autograd.grad(out, (q, k, v), dout)
    scale = d**-0.5
    args = [t.detach().float().to(device) for t in (dout, q, k, v, out)]
    got = bwd_host.run_backward(key, *args, lse.detach().float().to(device), scale)
    for name, a, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == w.shape and a.is_contiguous(), name
        torch.testing.assert_close(a.double().cpu(), w, rtol=1e-4, atol=1e-4, msg=name)


# A listing in nvdisasm -c's form: a loop (.L_x_1 .. the @P0 back-edge) whose mbarrier wait
# retries out of line (.L_x_9, which jumps back into the loop unconditionally) and whose mask
# is jumped over in unmasked iterations (@!P1 BRA .L_x_3).
_SASS = """
        .section .text.kernel,"ax",@progbits
.text.kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
        /*0030*/                   R2UR UR8, R10 ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0050*/              @!P1 BRA `(.L_x_3) ;
        /*0060*/                   FSEL R24, R24, -INF , !P2 ;
.L_x_3:
        /*0070*/                   IMAD.MOV.U32 R11, RZ, RZ, 0x40000040 ;
        /*0080*/                   MUFU.EX2 R24, R24 ;
        /*0090*/               @P0 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
.L_x_9:
        /*00b0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*00c0*/              @!P0 BRA `(.L_x_9) ;
        /*00d0*/                   BRA `(.L_x_2) ;
"""


def test_sass_loop_counts() -> None:
    """benchmarks.fa3_bwd_sass takes the conditional back-edge's loop (not the retry stub's
    jump back), counts what a forward branch of the loop jumps over as conditional, and
    classes IMAD.MOV as a move."""
    from benchmarks.fa3_bwd_sass import loop_counts

    c = loop_counts(_SASS, "HGMMA")
    assert (c["head_addr"], c["tail_addr"], c["loops_with_marker"]) == (0x10, 0x90, 1), c
    assert c["always"] == {
        "HGMMA": 1,
        "MUFU": 1,
        "SYNCS mbarrier": 1,
        "R2UR": 1,
        "BRA/BSSY/BSYNC": 3,
        "MOV": 1,
    }, c["always"]
    assert c["conditional"] == {"ISETP/FSETP/SEL/FSEL": 1}, c["conditional"]
    assert loop_counts(_SASS, "UTMALDG") is None


@pytest.mark.parametrize("local", [False, True], ids=["dense", "window"])
def test_every_shipped_config_has_a_deterministic_build(local: bool) -> None:
    """torch.use_deterministic_algorithms takes each shipped config to its ordered-dQ build
    (bwd_interface._bwd_config), which must stay buildable whatever options the table adds (an
    overlapped-order option left on made it unbuildable, and dispatch fell back to fa2)."""
    from flashsuite.fa3.bwd_interface import ordered_config

    for d, dt, causal, _ in bwd_shipped_configs(local=local):
        cfg = ordered_config(bwd_config_for(d, dt, causal, sdq=True, local=local))
        ok, reason = bwd_can_implement(cfg, d, dt, causal=causal, local=local)
        assert ok, (d, dt, causal, reason)


def test_the_d64_deterministic_build_is_the_one_that_ran() -> None:
    """D = 64's shipped elementwise route (bwd_configs.D64_FA4_ROUTE) does not reach the
    ordered-dQ build: it equals the ordered build of the D = 64 config before the route (the
    build whose bitwise stability the GPU check showed), causal or not."""
    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.fa3.bwd_configs import D64_FA4_ROUTE
    from flashsuite.fa3.bwd_interface import ordered_config

    for causal, before in ((False, "pipe128_dqm_tma"), (True, "pipe128_dqm_sec4_tma")):
        shipped = bwd_config_for(64, torch.bfloat16, causal, sdq=True)
        assert all(getattr(shipped, k) == v for k, v in D64_FA4_ROUTE.items()), shipped
        assert ordered_config(shipped) == ordered_config(variant(before)), causal
