"""fa3's KV-cache decode (fa3/decode.py: split-KV, GQA packing, contiguous or paged cache).

On the CPU: the decode builds of benchmarks.fa3_decode_probe compile for sm_90a with wgmma,
5-D TMA loads, setmaxnreg and no spills; the decode config table and compile key; the split
heuristic; the host path and the dispatch wiring around a stand-in for the compiled binary that
checks its argument contract and writes known partials, which the shared Triton combine (under
the interpreter) must merge exactly. On an sm90 GPU: the kernel against the per-row float64
oracle, with NaN in every cache slot past a row's length and in the spare pages, and NaN guard
rows around out and lse that must stay untouched.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.arch import override_arch
from flashsuite.common.testing import compare
from flashsuite.common.validation import check_kvcache_inputs
from flashsuite.dispatch import registry
from tests.conftest import HAS_CUDA, must_run
from tests.test_inference import LEFTPAD_CASES, _check_all, _oracle, _paged, _rand, leftpad_case

F16, BF16 = torch.float16, torch.bfloat16
DEV = "cuda" if HAS_CUDA else "cpu"
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl not installed")
gpu_fa3 = pytest.mark.skipif(
    not HAS_CUDA or not (registry.available("fa3")[0] or must_run("fa3")),
    reason="needs fa3 on an sm90 GPU",
)


# ------------------------------------------------------------------------------------------
# CPU: compile for sm_90a
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict]:
    """`python -m benchmarks.fa3_decode_probe` (the CI set) in its own process."""
    path = tmp_path_factory.mktemp("fa3_decode_probe") / "probe.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "benchmarks.fa3_decode_probe", "--json", str(path)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"decode probe failed:\n{proc.stdout}\n{proc.stderr}"
    return {r["name"]: r for r in json.loads(path.read_text())}


def _ci_names() -> list[str]:
    if not HAS_CUTLASS:
        return []
    from benchmarks.fa3_decode_probe import CI_CASES, case_name

    return [case_name(c) for c in CI_CASES]


@needs_dsl
@pytest.mark.parametrize("name", _ci_names())
def test_decode_compiles_with_hopper_machinery(name, probes) -> None:
    r = probes[name]
    ptx = r["ptx"]
    assert ptx["wgmma"] > 0 and ptx["wgmma_rs"] > 0, "no wgmma / P·V not from registers"
    assert r["tma_5d"] >= 2, "K and V are not loaded through the 5-D ragged TMA views"
    assert ptx["tma_store"] == 0, "O leaves registers straight to global memory"
    assert r["q_loads_v4"] > 0, "Q is not gathered with 16-byte loads"
    assert r["evict_first_policies"] == 0, "an L2 policy on K / V with DECODE_KV_EVICT_FIRST off"
    assert r["setmaxnreg"] == [["dec", "56"], ["inc", "256"]], r["setmaxnreg"]
    assert r["registers"] is not None, "no ptxas report captured"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_lines"]
    for code in ("C7508", "C7512", "C7515", "C7519"):
        assert code not in r["remarks"], f"ptxas remark {code}: {r['ptxas_lines']}"
    if name.split("-")[2] == "fused":
        # One acquire-release count per CTA; the merge reads the partials through L2 with
        # 16-byte loads, 4 splits in flight (the unrolled body and its remainder).
        assert r["counter_atoms"] == 1 and r["merge_loads"] >= 5, r
    else:
        assert r["counter_atoms"] == 0 and r["merge_loads"] == 0, r


@needs_dsl
@pytest.mark.parametrize(
    "mode",
    # The evict-first builds are a lab switch (DECODE_KV_EVICT_FIRST, off): `pytest -m lab`.
    [
        "--two-ctas", "--paged-boxes", "--leftpad",
        pytest.param("--evict-first", marks=pytest.mark.lab),
    ],
)  # fmt: skip
def test_decode_variant_builds_compile(mode, tmp_path) -> None:
    """The two-CTA builds (setmaxnreg 40 / 216 from 128 registers at entry), the paged builds
    on the contiguous tiles (one TMA box per page: a 64-key box at D 128 is 2 x 2 five-D loads
    of K and V per stage, a 16-key box at D 64 8 x 1), the left-padded contiguous builds (K
    and V through their 5-D ragged views) and the builds whose K and V loads carry the L2
    evict-first policy compile for sm_90a with 0 spills."""
    path = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "benchmarks.fa3_decode_probe", mode, "--json", str(path)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"decode probe failed:\n{proc.stdout}\n{proc.stderr}"
    results = json.loads(path.read_text())
    assert results, "no build probed"
    for r in results:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (r["name"], r["ptxas_lines"])
        if mode == "--two-ctas":
            assert r["setmaxnreg"] == [["dec", "40"], ["inc", "216"]], r["setmaxnreg"]
            assert r["registers"] == 128, r["ptxas_lines"]
        elif mode == "--evict-first":
            assert r["evict_first_policies"] > 0, r["name"]
        elif mode == "--leftpad":
            assert r["name"].endswith("-leftpad") and r["tma_5d"] >= 2, (r["name"], r["tma_5d"])
            assert r["setmaxnreg"] == [["dec", "56"], ["inc", "256"]], r["setmaxnreg"]
        else:
            boxes = {"D128-paged64": 8, "D64-paged16": 16}
            want = next(n for prefix, n in boxes.items() if r["name"].startswith(prefix))
            assert "-box" in r["name"] and r["tma_5d"] == want, (r["name"], r["tma_5d"])


@needs_dsl
@pytest.mark.parametrize("page", [0, 16])
def test_kv_view_addresses_each_rows_own_tokens(page) -> None:
    """The 5-D ragged view's arithmetic (decode.kv_view_layout) against torch's own element
    offsets, on a cache whose page, token and head strides all differ (padded heads and D):
    coordinate (R - len + i, d, h, len, p) must be element (p, i, h, d) and inside the box
    exactly for i < len."""
    from flashsuite.fa3.decode import kv_view_layout
    from flashsuite.fa3.varlen import RAGGED_ROWS

    pool = torch.empty(3, page or 40, 4, 80)[:, :, :3, :64]  # (P, S, Hkv, D), padded strides
    shape, stride = kv_view_layout(tuple(pool.shape), pool.stride())
    assert shape[:3] == (RAGGED_ROWS, 64, 3) and shape[4] == 3
    base = -RAGGED_ROWS * stride[0]  # kv_view moves the base back R tokens
    for p, h, length, start in [(0, 0, 1, 0), (2, 1, 17, 0), (1, 2, pool.shape[1], 8)]:
        for i in range(start, pool.shape[1]):
            for d in (0, 63):
                coord = (RAGGED_ROWS - length + i, d, h, length, p)
                assert (coord[0] < shape[0]) == (i < length)
                if i < length:
                    at = base + sum(c * s for c, s in zip(coord, stride, strict=True))
                    want = pool[p, i, h, d].data_ptr() - pool.data_ptr()
                    assert at * pool.element_size() == want, (p, h, length, i, d)


@needs_dsl
@pytest.mark.parametrize("page", [16, 48, 64, 192])
def test_page_boxes_start_inside_the_view(page) -> None:
    """The boxed paged build's box coordinates (decode.page_box) for every box of every key
    tile of rows of 1 to 3 pages and a bit: each box starts inside the view's row extent (the
    H200 faulted on a box that started past it), reads only its row's pages, and its rows
    inside the bounds are exactly the row's keys first .. first + BOX_N - 1 below seqlen_k; a
    box past the row's end has only real keys of the row inside the bounds (its rows stand
    for keys the mask removes)."""
    from flashsuite.fa3.decode import page_box
    from flashsuite.fa3.decode_host import _tiles
    from flashsuite.fa3.varlen import RAGGED_ROWS

    tile_n = 128
    box = next(n for n in range(tile_n, 0, -16) if page % n == 0 and tile_n % n == 0)
    for seqlen in sorted({1, 2, page - 1, page, page + 1, 2 * page + 7, 3 * page + 1, 3001}):
        if seqlen < 1:
            continue
        for n_block in range(-(-seqlen // tile_n)):
            for i in range(tile_n // box):
                first = n_block * tile_n + i * box
                index, start, valid = page_box(first, seqlen, page, box < tile_n, lambda j: j)
                row = RAGGED_ROWS - valid + start  # the box's first row in the view
                assert 0 <= row < RAGGED_ROWS, (seqlen, first, row - RAGGED_ROWS)
                assert 0 <= index <= (seqlen - 1) // page and 0 < valid <= page
                inside = [j for j in range(box) if row + j < RAGGED_ROWS]
                keys = [index * page + start + j for j in inside]  # the keys those rows hold
                if first < seqlen:
                    want = list(range(first, min(first + box, seqlen)))
                    assert keys == want, (seqlen, first, keys[:3], want[:3])
                else:
                    assert keys and all(k < seqlen for k in keys), (seqlen, first, keys)
    with pytest.MonkeyPatch.context() as mp:  # the plan's box size is the one modelled here
        from flashsuite.fa3 import decode_configs

        mp.setattr(decode_configs, "DECODE_PAGED_BOXES", True)
        assert _tiles(128, page, 1)[1] == (0 if box == tile_n else box)


def test_decode_config_table() -> None:
    from flashsuite.fa3.configs import DTYPES, FP8_DTYPE, HEAD_DIMS, SMEM_CAPACITY, smem_bytes
    from flashsuite.fa3.decode_configs import decode_can_implement, decode_config

    for d in HEAD_DIMS:
        for page in (0, 16, 32, 48, 64, 96, 128, 192, 256):
            cfg = decode_config(d, page)
            assert cfg.tile_m == 64 and cfg.num_consumer_wgs == 1 and cfg.o_alias_q, cfg
            assert not (cfg.pingpong or cfg.persistent), cfg
            assert page == 0 or page % cfg.tile_n == 0, (d, page, cfg)  # a tile in one page
            assert cfg.stages >= 2 and smem_bytes(cfg, d) <= SMEM_CAPACITY, (d, page, cfg)
            for dt in DTYPES:
                assert decode_can_implement(cfg, d, dt) == (True, "")
    assert decode_config(128).tile_n == 128 and decode_config(256).tile_n == 64
    assert decode_config(128, 48).tile_n == 48 and decode_config(128, 192).tile_n == 96
    ok, reason = decode_can_implement(decode_config(128), 128, FP8_DTYPE)
    assert not ok and "float8_e4m3fn" in reason
    ok, reason = decode_can_implement(decode_config(128), 80, BF16)
    assert not ok and "head_dim 80" in reason


def test_decode_compile_key() -> None:
    from flashsuite.fa3 import disk_cache
    from flashsuite.fa3.compile import DecodeKey
    from flashsuite.fa3.decode_configs import decode_config

    cfg = decode_config(128)
    keys = {
        DecodeKey(BF16, 128, c, False, False, paged, split, cfg)
        for c in (False, True)
        for paged in (False, True)
        for split in (False, True)
    }
    assert len(keys) == 8 and len({disk_cache.key_text(k) for k in keys}) == 8
    assert "paged=True" in disk_cache.key_text(
        DecodeKey(BF16, 128, False, False, False, True, False, cfg)
    )


def test_split_heuristic() -> None:
    from flashsuite.fa3.decode_configs import DECODE_MAX_SPLITS
    from flashsuite.fa3.decode_host import num_splits_heuristic, plan

    sms = 132
    # B = 1, GQA 32/8, 128k keys in 128-key tiles: 8 CTAs alone leave 124 SMs idle.
    one = num_splits_heuristic(8, 1024, sms)
    assert 8 * one <= sms and 8 * one >= 0.9 * sms and one <= DECODE_MAX_SPLITS
    assert num_splits_heuristic(32 * 8, 32, sms) == 1  # B = 32 fills the GPU by itself
    assert num_splits_heuristic(8, 3, sms) == 1  # too few key tiles to split
    # B = 1, 4k keys: splits of 4 tiles, not 16 of 2 (the H200: 19.6 against 23.2 us).
    assert num_splits_heuristic(8, 32, sms) == 8
    mid = num_splits_heuristic(8 * 8, 256, sms)  # B = 8, 32k
    assert 1 < mid < one
    params = _params(b=1, nq=1, hq=32, hkv=8, cap=131072, page=0, splits=0)
    cfg, m_blocks, splits, ctas, _ = plan(params, sms)
    assert (cfg.tile_n, m_blocks, splits, ctas) == (128, 1, one, 1)
    assert plan(_params(1, 1, 32, 8, 131072, 0, 3), sms)[2] == 3  # explicit count kept
    assert plan(_params(1, 40, 32, 8, 4096, 0, 1), sms)[1] == 3  # 40 tokens x 4 heads / 64


def test_paged_boxes_plan(monkeypatch) -> None:
    """With DECODE_PAGED_BOXES (shipped) a paged cache keeps the contiguous cache's key tiles
    and loads a stage as one box per page: the largest multiple of 16 that divides both the
    page and the tile (0: one box a stage); without it the tiles shrink to the page."""
    from flashsuite.fa3 import decode_configs
    from flashsuite.fa3.decode_host import H100_SMS as sms
    from flashsuite.fa3.decode_host import plan

    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_MIN_TILES", None)
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS", False)  # one-CTA tiles
    assert decode_configs.DECODE_PAGED_BOXES
    monkeypatch.setattr(decode_configs, "DECODE_PAGED_BOXES", False)
    assert plan(_params(1, 1, 32, 8, 4096, 64, 0), sms).cfg.tile_n == 64  # tiles cut to the page
    monkeypatch.setattr(decode_configs, "DECODE_PAGED_BOXES", True)
    for page, box in ((16, 16), (32, 32), (48, 16), (64, 64), (96, 32), (128, 0), (256, 0)):
        got = plan(_params(1, 1, 32, 8, 768 if page == 96 else 4096, page, 0), sms)
        assert (got.cfg.tile_n, got.page_box) == (128, box), (page, got)
    assert plan(_params(1, 1, 32, 8, 4096, 0, 0), sms).page_box == 0  # contiguous: one box
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_MIN_TILES", 0)  # 64-key tiles
    got = plan(_params(32, 1, 32, 8, 4096, 16, 1), sms)
    assert (got.ctas_per_sm, got.cfg.tile_n, got.page_box) == (2, 64, 16)
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS", True)  # a split call on it
    got = plan(_params(1, 1, 32, 8, 4096, 16, 0), sms)
    assert (got.ctas_per_sm, got.cfg.tile_n, got.page_box, got.splits) == (2, 64, 16, 16)


def test_two_ctas_per_sm_plan(monkeypatch) -> None:
    """One-split calls of at least DECODE_TWO_CTAS_MIN_TILES tiles take the build two CTAs of
    which share an SM (half the shared memory: 64-key tiles at D 128, 3 stages; 128 registers a
    thread at entry) at the head dims it is measured at; split calls keep one CTA per SM unless
    that plan leaves more than half the SMs idle (DECODE_TWO_CTAS_SPLITS), then take it too,
    their heuristic aimed at two CTAs per SM."""
    from flashsuite.fa3 import decode_configs
    from flashsuite.fa3.configs import smem_bytes
    from flashsuite.fa3.decode_configs import SMEM_PER_CTA_2, decode_config
    from flashsuite.fa3.decode_host import H100_SMS as sms
    from flashsuite.fa3.decode_host import plan

    for d, tile_n in ((64, 128), (96, 80), (128, 64), (192, 32), (256, 32)):
        cfg = decode_config(d, 0, ctas_per_sm=2)
        assert cfg.tile_n == tile_n and smem_bytes(cfg, d) <= SMEM_PER_CTA_2 and cfg.stages >= 2
    assert decode_config(128, 0, 2).stages == 3 and decode_config(128, 32, 2).tile_n == 32
    big = _params(32, 1, 32, 8, 4096, 0, 0)  # 256 tiles: one split
    assert plan(big, sms)[3] == (2 if decode_configs.DECODE_TWO_CTAS_MIN_TILES is not None else 1)
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_MIN_TILES", None)
    assert plan(big, sms)[3] == 1  # switched off
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_MIN_TILES", 256)
    cfg, _, splits, ctas, _ = plan(big, sms)
    assert (cfg.tile_n, cfg.stages, splits, ctas) == (64, 3, 1, 2)
    assert plan(_params(16, 1, 32, 8, 4096, 0, 0), sms)[3] == 1  # 128 tiles: under the bound
    assert plan(_params(32, 1, 32, 8, 4096, 0, 2), sms)[2:4] == (2, 1)  # split: one CTA per SM
    assert plan(_params(1, 1, 32, 8, 131072, 0, 0), sms)[3] == 1  # the heuristic splits
    assert plan(_params(32, 1, 32, 8, 4096, 0, 0, d=256), sms)[3] == 1  # not measured at D 256
    # DECODE_TWO_CTAS_SPLITS: split calls whose one-CTA plan leaves more than half the SMs
    # idle take the two-CTA build, aimed at two CTAs per SM.
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS", True)
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS_FILL", 0.5)
    cfg, _, splits, ctas, _ = plan(_params(1, 1, 32, 8, 4096, 0, 0), sms)
    assert (cfg.tile_n, splits, ctas) == (64, 16, 2)  # 8 tiles x 8 splits = 64 CTAs otherwise
    assert plan(_params(1, 1, 32, 8, 32768, 0, 0), sms)[2:4] == (16, 1)  # 128 CTAs: kept
    assert plan(_params(1, 1, 32, 8, 4096, 0, 0, d=256), sms)[3] == 1  # not measured at D 256
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS", False)
    assert plan(_params(1, 1, 32, 8, 4096, 0, 0), sms)[2:4] == (8, 1)
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS", True)
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS_FILL", math.inf)  # every split call
    cfg, _, splits, ctas, _ = plan(_params(1, 1, 32, 8, 131072, 0, 0), sms)
    assert (cfg.tile_n, ctas) == (64, 2) and 8 * splits == 2 * sms  # 8 tiles x 33 splits
    assert plan(_params(8, 1, 32, 8, 4096, 0, 3), sms)[2:4] == (3, 2)  # a forced count kept
    assert plan(_params(32, 1, 32, 8, 4096, 0, 2), sms)[2:4] == (2, 2)


# ------------------------------------------------------------------------------------------
# CPU: the host path and dispatch around a stand-in binary
# ------------------------------------------------------------------------------------------
def _params(b, nq, hq, hkv, cap, page, splits, d=128):
    q = torch.empty(b, nq, hq, d, dtype=BF16, device="meta")
    if page:
        kc = torch.empty(b * cap // page, page, hkv, d, dtype=BF16, device="meta")
        table = torch.empty(b, cap // page, dtype=torch.int32, device="meta")
    else:
        kc, table = torch.empty(b, cap, hkv, d, dtype=BF16, device="meta"), None
    return check_kvcache_inputs(q, kc, kc, cache_seqlens=1, block_table=table, num_splits=splits)


class StandIn:
    """The compiled decode binary's argument contract; writes known results: with S splits,
    split s's partial O is s + 1 everywhere and its LSE log(s + 1), so the combine must give
    out = sum (s+1)^2 / sum (s+1) and lse = log(sum (s+1)). A fused-combine build also gets
    out, lse and zeroed per-tile counters, and merges the partials into them itself."""

    def __init__(self, key) -> None:
        self.key, self.calls = key, []

    def __call__(self, q, kc, vc, o_rows, lse, table, seqlens, out_f, lse_f, counters, n_new,
                 splits, *scalars):  # fmt: skip
        b, nq, hq, d = q.shape
        rows = b * nq * hq
        assert self.key.split == (splits > 1) and len(scalars) == 4
        assert o_rows.shape == (splits * rows, d) and o_rows.is_contiguous()
        assert o_rows.dtype == (torch.float32 if splits > 1 else q.dtype)
        assert lse.shape == (splits * rows,) and lse.dtype == torch.float32
        assert (table is not None) == self.key.paged and seqlens.dtype == torch.int32
        assert kc.stride(-1) == 1 and all(s % 8 == 0 for s in kc.stride()[:3])
        part = torch.arange(1, splits + 1, dtype=torch.float32)[:, None]  # (S, 1)
        o_rows.view(splits, rows, d).copy_(part[:, :, None].expand(splits, rows, d))
        lse.view(splits, rows).copy_(part.log().expand(splits, rows))
        if self.key.fused_combine:
            hkv = kc.shape[2]
            m_blocks = -(-nq * (hq // hkv) // 64)
            assert out_f.shape == (rows, d) and out_f.dtype == q.dtype and out_f.is_contiguous()
            assert lse_f.shape == (b * hq * nq,) and lse_f.dtype == torch.float32
            assert counters.shape == (b * hkv * m_blocks,) and counters.dtype == torch.int32
            assert not counters.any(), "the counters must start at 0"
            w = part.double()
            out_f.copy_(((w * w).sum() / w.sum()).expand(rows, d))
            lse_f.fill_(math.log(w.sum()))
        else:
            assert out_f is None and lse_f is None and counters is None
        self.calls.append((splits, n_new))


def _no_combine(*args) -> None:
    raise AssertionError("the Triton combine ran for a fused-combine build")


@pytest.fixture
def stand_in(monkeypatch) -> list:
    from flashsuite.fa3 import compile as fa3_compile
    from flashsuite.fa3 import decode_host

    made = []
    monkeypatch.setattr(decode_host, "_launch_plans", {})  # plans hold the binary they took

    def get_decode(key):
        made.append(StandIn(key))
        return made[-1]

    monkeypatch.setattr(fa3_compile, "get_decode", get_decode)
    return made


@pytest.mark.parametrize("fused", [False, True], ids=["triton-combine", "fused-combine"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page", [0, 32])
def test_host_path_splits_and_combine(stand_in, splits, page, fused, monkeypatch) -> None:
    pytest.importorskip("triton")
    from flashsuite.fa3 import decode_configs, decode_host
    from flashsuite.fa3.decode_host import kvcache_forward

    monkeypatch.setattr(decode_configs, "DECODE_FUSED_COMBINE", fused)
    if fused:  # the kernel merges: no second launch
        monkeypatch.setattr(decode_host, "combine_splits", _no_combine)

    b, nq, hq, hkv, d, cap = 2, 2, 8, 2, 64, 64
    # On the suite's device: on a GPU host the shared combine is Triton's compiled kernel,
    # which takes CUDA tensors only (the interpreter runs it on a CPU machine).
    q = torch.randn(b, nq, hq, d, dtype=BF16, device=DEV)
    pages = b * cap // page if page else b
    kc = torch.zeros(pages, page or cap, hkv, d, dtype=BF16, device=DEV)
    vc = torch.zeros_like(kc)
    table = torch.arange(pages, dtype=torch.int32, device=DEV).reshape(b, -1) if page else None
    lens = torch.tensor([5, 0], dtype=torch.int32, device=DEV)
    kn = torch.ones(b, 1, hkv, d, dtype=BF16, device=DEV)
    kp = check_kvcache_inputs(
        q, kc, vc, kn, kn, cache_seqlens=lens, block_table=table, num_splits=splits
    )
    out, lse = kvcache_forward(q, kc, vc, kn, kn, lens, table, kp)
    (binary,) = stand_in
    assert binary.calls == [(splits, 1)] and binary.key.paged == (page > 0)
    assert binary.key.fused_combine == (fused and splits > 1)
    assert out.shape == (b, nq, hq, d) and lse.shape == (b, hq, nq)
    w = torch.arange(1, splits + 1, dtype=torch.float64, device=DEV)
    expect = (w * w).sum() / w.sum()
    if splits > 1:
        assert torch.equal(out, torch.full_like(out, float(expect)))  # rounded once, to bf16
        torch.testing.assert_close(lse, torch.full_like(lse, math.log(w.sum())))
    flat = kc[table[0].long()].flatten(0, 1) if page else kc[0]
    assert torch.equal(flat[5], kn[0, 0]), "the new token was not appended at cache_seqlens"


def test_leftpad_reaches_the_build_as_the_lengths_second_half(stand_in, monkeypatch) -> None:
    """With cache_leftpad the decode binary is the leftpad build and takes (2B,) int32: the
    lengths, then each row's first key slot; without, (B,) and the plain build."""
    from flashsuite.fa3.decode_host import kvcache_forward

    seen = []
    real = StandIn.__call__

    def record(self, q, kc, vc, o, lse, table, seqlens, *rest):
        seen.append((self.key.leftpad, seqlens.tolist()))
        return real(self, q, kc, vc, o, lse, table, seqlens, *rest)

    monkeypatch.setattr(StandIn, "__call__", record)
    q = torch.randn(2, 1, 8, 64, dtype=BF16, device=DEV)
    kc = torch.zeros(2, 64, 2, 64, dtype=BF16, device=DEV)
    lens = torch.tensor([40, 9], dtype=torch.int32, device=DEV)
    pads = torch.tensor([7, 9], dtype=torch.int32, device=DEV)
    kp = check_kvcache_inputs(q, kc, kc, cache_seqlens=lens, cache_leftpad=pads, num_splits=1)
    kvcache_forward(q, kc, kc, None, None, lens, None, kp, leftpad=pads)
    plain = check_kvcache_inputs(q, kc, kc, cache_seqlens=lens, num_splits=1)
    kvcache_forward(q, kc, kc, None, None, lens, None, plain)
    assert seen == [(True, [40, 9, 7, 9]), (False, [40, 9])]
    with pytest.raises(ValueError, match="leftpad"):
        kvcache_forward(q, kc, kc, None, None, lens, None, kp)  # the build needs the padding


def test_loop_mask_test_switch_reaches_the_build(stand_in, monkeypatch) -> None:
    """decode_configs.DECODE_LOOP_MASK_TEST picks the decode build's Fa3Config.loop_mask_test, and
    the launch plans are cached per switch setting (flipping it between calls, as
    benchmarks/decode_switch_ab does, takes the other build)."""
    from flashsuite.fa3 import decode_configs, decode_host

    q = torch.randn(1, 1, 8, 128, dtype=BF16)
    kc = torch.zeros(1, 512, 2, 128, dtype=BF16)
    kp = check_kvcache_inputs(q, kc, kc, cache_seqlens=300, num_splits=2)
    for flag in (True, False, True):
        monkeypatch.setattr(decode_configs, "DECODE_LOOP_MASK_TEST", flag)
        decode_host.launch_plan(kp, torch.device("cpu"))
    assert [b.key.cfg.loop_mask_test for b in stand_in] == [True, False]


def test_captured_calls_get_disjoint_zeroed_counters(monkeypatch) -> None:
    """Calls captured into CUDA graphs take their split counters from a pool zeroed outside any
    capture: disjoint slices, one per call, so no graph needs a memset node and graphs on
    different streams never share a counter; without a pool, or once it is spent, a call
    gets a fresh zeroed buffer (which a graph zeroes itself)."""
    from flashsuite.fa3 import decode_host

    cpu = torch.device("cpu")
    monkeypatch.setattr(decode_host, "_capture_pool", {})
    monkeypatch.setattr(decode_host, "CAPTURE_POOL_COUNTERS", 100)
    fresh = decode_host._captured_counters(8, cpu)  # no eager call yet: no pool
    assert fresh.numel() == 8 and not fresh.any() and decode_host._capture_pool == {}
    decode_host._ensure_capture_pool(cpu)
    pool = decode_host._capture_pool[cpu][0]
    got = [decode_host._captured_counters(n, cpu) for n in (40, 1, 59)]
    for t, (lo, n) in zip(got, ((0, 40), (40, 1), (41, 59)), strict=True):
        assert t.numel() == n and t.data_ptr() == pool[lo:].data_ptr() and not t.any()
    spent = decode_host._captured_counters(1, cpu)  # 100 handed out: a buffer of its own
    assert spent.numel() == 1 and not spent.any()
    assert not (pool.data_ptr() <= spent.data_ptr() < pool.data_ptr() + 4 * pool.numel())
    decode_host._ensure_capture_pool(cpu)  # a second eager call keeps the pool and its count
    assert decode_host._capture_pool[cpu][0] is pool and decode_host._capture_pool[cpu][1] == 100


def _stand_in_gpu_allocations(dtype: torch.dtype) -> tuple:
    """(device, made, alloc): a CUDA device name and a CPU allocator standing in for it,
    alloc(n, device) -> zeros of `dtype`, each kept in `made` (for host-path tests that count
    what a call allocates)."""
    gpu = torch.device("cuda", 0)
    made = []

    def alloc(n, device):
        assert device == gpu
        made.append(torch.zeros(n, dtype=dtype))
        return made[-1]

    return gpu, made, alloc


def test_split_counters_repeat_calls_reuse_one_view_per_stream(monkeypatch) -> None:
    """Eager split_counters on a GPU (its CUDA calls stood in for on the CPU): a repeat call with
    the same stream and count returns the same view without allocating; counts on one stream
    share its buffer; another stream gets a buffer of its own, so launches that may run at
    once never share a counter; a count past the buffer replaces it, and the views of the old
    one are not handed out again; a call under capture takes a capture-pool slice."""
    from flashsuite.fa3 import decode_host

    gpu, made, zeros = _stand_in_gpu_allocations(torch.int32)
    stream = [7]
    for name, value in (("_counters", {}), ("_counter_views", {}), ("_capture_pool", {}),
                        ("_zeros", zeros), ("cuda_stream_capturing", lambda: False),
                        ("_raw_stream", lambda index: stream[0])):  # fmt: skip
        monkeypatch.setattr(decode_host, name, value)
    pools = []
    monkeypatch.setattr(decode_host, "_ensure_capture_pool", pools.append)
    first = decode_host.split_counters(2, gpu)
    assert pools == [gpu] and [t.numel() for t in made] == [1024]
    assert first.numel() == 2 and first.data_ptr() == made[0].data_ptr()
    assert decode_host.split_counters(2, gpu) is first and len(made) == 1
    wide = decode_host.split_counters(40, gpu)  # the same stream's buffer
    assert wide.numel() == 40 and wide.data_ptr() == first.data_ptr() and len(made) == 1
    stream[0] = 9
    other = decode_host.split_counters(2, gpu)
    assert len(made) == 2 and other.data_ptr() == made[1].data_ptr() != first.data_ptr()
    stream[0] = 7
    assert decode_host.split_counters(2, gpu) is first
    big = decode_host.split_counters(2000, gpu)  # past 1024 counters: a new buffer
    assert [t.numel() for t in made] == [1024, 1024, 2000] and big.data_ptr() == made[2].data_ptr()
    again = decode_host.split_counters(2, gpu)
    assert again is not first and again.data_ptr() == made[2].data_ptr()
    stream[0] = 9
    assert decode_host.split_counters(2, gpu) is other  # stream 9 keeps its buffer
    monkeypatch.setattr(decode_host, "cuda_stream_capturing", lambda: True)
    monkeypatch.setattr(decode_host, "_captured_counters", lambda n, device: ("pool slice", n))
    assert decode_host.split_counters(2, gpu) == ("pool slice", 2)


def test_split_partials_reuse_one_buffer_per_stream(monkeypatch) -> None:
    """Eager split_partials on a GPU (its CUDA calls stood in for on the CPU): the partial O
    (n, d) and LSE (n,) of a fused split call are views of one float32 buffer per stream,
    made once per (stream, n, d); another stream gets its own buffer; a larger call grows it
    and the old views are not handed out again; under capture, or past PARTIALS_CACHE_BYTES,
    every call gets a buffer of its own; at most PARTIALS_STREAMS buffers are kept. LSE starts
    after O, 128-byte aligned."""
    from flashsuite.fa3 import decode_host

    gpu, made, scratch = _stand_in_gpu_allocations(torch.float32)
    stream, capturing = [7], [False]
    for name, value in (("_partial_bufs", {}), ("_partial_views", {}), ("_scratch", scratch),
                        ("cuda_stream_capturing", lambda: capturing[0]),
                        ("_raw_stream", lambda index: stream[0])):  # fmt: skip
        monkeypatch.setattr(decode_host, name, value)
    o, lse = decode_host.split_partials(512, 128, gpu)
    assert (o.shape, lse.shape) == ((512, 128), (512,)) and len(made) == 1
    assert o.data_ptr() == made[0].data_ptr() and lse.data_ptr() == o.data_ptr() + 4 * 512 * 128
    assert lse.data_ptr() % 128 == o.data_ptr() % 128
    assert decode_host.split_partials(512, 128, gpu)[0] is o and len(made) == 1
    small = decode_host.split_partials(64, 96, gpu)  # the same stream's buffer, other views
    assert small[0].data_ptr() == o.data_ptr() and len(made) == 1
    assert (small[1].data_ptr() - small[0].data_ptr()) % 128 == 0
    stream[0] = 9
    other = decode_host.split_partials(512, 128, gpu)
    assert len(made) == 2 and other[0].data_ptr() == made[1].data_ptr()
    stream[0] = 7
    grown = decode_host.split_partials(1024, 128, gpu)  # past the buffer: a larger one
    assert len(made) == 3 and grown[0].data_ptr() == made[2].data_ptr()
    again = decode_host.split_partials(512, 128, gpu)
    assert again[0] is not o and again[0].data_ptr() == made[2].data_ptr()
    capturing[0] = True
    decode_host.split_partials(512, 128, gpu)
    decode_host.split_partials(512, 128, gpu)
    assert len(made) == 5  # each captured call its own
    capturing[0] = False
    n_big = decode_host.PARTIALS_CACHE_BYTES // (4 * 129) + 1
    decode_host.split_partials(n_big, 128, gpu)
    decode_host.split_partials(n_big, 128, gpu)
    assert len(made) == 7 and all(k[2] != n_big for k in decode_host._partial_views)
    for s in range(100, 100 + 2 * decode_host.PARTIALS_STREAMS):  # many streams: bounded
        stream[0] = s
        decode_host.split_partials(8, 64, gpu)
    assert len(decode_host._partial_bufs) <= decode_host.PARTIALS_STREAMS


def test_dispatch_runs_fa3_for_auto_and_by_name(stand_in, monkeypatch) -> None:
    """Auto selection takes fa3's decode on sm90 (decode_configs.KVCACHE_AUTO) and fa2's when the
    switch is off, saying why; version="fa3" runs it either way; float32 is refused by name."""
    pytest.importorskip("triton")
    if not HAS_CUTLASS:
        pytest.skip("needs the CuTe DSL (fa3 planning)")
    from flashsuite.fa3 import interface

    q = torch.randn(2, 1, 8, 64, dtype=BF16)
    kc = torch.zeros(2, 64, 2, 64, dtype=BF16)
    with override_arch(90):
        assert dispatch.select_kvcache(q, kc, kc, cache_seqlens=3).version == "fa3"
        monkeypatch.setattr(interface, "KVCACHE_AUTO_SELECT", False)
        text = dispatch.explain_kvcache(q, kc, kc, cache_seqlens=3)
        assert text.splitlines()[0].endswith("-> fa2"), text
        assert "fa3: no - fa3: split-KV decode kernel not in auto selection yet" in text, text
        choice = dispatch.select_kvcache(q, kc, kc, cache_seqlens=3, version="fa3")
        assert choice.version == "fa3" and "GQA packing" in str(choice), str(choice)
        fp32 = dispatch.explain_kvcache(q.float(), kc.float(), kc.float(), cache_seqlens=3)
        assert "fa3: no" in fp32 and "float32" in fp32, fp32
        out = dispatch.attention_with_kvcache(q, kc, kc, cache_seqlens=3, version="fa3")
    assert out.shape == q.shape and len(stand_in) == 1


# ------------------------------------------------------------------------------------------
# Dense problems on the decode kernel (fa3.interface.decode_route)
# ------------------------------------------------------------------------------------------
def _dense(b, nq, nk, hq, hkv, d, dtype=BF16, dv=None, device="meta", **options):
    from flashsuite.common.validation import check_inputs

    q = torch.empty(b, nq, hq, d, dtype=dtype, device=device)
    k = torch.empty(b, nk, hkv, d, dtype=dtype, device=device)
    v = torch.empty(b, nk, hkv, dv or d, dtype=dtype, device=device)
    return check_inputs(q, k, v, **options)


@pytest.mark.parametrize(
    ("shape", "options", "routed"),
    [
        ((8, 1, 4096, 32, 8, 128), {}, True),  # a decode step: 4 packed rows
        ((2, 16, 4096, 32, 8, 128), dict(causal=True), True),  # 64 rows: one decode tile
        ((2, 17, 4096, 32, 8, 128), dict(causal=True), False),  # 68 rows
        ((2, 8, 4096, 64, 8, 128), {}, True),  # GQA 8: 64 rows
        ((2, 9, 4096, 64, 8, 128), {}, False),  # 72 rows
        ((1, 1, 4096, 32, 32, 128), {}, True),  # MHA: 32 (batch, head) tiles
        ((2, 16, 300, 16, 16, 64), dict(window_size=(50, 0), softcap=5.0), True),  # MHA, 32
        ((2, 17, 300, 16, 16, 64), {}, False),  # more than 16 queries
        ((4, 1, 4096, 16, 16, 128), {}, False),  # MHA: 64 tiles fill the forward's grid
        ((1, 1, 7, 8, 1, 256), {}, True),  # fewer keys than a tile
        ((1, 1, 4096, 8, 8, 80), {}, False),  # a head dim the decode kernel lacks
        ((1, 1, 4096, 8, 8, 128, torch.float32), {}, False),
        ((1, 1, 4096, 8, 8, 128, BF16, 64), {}, False),  # Dv != D
        ((1, 1, 0, 8, 8, 128), {}, False),  # no keys: forward's own path
    ],
)  # fmt: skip
def test_decode_route_policy(shape, options, routed, monkeypatch) -> None:
    """Dense 16-bit problems of at most 16 queries whose packed rows (Nq x Hq / Hkv) fit one
    decode tile, with GQA or with fewer than 64 (batch, head) tiles, run on the split-KV
    decode kernel with k, v as full cache rows (decode_route: the problem itself, no new
    tokens, a contiguous cache, the heuristic's splits), and explain() says so; others, and
    every problem with DECODE_ROUTE_MAX_ROWS = 0, keep the forward kernel."""
    pytest.importorskip("triton")
    from flashsuite.fa3 import interface

    p = _dense(*shape, **options)
    kp = interface.decode_route(p)
    assert (kp is not None) == routed
    if routed:
        assert (kp.attn, kp.seqlen_new, kp.page_size, kp.num_splits) == (p, 0, 0, 0)
        ok, reason = interface.supports(p, 90)
        assert ok and "split-KV decode" in reason, reason
        monkeypatch.setattr(interface, "DECODE_ROUTE_MAX_ROWS", 0)
        assert interface.decode_route(p) is None
        assert "split-KV decode" not in interface.supports(p, 90)[1]
    elif interface.supports(p, 90)[0]:
        assert "split-KV decode" not in interface.supports(p, 90)[1]


def test_decode_route_runs_the_decode_binary(stand_in, monkeypatch) -> None:
    """A routed problem through fa3's forward and its bound form (dispatch's plans) reaches the
    decode binary with k, v as the cache and every row's length = Nk (int32, on the stand-in's
    contract), no new tokens and no block table; out and lse come back in the forward's
    shapes. Route off, the forward's own path runs instead (no decode binary)."""
    pytest.importorskip("triton")
    from flashsuite.fa3 import decode_host, interface

    b, nq, nk, hq, hkv, d = 3, 2, 200, 8, 2, 64
    q = torch.randn(b, nq, hq, d, dtype=BF16, device=DEV)
    k, v = (torch.randn(b, nk, hkv, d, dtype=BF16, device=DEV) for _ in range(2))
    p = _dense(b, nq, nk, hq, hkv, d, device=DEV, causal=True)
    seen = []
    real = decode_host.kvcache_forward

    def spy(q_, kc, vc, kn, vn, lens, table, kp, **kw):
        seen.append((kc is k, vc is v, kn, vn, lens.tolist(), lens.dtype, table, kp))
        return real(q_, kc, vc, kn, vn, lens, table, kp, **kw)

    monkeypatch.setattr(decode_host, "kvcache_forward", spy)
    out, lse = interface.forward(q, k, v, p)
    out2, lse2 = interface.bind_forward(p)(q, k, v)
    kp = interface.decode_route(p)
    want = (True, True, None, None, [nk] * b, torch.int32, None, kp)
    assert seen == [want, want] and len(stand_in) == 1 and stand_in[0].calls == [(1, 0)] * 2
    for o, lse_ in ((out, lse), (out2, lse2)):
        assert o.shape == q.shape and lse_.shape == (b, hq, nq)
    monkeypatch.setattr(interface, "DECODE_ROUTE_MAX_ROWS", 0)
    monkeypatch.setattr(interface, "_launch_plan", _no_forward_kernel)
    with pytest.raises(AssertionError, match="forward kernel"):
        interface.forward(q, k, v, p)
    assert len(seen) == 2


def _no_forward_kernel(*args) -> None:
    raise AssertionError("the forward kernel's launch plan was asked for")


# ------------------------------------------------------------------------------------------
# GPU: the kernel against the per-row oracle
# ------------------------------------------------------------------------------------------
# (B, Nq, Nnew, Hq, Hkv, D, dtype, cache_seqlens, capacity, page_size, num_splits, options)
GPU_CASES = [
    (1, 1, 0, 32, 8, 128, BF16, [3000], 4096, 0, 0, {}),
    (1, 1, 1, 32, 8, 128, BF16, [2999], 4096, 64, 3, {}),
    (8, 1, 0, 32, 8, 128, BF16, [0, 1, 127, 128, 129, 700, 2048, 4095], 4096, 0, 0, {}),
    (8, 1, 0, 32, 8, 128, F16, [0, 1, 127, 128, 129, 700, 2048, 4095], 4096, 128, 3, {}),
    (
        8,
        4,
        4,
        32,
        8,
        128,
        BF16,
        [0, 1, 60, 200, 500, 900, 1000, 1020],
        1024,
        0,
        1,
        dict(causal=True),
    ),
    (
        8,
        4,
        0,
        8,
        8,
        128,
        BF16,
        [1, 2, 60, 200, 500, 900, 1000, 1024],
        1024,
        64,
        0,
        dict(causal=True),
    ),
    (
        8,
        4,
        2,
        32,
        8,
        64,
        BF16,
        [0, 1, 60, 200, 500, 900, 1000, 1000],
        1024,
        16,
        3,
        dict(causal=True, window_size=(100, 0)),
    ),
    (1, 4, 0, 8, 8, 128, F16, [1500], 2048, 0, 3, dict(window_size=(300, 50), softcap=20.0)),
    (8, 1, 0, 32, 8, 256, BF16, [0, 1, 63, 64, 65, 300, 511, 512], 512, 64, 0, dict(softcap=10.0)),
    (1, 40, 0, 32, 8, 128, BF16, [2000], 2048, 256, 0, dict(causal=True)),  # 3 m-blocks
]


def _case_id(c) -> str:
    b, nq, n_new, hq, hkv, d, dt, _, _, page, splits, opts = c
    return (
        f"b{b}-nq{nq}-new{n_new}-h{hq}x{hkv}-D{d}-{str(dt)[6:]}-page{page}-s{splits}"
        f"-{'-'.join(opts) or 'plain'}"
    )


@gpu_fa3
@pytest.mark.parametrize(
    "build",
    ["triton-combine", "fused-combine", "two-ctas", "two-ctas-split", "paged-tiles",
     "no-loop-test"],
)  # fmt: skip
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_decode_matches_per_row_oracle(case, build, monkeypatch) -> None:
    """The kernel against a float64 oracle per row. With the fused combine (split builds
    only) the call runs twice: the second must give the same bits, so the kernel left its
    per-tile counters at 0 for the next launch. "two-ctas": the case in one split through the
    build two CTAs of which share an SM (decode_configs.DECODE_TWO_CTAS_MIN_TILES), where its head
    dim has one; "two-ctas-split": its splits through that build with the fused combine
    (decode_configs.DECODE_TWO_CTAS_SPLITS, for every split call), twice as well; the other
    builds run their splits on one CTA per SM. Paged cases run on the
    contiguous key tiles, one TMA box per page (decode_configs.DECODE_PAGED_BOXES, shipped);
    "paged-tiles": on key tiles cut to the page (the switch off). "no-loop-test": the main
    loop without its runtime mask test where nothing in it is masked
    (decode_configs.DECODE_LOOP_MASK_TEST off)."""
    from flashsuite.fa3 import decode_configs
    from flashsuite.fa3.decode_host import H100_SMS, kvcache_forward, plan

    b, nq, n_new, hq, hkv, d, dtype, lens, cap, page, splits, options = case
    two_split = build == "two-ctas-split"
    fused = build in ("fused-combine", "two-ctas-split")
    if fused and splits == 1:
        pytest.skip("one split: nothing to combine")
    if two_split and d not in decode_configs.DECODE_TWO_CTAS_HEAD_DIMS:
        pytest.skip(f"no two-CTA build at D {d}")
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS", two_split)
    monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_SPLITS_FILL", math.inf)  # every split
    if build == "two-ctas":
        if d not in decode_configs.DECODE_TWO_CTAS_HEAD_DIMS:
            pytest.skip(f"no two-CTA build at D {d}")
        monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_MIN_TILES", 0)
        splits = 1
    else:
        monkeypatch.setattr(decode_configs, "DECODE_TWO_CTAS_MIN_TILES", None)
    if build == "paged-tiles" and (not page or page % 128 == 0):
        pytest.skip("a contiguous cache, or pages as large as the key tile: no cut tiles")
    monkeypatch.setattr(decode_configs, "DECODE_PAGED_BOXES", build != "paged-tiles")
    monkeypatch.setattr(decode_configs, "DECODE_FUSED_COMBINE", fused)
    monkeypatch.setattr(decode_configs, "DECODE_LOOP_MASK_TEST", build != "no-loop-test")
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = _rand(gen, b, nq, hq, d, dtype=dtype)
    k_dense, v_dense = (_rand(gen, b, cap, hkv, d, dtype=dtype) for _ in range(2))
    k_new, v_new = (_rand(gen, b, n_new, hkv, d, dtype=dtype) if n_new else None for _ in "kv")
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for t in (k_dense, v_dense):  # every slot past a row's keys (after the append) is NaN
        for row, n in enumerate(lens):
            t[row, n + n_new :] = math.nan
    if page:
        k_cache, table = _paged(k_dense, page, gen)
        v_cache, _ = _paged(v_dense, page, gen)
        v_cache[table.long()] = v_dense.reshape(b, cap // page, page, hkv, d)
        spare = torch.ones(k_cache.shape[0], dtype=torch.bool, device=DEV)
        spare[table.long().flatten()] = False
        k_cache[spare], v_cache[spare] = math.nan, math.nan  # pages no row owns
    else:
        k_cache, v_cache, table = k_dense.clone(), v_dense.clone(), None
    kp = check_kvcache_inputs(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table,
        num_splits=splits, **options,
    )  # fmt: skip
    guard = 64
    out_buf = torch.full((b * nq * hq * d + 2 * guard,), math.nan, dtype=dtype, device=DEV)
    lse_buf = torch.full((b * hq * nq + 2 * guard,), math.nan, device=DEV)
    out = out_buf[guard:-guard].view(b, nq, hq, d)
    lse = lse_buf[guard:-guard].view(b, hq, nq)
    planned = plan(kp, H100_SMS)
    assert planned[3] == (2 if build == "two-ctas" or (two_split and planned[2] > 1) else 1)
    if two_split and planned[2] == 1:
        pytest.skip("the heuristic runs one split here: nothing for this build")
    kvcache_forward(q, k_cache, v_cache, k_new, v_new, seqlens, table, kp, out=out, lse=lse)
    torch.cuda.synchronize()
    for buf in (out_buf, lse_buf):
        assert buf[:guard].isnan().all() and buf[-guard:].isnan().all(), "wrote outside out/lse"
    if fused:
        first = (out.clone(), lse.clone())
        out.fill_(math.nan)
        lse.fill_(math.nan)
        # The append already happened: attend the same keys again, appending nothing.
        kp_again = check_kvcache_inputs(
            q, k_cache, v_cache, cache_seqlens=seqlens + n_new, block_table=table,
            num_splits=splits, **options,
        )  # fmt: skip
        kvcache_forward(q, k_cache, v_cache, None, None, seqlens + n_new, table, kp_again,
                        out=out, lse=lse)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), "second launch differs"
    pieces = []
    for row in range(b):
        n = lens[row]
        ks, vs = k_dense[row : row + 1, :n], v_dense[row : row + 1, :n]
        if n_new:
            ks = torch.cat([ks, k_new[row : row + 1]], dim=1)
            vs = torch.cat([vs, v_new[row : row + 1]], dim=1)
        pieces.append(_oracle(q[row : row + 1], ks, vs, None, **options))
    for name, ours, dt in (("out", out, dtype), ("lse", lse, torch.float32)):
        ref = torch.cat([p["ref"][name] for p in pieces])  # (B, ...) float64
        pt = torch.cat([p["pt"][name] for p in pieces])  # (B, ...) in the input dtype
        c = compare(name, ours, ref, pt, factor=2.0, dtype=dt)
        assert c.ok, str(c)


@gpu_fa3
def test_gpu_dispatch_fa3_at_serving_size() -> None:
    """B 4, 32k keys, GQA 32/8, D 128 through dispatch (version="fa3", the heuristic's split
    count) against the torch version in float32 on the same cache; a row without keys gives
    out 0 and lse -inf."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    q = _rand(gen, 4, 1, 32, 128, dtype=BF16)
    k, v = (_rand(gen, 4, 32768, 8, 128, dtype=BF16) for _ in range(2))
    lens = torch.tensor([32768, 1, 20000, 0], dtype=torch.int32, device=DEV)
    out, lse = dispatch.attention_with_kvcache(
        q, k, v, cache_seqlens=lens, return_lse=True, version="fa3"
    )
    ref, ref_lse = dispatch.attention_with_kvcache(
        q.float(), k.float(), v.float(), cache_seqlens=lens, return_lse=True, version="torch"
    )
    assert lse.dtype == torch.float32 and torch.isneginf(lse[3]).all() and (out[3] == 0).all()
    ok = lens > 0
    assert (out.float() - ref)[ok].abs().max().item() <= 2e-2 * ref.abs().max().item()
    assert (lse - ref_lse)[ok].abs().max().item() < 1e-3


@gpu_fa3
def test_gpu_split_decode_replays_in_cuda_graphs(monkeypatch) -> None:
    """fa3's split decode (fused combine) captured into two CUDA graphs, replayed alternately:
    every replay gives the eager call's out and lse bit for bit (the counters of each graph
    come back to zero after every replay), and the captured calls drew their counters from
    the capture pool (no memset node in either graph)."""
    from flashsuite.fa3 import decode_configs, decode_host

    assert decode_configs.DECODE_FUSED_COMBINE
    monkeypatch.setenv("FLASHSUITE_CHECK_METADATA", "0")  # a capture copies nothing to the host
    gen = torch.Generator(device=DEV).manual_seed(2)
    q = _rand(gen, 2, 1, 32, 128, dtype=BF16)
    k, v = (_rand(gen, 2, 8192, 8, 128, dtype=BF16) for _ in range(2))
    lens = torch.tensor([8192, 3000], dtype=torch.int32, device=DEV)

    def call():
        return dispatch.attention_with_kvcache(
            q, k, v, cache_seqlens=lens, num_splits=4, return_lse=True, version="fa3"
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ref = call()  # eager: compiles, and makes the capture pool
    torch.cuda.current_stream().wait_stream(side)
    handed = decode_host._capture_pool[q.device][1]
    graphs, outs = [], []
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(call())
        graphs.append(g)
    assert decode_host._capture_pool[q.device][1] == handed + 2 * 2 * 8  # B x Hkv tiles each
    for _ in range(3):
        for g, (out, lse) in zip(graphs, outs, strict=True):
            out.zero_()
            lse.zero_()
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


# (B, Nq, Nk, Hq, Hkv, D, dtype, layout, options): dense problems decode_route sends to the
# decode kernel. "bhnd": q, k, v as (B, N, H, D) views of (B, H, N, D) tensors, SDPA's layout.
DENSE_ROUTE_CASES = [
    (8, 1, 4096, 32, 8, 128, BF16, "bnhd", {}),
    (1, 1, 40000, 32, 8, 128, BF16, "bnhd", {}),  # split over the SMs
    (4, 16, 3000, 32, 8, 128, BF16, "bnhd", dict(causal=True)),  # 64 packed rows
    (2, 5, 3, 8, 8, 64, F16, "bnhd", dict(causal=True)),  # the first 2 rows see no key
    (2, 4, 700, 16, 16, 256, BF16, "bnhd", dict(window_size=(100, 0), softcap=10.0)),
    (3, 1, 5000, 32, 4, 128, BF16, "bhnd", {}),
]


def _dense_case_id(c) -> str:
    b, nq, nk, hq, hkv, d, dt, layout, opts = c
    return f"b{b}-nq{nq}-nk{nk}-h{hq}x{hkv}-D{d}-{str(dt)[6:]}-{layout}-{'-'.join(opts) or 'plain'}"


def _dense_inputs(case, gen):
    b, nq, nk, hq, hkv, d, dtype, layout, _ = case
    if layout == "bhnd":
        q = _rand(gen, b, hq, nq, d, dtype=dtype).transpose(1, 2)
        k, v = (_rand(gen, b, hkv, nk, d, dtype=dtype).transpose(1, 2) for _ in "kv")
    else:
        q = _rand(gen, b, nq, hq, d, dtype=dtype)
        k, v = (_rand(gen, b, nk, hkv, d, dtype=dtype) for _ in "kv")
    return q, k, v


@gpu_fa3
@pytest.mark.parametrize("case", DENSE_ROUTE_CASES, ids=_dense_case_id)
def test_gpu_dense_problems_on_the_decode_kernel(case, monkeypatch) -> None:
    """Dense problems of at most DECODE_ROUTE_MAX_ROWS packed rows through dispatch.attention
    (fa3, with a gradient) run on the split-KV decode kernel: out, the LSE and the gradients
    (fa3's backward on the routed out and LSE) against the float64 oracle; a row that sees no
    key gives out 0 and LSE -inf; flash_attn_func gives the same bits."""
    from flashsuite.fa3 import decode_host

    *_, options = case
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = _dense_inputs(case, gen)
    calls = []
    real = decode_host.kvcache_forward
    monkeypatch.setattr(
        decode_host, "kvcache_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = dispatch.attention(qs, ks, vs, return_lse=True, version="fa3", **options)
    do = torch.randn(out.shape, generator=gen, device=DEV).to(out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), do)
    assert calls, "the call did not reach the decode kernel"
    ref = _oracle(q, k, v, do, **options)
    ours = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    for name, t in ours.items():
        dt = torch.float32 if name == "lse" else q.dtype
        c = compare(name, t, ref["ref"][name], ref["pt"][name],
                    factor=3.0 if name.startswith("d") else 2.0, dtype=dt)  # fmt: skip
        assert c.ok, str(c)
    with torch.no_grad():
        fa = dispatch.flash_attn_func(q, k, v, **options)
        assert torch.equal(fa, dispatch.attention(q, k, v, version="fa3", **options))
        assert torch.equal(fa, out.detach())


@gpu_fa3
def test_gpu_dense_decode_route_replays_in_a_cuda_graph() -> None:
    """A decode step through dispatch.attention (B 2, Nq 1, GQA 32/8, 8k keys: split, fused
    combine) captured into a CUDA graph replays the eager call's out bit for bit, with new
    inputs copied into the captured ones between replays."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, k, v = _dense_inputs((2, 1, 8192, 32, 8, 128, BF16, "bnhd", {}), gen)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dispatch.attention(q, k, v)  # warm: compile and plan outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = dispatch.attention(q, k, v)
        for seed in (6, 7):
            new = _dense_inputs((2, 1, 8192, 32, 8, 128, BF16, "bnhd", {}),
                                torch.Generator(device=DEV).manual_seed(seed))  # fmt: skip
            for dst, src in zip((q, k, v), new, strict=True):
                dst.copy_(src)
            graph.replay()
            want = dispatch.attention(q, k, v)
            torch.cuda.synchronize()
            assert torch.equal(got, want)


# LEFTPAD_CASES and two at serving size: GQA 32/8, D 128, the heuristic's splits.
GPU_LEFTPAD_CASES = [
    *LEFTPAD_CASES,
    (4, 1, 1, 32, 8, 128, BF16, [4000, 100, 30000, 8000], [3000, 0, 29000, 10], 32768, 0, {}),
    (2, 4, 0, 32, 8, 128, F16, [20000, 9000], [1, 8990], 32768, 0, dict(causal=True)),
]


@gpu_fa3
@pytest.mark.parametrize("case", GPU_LEFTPAD_CASES, ids=lambda c: f"b{c[0]}-nq{c[1]}-cap{c[9]}")
def test_gpu_decode_leftpad_matches_per_row_oracle(case) -> None:
    """fa3's decode with cache_leftpad: row b reads slots cache_leftpad[b] ..
    cache_seqlens[b] + Nnew - 1 of its row (the TMA box starts at the padding's end), NaN in
    every other slot, against the float64 oracle per row."""
    *_, splits, options = case
    gen = torch.Generator(device=DEV).manual_seed(6)
    q, kc, vc, kn, vn, lens, pads, rows = leftpad_case(case, DEV, gen)
    choice = dispatch.select_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, cache_leftpad=pads)
    assert choice.version == "fa3", str(choice)
    out, lse = dispatch.attention_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=lens, cache_leftpad=pads, num_splits=splits,
        return_lse=True, **options,
    )  # fmt: skip
    pieces = [_oracle(q[r : r + 1], ks, vs, None, **options) for r, (ks, vs) in enumerate(rows)]
    cat = lambda ts: torch.cat(ts)  # (B, ...)
    _check_all(dict(out=out, lse=lse, dtype=q.dtype), pieces, dict(out=cat, lse=cat))
