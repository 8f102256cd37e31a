"""The shipped softmax_apart build keeps its softmax under P·V in the SASS (sm_90a, no GPU).

ptxas decides where a wgmma wait lands, not the PTX's order: with the softmax written over S it
moves P·V's wait_group(0) up to the softmax's first instructions, so P·V retires before the
softmax runs (Fa3Config.softmax_apart). This compiles two of the shipped configs that take the
flag (causal D = 256, non-causal D = 128) and causal D = 256 without it
(`python -m benchmarks.fa3_softmax_sass`, a subprocess each: the CuTe DSL reads its settings at
import) and checks each main-loop window between the Q·Kᵀ wait and the P·V wait: the shipped
builds issue their row max and exponentials there, the build without the flag does not. And
the flag ships only where it was measured and checked (configs._SOFTMAX_APART), as does
k_ahead (configs._K_AHEAD). And the two softmax options that change instruction counts:
rescale_threshold's warp vote on O's rescale (shipped at D = 256) and ex2_emu's exponentials
moved off MUFU. And what else keeps an in-place softmax under P·V: no runtime mask test in
the loop with descriptors from the warpgroup's slice (non-causal), or the causal loop split
in two (split_loops). And that each overlapped loop computes every exponential once (the
persistent non-causal build, with the LSE out by TMA, too).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")

from benchmarks.fa3_softmax_sass import RESULT

ROOT = Path(__file__).resolve().parents[1]


class _Servers:
    """`python -m benchmarks.fa3_softmax_sass --serve` processes, one build at a time each: the
    DSL reads its settings at import, so builds run outside this interpreter, and a process per
    build would import torch and the DSL again each time."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.idle: queue.Queue = queue.Queue()
        self.procs: list[tuple[subprocess.Popen, Any]] = []
        self.lock = threading.Lock()

    def _start(self) -> tuple[subprocess.Popen, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
        err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by close()
        cmd = [sys.executable, "-m", "benchmarks.fa3_softmax_sass", "--serve"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
        self.procs.append((proc, err))
        return proc, err

    def run(self, args: list[str]) -> dict:
        with self.lock:  # start servers as calls need them, up to `count`
            if self.idle.empty() and len(self.procs) < self.count:
                self.idle.put(self._start())
        proc, err = self.idle.get()
        try:
            proc.stdin.write(json.dumps(args) + "\n")
            proc.stdin.flush()
            for line in proc.stdout:
                if line.startswith(RESULT):
                    out = json.loads(line[len(RESULT) :])
                    break
            else:
                err.seek(0)
                raise AssertionError(f"sass server ended on {args}:\n{err.read()[-3000:]}")
        finally:
            self.idle.put((proc, err))
        if "error" in out:
            err.seek(0)
            raise AssertionError(f"{args}: {out['error']}\n{err.read()[-3000:]}")
        return out

    def close(self) -> None:
        for proc, err in self.procs:
            proc.stdin.close()
            proc.wait(timeout=60)
            err.close()


_SERVERS: _Servers | None = None


@pytest.fixture(scope="module", autouse=True)
def _sass_servers():
    """Two build servers for the module's tests (CI has two cores); the module-scoped fixture
    keeps the module's tests on one pytest-xdist worker (tests/conftest.py)."""
    global _SERVERS
    _SERVERS = _Servers(2)
    yield
    _SERVERS.close()
    _SERVERS = None
    _windows.cache_clear()


# e4m3 D = 128's 128 x 192 tile on two consumer warpgroups in V's key order (the table's entry
# runs 192 x 96 on three with permute_v_keys; configs._FP8_D128_TWO_WGS).
FP8_TWO_WGS = ("num_consumer_wgs=2", "tile_m=128", "tile_n=192", "permute_v_keys=0")


@functools.cache
def _windows(*sets: str, head_dim: int = 256, causal: bool = True, fp8: bool = False) -> dict:
    args = ["--head-dim", str(head_dim)]
    args += ["--causal"] if causal else []
    args += ["--fp8"] if fp8 else []
    for s in sets:
        args += ["--set", s]
    return _SERVERS.run(args)


def test_softmax_runs_under_pv_in_the_shipped_build() -> None:
    with ThreadPoolExecutor(3) as pool:
        shipped, plain, d128 = pool.map(
            lambda f: f(),
            [
                lambda: _windows(),
                lambda: _windows("softmax_apart=0"),
                lambda: _windows(head_dim=128, causal=False),
            ],
        )
    assert shipped["config"]["softmax_apart"] and not plain["config"]["softmax_apart"]
    assert d128["config"]["softmax_apart"]
    for r in (shipped, plain, d128):
        assert r["spill_stores"] == 0 and not r["remarks"], r
    # Non-causal: no mask test in the loop, one window. 128 keys per block at D = 128: 64
    # scores a thread over its two rows.
    assert len(d128["windows"]) == 1, d128["windows"]
    assert d128["windows"][0]["fmnmx"] >= 64 and d128["windows"][0]["mufu"] >= 8, d128
    # Causal: the masked and the unmasked side of the loop's branch, a window each.
    assert len(shipped["windows"]) == 2, shipped["windows"]
    for w in shipped["windows"]:
        # 80 keys per block at D = 256: a thread holds 40 scores over its two rows, so 40
        # row-max instructions at least, and a good part of the exponentials.
        assert w["fmnmx"] >= 40 and w["mufu"] >= 8, shipped["windows"]
    # Without the flag ptxas waits for P·V before the first exponential.
    assert plain["windows"] and all(w["mufu"] == 0 for w in plain["windows"]), plain["windows"]
    # Each overlapped loop computes every exponential once: one per score and row correction
    # (the causal loop's body holds both sides of its mask branch).
    for r, sides in ((shipped, 2), (d128, 1)):
        per_side = r["config"]["tile_n"] // 2 + 2
        assert r["loop_ex2"][0] == sides * per_side, (r["loop_ex2"], r["config"])


def test_lse_by_tma_keeps_the_persistent_loop_from_recomputing_exponentials() -> None:
    """The persistent non-causal D = 128 build with its own sO and the LSE out by TMA
    (Fa3Config.lse_tma): its loop computes each of its 66 exponentials once and issues them
    under P·V. With the consumer threads' LSE stores instead, the compiler recomputes most of
    P after P·V's wait (docs/results.md, "Short sequences")."""
    v2 = ("persistent=1", "overlap_tiles=1", "balanced_order=1", "o_alias_q=0", "q_stages=2")
    r = _windows(*v2, "lse_tma=1", head_dim=128, causal=False)
    assert r["spill_stores"] == 0 and not r["remarks"], r
    assert r["loop_ex2"][0] == 66, r["loop_ex2"]
    assert len(r["windows"]) == 1 and r["windows"][0]["mufu"] >= 60, r["windows"]


def test_q_in_registers_keeps_the_loop_whole() -> None:
    """Q·Kᵀ with Q in registers (Fa3Config.q_in_regs), non-causal D = 128: on the plain grid the
    loop keeps the table's schedule (66 exponentials once each, about 20 under P·V, fewer
    instructions than the table's 501 a block and warp, 0 spills). On the persistent build with
    one Q buffer (released once loaded) the softmax in place and without the loop's mask test
    also computes each exponential once; with the softmax apart the compiler computes 130 a
    block there (docs/results.md), which is why the GPU cases and timings take the in-place
    form."""
    plain = _windows("q_in_regs=1", head_dim=128, causal=False)
    table = _windows(head_dim=128, causal=False)
    assert plain["spill_stores"] == 0 and not plain["remarks"], plain
    assert plain["loop_ex2"] == [66] and plain["windows"][0]["mufu"] >= 15, plain
    assert plain["loop_insns"][0] < table["loop_insns"][0], (plain, table)
    v2 = ("persistent=1", "overlap_tiles=1", "balanced_order=1", "o_alias_q=0", "lse_tma=1")
    inplace = _windows(*v2, "q_in_regs=1", "softmax_apart=0", "loop_mask_test=0", head_dim=128,
                       causal=False)  # fmt: skip
    assert inplace["spill_stores"] == 0 and inplace["loop_ex2"][0] == 66, inplace
    assert len(inplace["windows"]) == 1 and inplace["windows"][0]["mufu"] >= 15, inplace


def test_softmax_runs_under_pv_without_a_mask_test_in_the_loop() -> None:
    """Non-causal builds without softmax_apart (D = 64 here) write the softmax over S. With a
    runtime mask test in the loop (always false there: only the peeled newest block has keys
    past seqlen_k) and descriptors built per thread, ptxas hoists P·V's wait above the
    softmax. Without the test (loop_mask_test=0) and with the warpgroup's slice (wg_slice=1)
    the body is one basic block with uniform descriptors, and the softmax stays between the
    two waits; either alone is not enough. (The D = 64 table build runs FA4's loop on top:
    test_d64_table_build_runs_fa4s_loop.)"""
    own = ("pv_wait_after_max=0", "stage_desc=0")
    builds = {
        "shipped": (*own, "loop_mask_test=1", "wg_slice=0"),
        "both": (*own, "loop_mask_test=0", "wg_slice=1"),
        "no_test": (*own, "loop_mask_test=0", "wg_slice=0"),
        "sliced": (*own, "loop_mask_test=1", "wg_slice=1"),
    }
    with ThreadPoolExecutor(4) as pool:
        got = dict(
            zip(
                builds,
                pool.map(lambda sets: _windows(*sets, head_dim=64, causal=False), builds.values()),
                strict=True,
            )
        )
    assert not got["shipped"]["config"]["softmax_apart"]
    assert got["shipped"]["config"]["loop_mask_test"] and not got["shipped"]["config"]["wg_slice"]
    for r in got.values():
        assert r["spill_stores"] == 0 and not r["remarks"], r
    # 128 keys per block: 64 scores a thread over its two rows.
    both = got["both"]["windows"]
    assert len(both) == 1 and both[0]["fmnmx"] >= 64 and both[0]["mufu"] >= 8, both
    for name in ("shipped", "no_test", "sliced"):
        assert got[name]["windows"] and all(w["mufu"] == 0 for w in got[name]["windows"]), got
    # Descriptors from the warpgroup's slice: fewer vector-to-uniform moves than from the
    # thread's own (8 a block per warp in the loop at D = 64, benchmarks/fa4_sass_compare).
    assert got["both"]["counts"]["r2ur"] < got["no_test"]["counts"]["r2ur"], got


def test_d64_table_build_runs_fa4s_loop() -> None:
    """Non-causal D = 64's table build (configs._FA4_LOOP): every row-max instruction between
    Q·Kᵀ's wait and P·V's, most exponentials after P·V's (pv_wait_after_max) but for FA4's
    count before it (pv_wait_exps = 4: the two row corrections and 4 of each row's P, 11
    MUFU.EX2; 3 with none), no mask test in the loop, and descriptors advanced from the
    stage's first (stage_desc): at least 10 fewer instructions a block and warp than the same
    build without stage_desc (438 -> 421 on sm_90a; FA4's loop 415), the windows unchanged,
    0 spills."""
    with ThreadPoolExecutor(3) as pool:
        table, rebuilt, no_exps = pool.map(
            lambda sets: _windows(*sets, head_dim=64, causal=False),
            [(), ("stage_desc=0",), ("pv_wait_exps=0",)],
        )
    cfg = table["config"]
    assert cfg["pv_wait_after_max"] and cfg["wg_slice"] and cfg["stage_desc"], cfg
    assert not cfg["loop_mask_test"] and not cfg["softmax_apart"], cfg
    assert cfg["pv_wait_exps"] == 4, cfg
    for r in (table, rebuilt, no_exps):
        assert r["spill_stores"] == 0 and not r["remarks"], r
        assert len(r["windows"]) == 1, r["windows"]
        assert r["windows"][0]["fmnmx"] >= 64, r["windows"]
        assert r["loop_ex2"] == [66], r["loop_ex2"]
    for r in (table, rebuilt):
        assert 10 <= r["windows"][0]["mufu"] <= 16, r["windows"]
    assert no_exps["windows"][0]["mufu"] <= 4, no_exps["windows"]
    assert table["loop_insns"][0] + 10 <= rebuilt["loop_insns"][0], (table, rebuilt)
    assert table["loop_insns"][0] <= no_exps["loop_insns"][0] + 2, (table, no_exps)


def test_split_loops_keep_the_causal_softmax_under_pv() -> None:
    """Causal D = 128 (the table's in-place softmax): one loop with a runtime mask test has
    no softmax between the waits; split_loops (the table's: the masked blocks, then the
    unmasked ones, no test in either) has a whole one in each loop."""
    with ThreadPoolExecutor(2) as pool:
        one, split = pool.map(
            lambda sets: _windows(*sets, head_dim=128, causal=True),
            [("split_loops=0",), ()],
        )
    assert split["config"]["split_loops"] and not split["config"]["softmax_apart"]
    for r in (one, split):
        assert r["spill_stores"] == 0 and not r["remarks"], r
    assert one["windows"] and all(w["mufu"] == 0 for w in one["windows"]), one
    assert len(split["windows"]) == 2, split["windows"]
    for w in split["windows"]:
        assert w["fmnmx"] >= 64 and w["mufu"] >= 8, split["windows"]


def _in_place_builds(option: str) -> list[tuple[int, dict]]:
    """(scores a thread's softmax takes per block, fa3_softmax_sass's result) of bf16 D = 64,
    causal D = 128 and e4m3 D = 128 with `option` on (in-place softmax), each checked to hold
    it with 0 spills, no C75xx remark and a window between the waits."""
    builds = [
        (dict(head_dim=64, causal=False), (), 64),
        (dict(head_dim=128, causal=True), (), 64),
        (dict(head_dim=128, causal=False, fp8=True), FP8_TWO_WGS, 96),
    ]
    # pin_pv_wait pins the wait pv_wait_after_max moves (D = 64's table build takes the latter).
    sets = (f"{option}=1", *(("pv_wait_after_max=0",) if option == "pin_pv_wait" else ()))
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda b: _windows(*sets, *b[1], **b[0]), builds))
    for r in got:
        assert r["config"][option] and not r["config"]["softmax_apart"]
        assert r["spill_stores"] == 0 and not r["remarks"], r
        assert r["windows"], r
    return [(scores, r) for (_, _, scores), r in zip(builds, got, strict=True)]


def test_o_zero_init_drops_the_accumulator_zeroing() -> None:
    """o_zero_init (the tile's first P·V overwrites acc_O through the wgmma's scale-d
    predicate) on the D = 128 table build: at least one CS2R zeroing per pair of acc_O's 64
    registers a thread gone from the kernel, the softmax still between the waits, 0 spills."""
    with ThreadPoolExecutor(2) as pool:
        table, zi = pool.map(
            lambda sets: _windows(*sets, head_dim=128, causal=False), [(), ("o_zero_init=1",)]
        )
    assert zi["config"]["o_zero_init"] and not table["config"]["o_zero_init"]
    for r in (table, zi):
        assert r["spill_stores"] == 0 and not r["remarks"] and r["windows"], r
    assert zi["cs2r_zero"] + 32 <= table["cs2r_zero"], (zi["cs2r_zero"], table["cs2r_zero"])
    assert [w["mufu"] for w in zi["windows"]] == [w["mufu"] for w in table["windows"]]


def test_pinned_pv_wait_keeps_the_whole_softmax_under_pv() -> None:
    """pin_pv_wait (a never-taken branch right before P·V's wait_group(0), which ptxas would
    otherwise hoist to the top of its basic block) alone, with the loop's mask test and the
    per-thread descriptors left in: the in-place softmax of bf16 D = 64, causal D = 128 and
    e4m3 D = 128 runs between the waits with every one of its exponentials (64, 64 and 96
    scores a thread per block), where the shipped builds have none there."""
    for scores, r in _in_place_builds("pin_pv_wait"):
        for w in r["windows"]:
            assert w["fmnmx"] >= scores and w["mufu"] >= scores, r["windows"]


def test_pv_wait_after_max_splits_the_softmax_at_the_row_max() -> None:
    """pv_wait_after_max (P·V's wait issued after the rows' max, rescale and exponents,
    behind a never-taken branch): the row max of every score runs between the waits, where
    the shipped in-place builds have nothing; in bf16 (D = 64, causal D = 128) most
    exponentials come after P·V's wait, FA4's split of its D = 64 loop (pin_pv_wait has them
    all before it); e4m3 D = 128's ptxas raises them above the wait as well."""
    for i, (scores, r) in enumerate(_in_place_builds("pv_wait_after_max")):
        for w in r["windows"]:
            assert w["fmnmx"] >= scores, r["windows"]
            assert i == 2 or w["mufu"] <= scores // 4, r["windows"]


def test_softmax_options_ship_where_they_were_measured(monkeypatch) -> None:
    """softmax_apart: causal D = 256 and non-causal D = 128 and 192 take it (D = 128 k_ahead
    too); softcap and windowed problems and the other shapes do not; it needs the
    intra-WG overlap it serves. wg_slice and split_loops: the entries of configs._WG_SLICE and
    _SPLIT_LOOPS and e4m3 D = 256, on the same terms; packed problems take them only with
    varlen_configs.VARLEN_SCHEDULE_OPTIONS on, and never with softcap or a window."""
    import torch

    from flashsuite.common.validation import check_inputs, check_varlen_inputs
    from flashsuite.fa3 import varlen_configs
    from flashsuite.fa3.configs import HEAD_DIMS, can_implement, config_for, get_config
    from flashsuite.fa3.varlen_configs import varlen_config

    bf16 = torch.bfloat16
    for d in HEAD_DIMS:
        for causal in (False, True):
            cfg = get_config(d, bf16, causal)
            apart = (d, causal) in ((256, True), (128, False), (192, False))
            assert cfg.softmax_apart == apart, (d, causal)
            assert cfg.k_ahead == ((d, causal) == (128, False)), (d, causal)
    q, k, v = (torch.zeros(1, 300, 2, 256, dtype=bf16) for _ in range(3))
    assert config_for(check_inputs(q, k, v, causal=True)).softmax_apart
    assert not config_for(check_inputs(q, k, v, causal=True, softcap=30.0)).softmax_apart
    assert not config_for(check_inputs(q, k, v, causal=True, window_size=(64, 0))).softmax_apart
    assert not varlen_config(256, bf16, True, options=False).softmax_apart
    assert varlen_config(256, bf16, True, options=True).softmax_apart
    # As shipped, packed problems take the options (varlen_configs.VARLEN_SCHEDULE_OPTIONS).
    assert varlen_config(256, bf16, True) == varlen_config(256, bf16, True, options=True)
    # wg_slice and split_loops (and e4m3 D 256's dropped mask test) likewise stay with the
    # dense problems without softcap or window they were timed and checked on.
    slice_loops = {
        (128, False): (True, False), (128, True): (True, True), (64, True): (True, True),
        (192, True): (True, True), (64, False): (True, False),
    }  # fmt: skip
    for (d, causal), (wgs, split) in slice_loops.items():
        # Non-causal D = 64 up to SHORT_SEQLEN_K keys runs its short build (Q in registers).
        n = 5000 if (d, causal) == (64, False) else 300
        q, k, v = (torch.zeros(1, n, 2, d, dtype=bf16) for _ in range(3))
        cfg_p = check_inputs(q, k, v, causal=causal)
        cfg = config_for(cfg_p)
        assert (cfg.wg_slice, cfg.split_loops) == (wgs, split), (d, causal)
        # FA4's loop (stage_desc, no mask test, pv_wait_after_max): non-causal D = 64 only.
        fa4_loop = (d, causal) == (64, False)
        assert get_config(d, bf16, causal).stage_desc == fa4_loop, (d, causal)
        assert get_config(d, bf16, causal).loop_mask_test != fa4_loop, (d, causal)
        exps = get_config(d, bf16, causal).pv_wait_exps
        assert exps == (4 if fa4_loop else 0) == config_for(cfg_p).pv_wait_exps, (d, causal)
        for kw in (dict(softcap=30.0), dict(window_size=(64, 0))):
            cfg = config_for(check_inputs(q, k, v, causal=causal, **kw))
            assert not (cfg.wg_slice or cfg.split_loops or cfg.stage_desc), (d, kw)
            assert cfg.loop_mask_test and not cfg.pv_wait_after_max, (d, kw)
            assert cfg.pv_wait_exps == 0, (d, kw)
        vl = varlen_config(d, bf16, causal, options=False)
        assert not (vl.wg_slice or vl.split_loops), (d, causal)
        vl = varlen_config(d, bf16, causal, options=True)
        assert (vl.wg_slice, vl.split_loops, vl.persistent) == (wgs, split, False), (d, causal)
        # Packed problems with softcap or a window keep the builds without them, switch or not.
        cu = torch.tensor([0, n], dtype=torch.int32)
        for kw in (dict(softcap=30.0), dict(window_size=(64, 0))):
            with monkeypatch.context() as m:
                m.setattr(varlen_configs, "VARLEN_SCHEDULE_OPTIONS", True)
                vp = check_varlen_inputs(q[0], k[0], v[0], cu, cu, n, n, causal=causal, **kw)
                vl = varlen_configs.varlen_config_for(vp.attn)
            assert not (vl.wg_slice or vl.split_loops) and vl.loop_mask_test, (d, kw)
    assert (get_config(96, bf16, False).wg_slice, get_config(256, bf16, True).split_loops) == (
        False, False,
    )  # fmt: skip
    # P·V's wait after the row max: non-causal D = 256 and 64, never with softcap or a window.
    for d in HEAD_DIMS:
        for causal in (False, True):
            got = get_config(d, bf16, causal).pv_wait_after_max
            assert got == ((d, causal) in ((256, False), (64, False))), (d, causal)
    q, k = torch.zeros(1, 300, 2, 256, dtype=bf16), torch.zeros(1, 900, 2, 256, dtype=bf16)
    assert config_for(check_inputs(q, k, k)).pv_wait_after_max
    for kw in (dict(softcap=30.0), dict(window_size=(64, 64))):
        assert not config_for(check_inputs(q, k, k, **kw)).pv_wait_after_max, kw
    assert not varlen_config(256, bf16, False, options=False).pv_wait_after_max
    assert varlen_config(256, bf16, False, options=True).pv_wait_after_max
    # e4m3: non-causal D = 128 and 256 slice without the mask test (D = 128 on the host-Vᵀ
    # route alone), causal D = 128 and 256 split their loops with the slice, on both Vᵀ routes;
    # softcap takes them all away.
    f8 = torch.float8_e4m3fn
    for d in (128, 256):
        for nk in (300, 9000):
            q8, k8 = torch.zeros(1, 300, 2, d, dtype=f8), torch.zeros(1, nk, 2, d, dtype=f8)
            cfg = config_for(check_inputs(q8, k8, k8))
            sliced = not (d == 128 and cfg.v_transpose == "smem")  # lost there (configs)
            assert (cfg.wg_slice, cfg.loop_mask_test) == (sliced, not sliced), (d, nk)
            assert not cfg.split_loops and cfg.v_transpose == ("smem" if nk < 600 else "host")
            cfg = config_for(check_inputs(q8, k8, k8, causal=True))
            assert cfg.wg_slice and cfg.split_loops and cfg.loop_mask_test, (d, nk)
            for causal in (False, True):
                cfg = config_for(check_inputs(q8, k8, k8, causal=causal, softcap=30.0))
                assert not (cfg.wg_slice or cfg.split_loops) and cfg.loop_mask_test, (d, nk)
    assert not get_config(64, f8, True).split_loops
    no_overlap = dataclasses.replace(get_config(256, bf16, True), intra_wg_overlap=False)
    ok, why = can_implement(no_overlap, 256, bf16)
    assert not ok and "softmax_apart needs intra_wg_overlap" in why


def test_rescale_vote_and_moved_exponentials_in_the_sass() -> None:
    """Causal D = 256 ships rescale_threshold 8: its kernel votes once per block on whether O
    needs its rescale (VOTE), the same build without the threshold does not, and with
    skip_unit_rescale instead it votes again. ex2_emu = 4 at D = 64 (192 x 128 tiles: 64
    scores a thread per block) takes a quarter of each loop copy's exponentials off MUFU. All
    spill-free, the wgmma pipeline intact."""
    with ThreadPoolExecutor(5) as pool:
        shipped, no_threshold, skip_unit, d64, d64_emu = pool.map(
            lambda f: f(),
            [
                lambda: _windows(),
                lambda: _windows("rescale_threshold=0"),
                lambda: _windows("rescale_threshold=0,skip_unit_rescale=1"),
                lambda: _windows(head_dim=64, causal=False),
                lambda: _windows("ex2_emu=4", head_dim=64, causal=False),
            ],
        )
    assert shipped["config"]["rescale_threshold"] == 8
    assert shipped["counts"]["vote"] >= 1 and no_threshold["counts"]["vote"] == 0
    assert skip_unit["counts"]["vote"] >= 1
    assert d64_emu["config"]["ex2_emu"] == 4 and d64["config"]["ex2_emu"] == 0
    # Two copies of the loop's softmax (first block and loop), 16 of 64 exponentials each.
    moved = d64["counts"]["mufu_ex2"] - d64_emu["counts"]["mufu_ex2"]
    assert moved >= 2 * 16, (d64["counts"], d64_emu["counts"])
    for r in (shipped, no_threshold, skip_unit, d64, d64_emu):
        assert r["spill_stores"] == 0 and not r["remarks"], r


def test_permuted_v_keys_drop_the_fp8_quad_exchange() -> None:
    """fp8 D = 128 (192-key blocks: 6 k-blocks x 2 row halves x 2 shuffles, in the loop's two
    softmax copies) with permute_v_keys, V transposed on the host or in shared memory: the
    quad exchange's 48 shuffles are gone, the row max and sum keep theirs; spill-free."""
    with ThreadPoolExecutor(3) as pool:
        table, host, smem = pool.map(
            lambda f: f(),
            [
                lambda: _windows(*FP8_TWO_WGS, head_dim=128, causal=False, fp8=True),
                lambda: _windows(
                    *FP8_TWO_WGS, "permute_v_keys=1", head_dim=128, causal=False, fp8=True
                ),
                lambda: _windows(
                    *FP8_TWO_WGS,
                    "permute_v_keys=1,v_transpose=smem",
                    head_dim=128,
                    causal=False,
                    fp8=True,
                ),
            ],
        )
    assert host["config"]["permute_v_keys"] and smem["config"]["v_transpose"] == "smem"
    for r in (host, smem):
        assert table["counts"]["shfl"] - r["counts"]["shfl"] == 48, (table["counts"], r)
        assert r["spill_stores"] == 0 and not r["remarks"], r


def test_spec_exps_take_the_exponentials_beside_the_row_max() -> None:
    """spec_exps on the e4m3 D = 128 entry (192 x 96 on three warpgroups, 48 scores a row per
    thread and block) and D = 256 (128 x 96 on two): spill-free within 160 and 240 registers
    though S stays live beside P; the loop holds two copies of the exponentials (against the
    running max, and again from S where a row's max grew past the threshold) with a vote
    choosing between them, and the row max keeps its FMNMX."""
    with ThreadPoolExecutor(4) as pool:
        t128, d128, t256, d256 = pool.map(
            lambda a: _windows(*a[0], head_dim=a[1], causal=False, fp8=True),
            [((), 128), (("spec_exps=1",), 128), ((), 256), (("spec_exps=1",), 256)],
        )
    for table, r in ((t128, d128), (t256, d256)):
        assert r["config"]["spec_exps"] and not table["config"]["spec_exps"]
        assert r["spill_stores"] == 0 and not r["remarks"], r
        # The 48 exponentials a thread's two rows take per block once more (the speculative
        # copy beside the table's, which the slow path runs)
        assert r["loop_ex2"][0] >= table["loop_ex2"][0] + 48, (r["loop_ex2"], table["loop_ex2"])
        assert r["counts"]["vote"] > table["counts"]["vote"], (r["counts"], table["counts"])
        assert r["loop_ops"]["FMNMX"] >= 48, r["loop_ops"]


def test_row_chains_split_the_in_place_row_max_and_sum() -> None:
    """fp8 D = 128 (192-key blocks: 48 scores of each of a thread's two rows) softmaxes in
    place; without row_chains each row's max is one chain of 48 FMNMX (plus the two after the
    quad's shuffles) and its sum one of 49 FADD (the running sum's, with the table's
    rescale_threshold 1); with them (shipped, configs._FP8_SOFTMAX)
    four chains each, a quarter as deep, and the same exponentials, shuffles and multiplies;
    spill-free."""
    with ThreadPoolExecutor(2) as pool:
        table, chains = pool.map(
            lambda f: f(),
            [
                lambda: _windows(
                    *FP8_TWO_WGS, "row_chains=0", head_dim=128, causal=False, fp8=True
                ),
                lambda: _windows(*FP8_TWO_WGS, head_dim=128, causal=False, fp8=True),
            ],
        )
    assert not table["config"]["row_chains"] and chains["config"]["row_chains"]
    assert table["chains"] == {"fmnmx": 50, "fadd": 49}, table["chains"]
    assert chains["chains"]["fmnmx"] <= 16 and chains["chains"]["fadd"] <= 14, chains["chains"]
    assert chains["counts"] == table["counts"], (chains["counts"], table["counts"])
    for r in (table, chains):
        assert r["spill_stores"] == 0 and not r["remarks"], r
