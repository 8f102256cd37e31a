"""fa3/bwd_prepost.py: the dense backward's preprocess and dQ postprocess as CuTe DSL kernels.

On the CPU: `benchmarks/fa3_bwd_prepost_probe.py` compiles every shipped combination for sm_90a
(both 16-bit dtypes, every head dim, the shipped tile_m of each, with and without scale) in two
processes at once; each binary must move its rows with 16-byte global accesses (ld/st.global.v4,
cp.async of 16 bytes), keep 0 spill bytes and no local memory, index with 64-bit arithmetic,
and answer CPU tensors of two shapes (contiguous, and with non-contiguous outer strides) with
the same signature, whose B, Nq, Hq are symbols. The host wrappers name the argument that does
not fit; importing the module imports neither the CuTe DSL nor Triton; a binary goes through
fa3's on-disk cache. On a GPU (`gpu` mark): bit for bit against the Triton kernels of
common/bwd_preprocess.py and common/bwd_postprocess.py (lse2, the zeroed accumulator, dQ), delta
within fp32 summation-order error, at odd Nq, padding past Nq and strided inputs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from flashsuite.fa3 import bwd_prepost as bp

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
SHARDS = 2  # the CI machine has 2 cores; each shard is one compiler process


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> list[dict]:
    """benchmarks.fa3_bwd_prepost_probe's CI set, SHARDS compiler processes at a time (the CuTe
    DSL reads its CUTE_DSL_* settings at import: each shard is its own process)."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")
    out = tmp_path_factory.mktemp("fa3_bwd_prepost_probe")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}

    def run(i: int) -> list[dict]:
        path = out / f"shard{i}.json"
        cmd = [sys.executable, "-m", "benchmarks.fa3_bwd_prepost_probe"]
        cmd += ["--shard", f"{i}/{SHARDS}", "--json", str(path)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"probe shard {i} failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(path.read_text())

    with ThreadPoolExecutor(SHARDS) as pool:
        return [r for shard in pool.map(run, range(SHARDS)) for r in shard]


def test_every_shipped_combination_compiles(probes) -> None:
    from benchmarks.fa3_bwd_prepost_probe import cases

    assert len(probes) == len(cases())
    pre = {(r["dtype"], r["head_dim"], r["zero_d"]) for r in probes if r["kind"] == "pre"}
    post = {
        (r["dtype"], r["head_dim"], r["tile_m"], r["has_scale"])
        for r in probes
        if r["kind"] == "post"
    }
    for d in (64, 96, 128, 192, 256):
        assert {("bfloat16", d, d), ("float16", d, d), ("bfloat16", d, 0)} <= pre
    # The shipped tiles: 128 rows at D = 64 (64 with softcap), 80 at D = 128 (full), else 64.
    tiles = {(64, 128), (64, 64), (96, 64), (128, 64), (128, 80), (192, 64), (256, 64)}
    for d, tile_m in tiles:
        assert {
            ("bfloat16", d, tile_m, False),
            ("float16", d, tile_m, False),
            ("bfloat16", d, tile_m, True),
        } <= post


def test_pdl_builds_wait_before_touching_memory(probes) -> None:
    """BwdConfig.pdl's builds: the preprocess waits for the launch before it (O, dO and LSE)
    and only then signals its dependents; the postprocess waits for the main kernel's dQ adds.
    The other builds carry neither instruction (a plain launch)."""
    pdl = [r for r in probes if r["pdl"]]
    assert {r["kind"] for r in pdl} == {"pre", "post"}
    for r in probes:
        waits, launches = r["ptx"]["griddep_wait"], r["ptx"]["griddep_launch"]
        if not r["pdl"]:
            assert waits == launches == 0, r["key"]
        elif r["kind"] == "pre":
            assert waits == 1 and launches == 1, r["key"]
        else:
            assert waits == 1 and launches == 0, r["key"]


def test_no_spills_no_local_memory_64bit_offsets(probes) -> None:
    for r in probes:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["key"]
        assert r["ptx"]["local"] == 0, r["key"]
        assert r["ptx"]["s64_index"] > 0, r["key"]  # strides are 64-bit symbols
        assert r["registers"] is not None and r["registers"] <= 128, r["key"]


def test_preprocess_moves_rows_in_16_bytes(probes) -> None:
    """Each thread loads its O and dO chunks of every row it sums with ld.global.v4 (nothing
    narrower), reduces a row over its lanes by shuffles, and zeroes the accumulator with
    st.global.v4 only in the zeroing builds."""
    for r in (r for r in probes if r["kind"] == "pre"):
        kernel = bp.Fa3BwdPreprocess(_Width16(), r["head_dim"], r["zero_d"])
        loads = 2 * kernel.PASSES * kernel.CHUNKS_PER_THREAD
        assert r["ptx"]["ld_global_v4"] == loads, r["key"]
        assert r["ptx"]["ld_global_scalar"] == kernel.PASSES, r["key"]  # one LSE per row
        assert r["ptx"]["shfl_bfly"] == kernel.PASSES * int(math.log2(kernel.ROW_THREADS))
        zero = bp.PRE_BLOCK_M * r["zero_d"] // 4 // kernel.THREADS
        assert r["ptx"]["st_global_v4"] == zero, r["key"]


def test_postprocess_moves_blocks_in_16_bytes(probes) -> None:
    """The block reaches shared memory by 16-byte cp.async, the column table by two 16-byte
    loads, and every row of dQ leaves by one 16-byte store per thread: nothing narrower."""
    for r in (r for r in probes if r["kind"] == "post"):
        kernel = bp.Fa3DqPostprocess(_Width16(), r["head_dim"], r["tile_m"], r["has_scale"])
        assert r["ptx"]["cp_async_16"] == kernel.LOADS, r["key"]
        assert r["ptx"]["ld_global_v4"] == 2, r["key"]
        assert r["ptx"]["st_global_v4"] == kernel.PASSES, r["key"]
        assert r["ptx"]["st_global_scalar"] == 0, r["key"]
        assert r["ptx"]["ld_global_scalar"] == kernel.PASSES, r["key"]  # the row offsets
        assert r["ptx"]["ld_shared"] == kernel.PASSES * kernel.VEC, r["key"]
        assert r["ptx"]["bar_sync"] == 1, r["key"]


def test_one_binary_takes_any_batch_length_heads_and_strides(probes) -> None:
    """CPU tensors of (B, Nq, Hq) = (1, 17, 1) contiguous and (3, 113, 5) strided get the same
    answer: the device check, with B, Nq, Hq (and Nq_pad) symbols and only D static."""
    tvm = [r for r in probes if "signatures" in r]
    if not tvm:
        pytest.skip("apache-tvm-ffi not installed")
    for r in tvm:
        first, second = r["signatures"]
        assert first == second and "expected device_type=cuda" in first, r["key"]
        d, dt = r["head_dim"], r["dtype"]
        if r["kind"] == "pre":
            assert f"mO: Tensor([n0, n1, n2, {d}], {dt})" in first
            assert f"mdO: Tensor([n0, n1, n2, {d}], {dt})" in first
            assert "mLSE: Tensor([n0, n2, n1], float32)" in first
            assert "mDelta: Tensor([n0, n2, n3], float32)" in first
            assert "mLse2: Tensor([n0, n2, n3], float32)" in first
            if r["zero_d"]:
                assert f"mAcc: Tensor([n0, n2, n3, {r['zero_d']}], float32)" in first
        else:
            assert f"mAcc: Tensor([n0, n1, n2, {d}], float32)" in first
            assert f"mRowOff: Tensor([{r['tile_m']}], int32)" in first
            assert f"mColOff: Tensor([{d}], int32)" in first
            assert f"mdQ: Tensor([n0, n3, n1, {d}], {dt})" in first
            assert "scale: float32" in first


class _Width16:
    """Stands in for a 16-bit DSL element type where only its width matters (the kernels'
    static thread layout), so the tests read it without importing the DSL."""

    width = 16


def test_import_needs_neither_the_dsl_nor_triton() -> None:
    """A binary loaded from disk launches through this module: importing it must not import
    the CuTe DSL or Triton (their imports and Triton's cache key are the cost it removes)."""
    code = (
        "import sys; import flashsuite.fa3.bwd_prepost; "
        "print(sorted(m for m in ('cutlass', 'triton') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_keys_name_disk_cache_entries() -> None:
    from flashsuite.fa3 import disk_cache

    keys = [
        bp.PreprocessKey(torch.bfloat16, 128, 128),
        bp.PostprocessKey(torch.float16, 64, 128, True),
    ]
    texts = [disk_cache.key_text(k) for k in keys]
    assert None not in texts and len(set(texts)) == 2
    assert "PreprocessKey(dtype=torch.bfloat16, head_dim_v=128, zero_d=128" in texts[0]


def test_swizzle_is_a_block_permutation_that_cuts_bank_conflicts() -> None:
    """Every accumulator layout dispatch can pick has DQ_SWIZZLE terms; each maps the block
    onto itself one to one, keeps its 16-byte groups whole and aligned (cp.async writes them),
    and brings the postprocess's gathers to at most 4 shared-memory wavefronts per warp load
    in the model of benchmarks.dq_swizzle_search (unswizzled: 8 to 16). The GPU tests below
    check that the copy and the gathers agree (bit for bit against the Triton kernel)."""
    from benchmarks.dq_swizzle_search import layouts, wavefronts

    assert sorted((t, d, split) for t, d, _, split in layouts()) == sorted(POST_LAYOUTS)
    for layout in layouts():
        terms = bp.dq_swizzle(*layout)
        assert terms, layout
        block = torch.arange(layout[0] * layout[1])
        moved = bp.swizzle_index(block, terms)
        assert torch.equal(moved.sort().values, block), layout
        groups = moved.view(-1, 4)
        assert (groups[:, 0] % 4 == 0).all() and (groups - groups[:, :1] == torch.arange(4)).all()
        ideal = len(block) // 32
        assert wavefronts(*layout, terms) <= 4 * ideal < wavefronts(*layout), layout


def test_binary_is_stored_and_loaded_back(tmp_path, monkeypatch) -> None:
    """get_preprocess through compile.cached: compiled and stored once, then loaded from the
    entry by a process that has not compiled it (the in-memory cache cleared)."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi not installed")
    from flashsuite.fa3 import compile as fa3_compile

    monkeypatch.setenv("FLASHSUITE_CACHE_DIR", str(tmp_path))
    key = bp.PreprocessKey(torch.bfloat16, 64, 64)
    monkeypatch.delitem(fa3_compile._cache, key, raising=False)
    first = bp.get_preprocess(key)
    assert list((tmp_path / "fa3").glob("*/*.bin"))
    monkeypatch.delitem(fa3_compile._cache, key)

    def no_compile(key, *args):
        raise AssertionError("compiled again instead of loading the stored entry")

    monkeypatch.setattr(bp, "compile_preprocess", no_compile)
    again = bp.get_preprocess(key)
    monkeypatch.delitem(fa3_compile._cache, key)
    out = torch.zeros(1, 17, 1, 64, dtype=torch.bfloat16)
    stats = torch.zeros(1, 1, 64)
    args = (out, out, torch.zeros(1, 1, 17), stats, stats, torch.zeros(1, 1, 64, 64))
    answers = []
    for fn in (first, again):
        with pytest.raises(ValueError, match="expected device_type=cuda") as info:
            fn(*args)
        answers.append(str(info.value))
    assert answers[0] == answers[1]


# ----------------------------------------------------------------------------------------------
# argument validation (no compile: every case fails before a binary is fetched)
# ----------------------------------------------------------------------------------------------
def _pre_inputs(nq: int = 17) -> tuple:
    """out, dout (1, nq, 2, 64) bf16 and lse (1, 2, nq) on the CPU."""
    out = torch.zeros(1, nq, 2, 64, dtype=BF16)
    return out, out.clone(), torch.zeros(1, 2, nq)


def _pre_error(out, dout, lse, tile_m: int = 64, dq_d: int = 0) -> str:
    with pytest.raises(ValueError) as info:
        bp.preprocess(dout, out, lse, tile_m, dq_d)
    return str(info.value)


def test_preprocess_names_bad_dtypes_and_shapes() -> None:
    o, do, lse = _pre_inputs()
    msg = _pre_error(o.float(), do.float(), lse)
    assert msg == "preprocess: out expected float16 or bfloat16, got float32"
    msg = _pre_error(o, do.half(), lse)
    assert (
        msg
        == "preprocess: dout expected bfloat16 (1, 17, 2, 64) (as out), got float16 (1, 17, 2, 64)"
    )
    assert "got bfloat16 (1, 16, 2, 64)" in _pre_error(o, do[:, :16], lse)
    msg = _pre_error(o[..., :48], do[..., :48], lse)
    assert msg == "preprocess: out's head dim expected one of (64, 96, 128, 192, 256), got 48"
    msg = _pre_error(o, do, lse.double())
    assert msg == "preprocess: lse expected float32 (1, 2, 17), got float64 (1, 2, 17)"
    assert "got float32 (1, 1, 17)" in _pre_error(o, do, lse[:, :1])
    msg = _pre_error(o[0], do[0], lse)
    assert msg == "preprocess: out expected (B, Nq, Hq, Dv), got shape (17, 2, 64)"
    assert "dq_d expected 0 or one of (64, 96, 128, 192, 256), got 100" in _pre_error(
        o, do, lse, 64, 100
    )
    assert "tile_m expected > 0, got 0" in _pre_error(o, do, lse, 0)


def test_preprocess_names_bad_strides() -> None:
    o, do, lse = _pre_inputs()
    every_other = torch.zeros(1, 17, 2, 128, dtype=BF16)[..., ::2]
    assert "preprocess: dout expected a unit last stride" in _pre_error(o, every_other, lse)
    odd_rows = torch.zeros(1, 17, 2, 65, dtype=BF16)[..., :64]  # rows 130 bytes apart
    assert "preprocess: out expected 16-byte-aligned rows" in _pre_error(odd_rows, do, lse)
    shifted = torch.zeros(17 * 2 * 64 + 1, dtype=BF16)[1:].view(1, 17, 2, 64)  # base + 2 bytes
    msg = _pre_error(o, shifted, lse)
    assert "preprocess: dout expected 16-byte-aligned rows" in msg and "data_ptr % 16 = " in msg


def test_preprocess_of_no_rows_launches_nothing() -> None:
    """Nq = 0: empty outputs of the right shapes, no binary fetched."""
    o, do, lse = _pre_inputs(nq=0)
    lse2, dsum, acc = bp.preprocess(do, o, lse, 80, 64)
    assert lse2.shape == dsum.shape == (1, 2, 0) and acc.shape == (1, 2, 0, 64)


def _post_error(acc, nq=100, tile_m=64, dtype=BF16, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        bp.dq_from_tiles(acc, nq, tile_m, 2, dtype, **kwargs)
    return str(info.value)


def test_dq_from_tiles_names_bad_arguments() -> None:
    acc = torch.zeros(1, 2, 128, 64)  # (B, Hq, Nq_pad, D)
    want = "dq_from_tiles: dq_acc expected float32 (B, Hq, Nq_pad, D), got"
    assert _post_error(acc.double()) == f"{want} float64 (1, 2, 128, 64)"
    assert _post_error(acc[0]) == f"{want} float32 (2, 128, 64)"
    assert "D expected one of (64, 96, 128, 192, 256), got 80" in _post_error(
        torch.zeros(1, 2, 128, 80)
    )
    assert "tile_m expected one of (64, 80, 128), got 96" in _post_error(acc, tile_m=96)
    msg = _post_error(torch.zeros(1, 2, 100, 64))
    assert "Nq_pad a multiple of 64, got shape (1, 2, 100, 64)" in msg
    assert "dq_acc expected contiguous" in _post_error(torch.zeros(1, 2, 128, 128)[..., :64])
    assert "nq expected in [0, 128], got 129" in _post_error(acc, nq=129)
    assert "dtype expected float16 or bfloat16, got float32" in _post_error(
        acc, dtype=torch.float32
    )


def test_dq_from_tiles_names_a_bad_out() -> None:
    acc = torch.zeros(1, 2, 128, 64)
    msg = _post_error(acc, out=torch.empty(1, 100, 2, 64, dtype=torch.float16))
    assert (
        msg == "dq_from_tiles: out expected bfloat16 (1, 100, 2, 64), got float16 (1, 100, 2, 64)"
    )
    every_other = torch.empty(1, 100, 2, 128, dtype=BF16)[..., ::2]
    assert "out expected a unit last stride" in _post_error(acc, out=every_other)
    odd_rows = torch.empty(1, 100, 2, 68, dtype=BF16)[..., :64]  # rows 136 bytes apart
    assert "out expected 16-byte-aligned rows" in _post_error(acc, out=odd_rows)


def _rows(b, nq, hq, dv, dtype, strided, gen) -> torch.Tensor:
    """A (B, Nq, Hq, Dv) CUDA tensor of `dtype`: contiguous, or (`strided`) a view of a
    (B, Hq, Nq, Dv + 8) buffer, tokens and heads in the other order and rows 16 bytes apart
    from their neighbours' ends (still 16-byte aligned, as both kernels need)."""
    if not strided:
        return torch.randn(b, nq, hq, dv, device="cuda", generator=gen).to(dtype)
    wide = torch.randn(b, hq, nq, dv + 8, device="cuda", generator=gen).to(dtype)
    return wide[..., :dv].transpose(1, 2)  # (B, Nq, Hq, Dv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dv", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("nq", [1, 17, 113, 1000])
@pytest.mark.parametrize(("tile_m", "strided", "zero"), [(64, False, True), (80, True, True),
                                                         (128, True, False)])  # fmt: skip
def test_preprocess_matches_triton(dtype, dv, nq, tile_m, strided, zero) -> None:
    from flashsuite.common.bwd_preprocess import bwd_preprocess

    gen = torch.Generator(device="cuda").manual_seed(nq * 1000 + dv)
    b, hq = 2, 3
    out = _rows(b, nq, hq, dv, dtype, strided, gen)
    dout = _rows(b, nq, hq, dv, dtype, strided, gen)
    lse = 4 * torch.randn(b, nq, hq, device="cuda", generator=gen).transpose(1, 2)  # strided
    if not strided:
        lse = lse.contiguous()
    lse[:, :, ::7] = -math.inf  # rows that saw no key
    dq_d = dv if zero else 0
    lse2, dsum, acc = bp.preprocess(dout, out, lse, tile_m, dq_d)
    nq_pad = lse2.shape[2]
    assert nq_pad % math.lcm(tile_m, 64) == 0 and nq_pad - nq < math.lcm(tile_m, 64)
    acc_ref = torch.full((b, hq, nq_pad, dv), math.nan, device="cuda") if zero else None
    dsum_ref, lse2_ref = bwd_preprocess(out, dout, lse, nq_pad, acc_ref)
    assert torch.equal(lse2, lse2_ref)  # +inf on the -inf and padding rows, bit for bit
    assert torch.equal(dsum[:, :, nq:], torch.zeros_like(dsum[:, :, nq:]))
    exact = (out.double() * dout.double()).sum(-1).transpose(1, 2)  # (B, Hq, Nq)
    bound = (out.double() * dout.double()).abs().sum(-1).transpose(1, 2) * (dv * 2**-24)
    assert ((dsum[:, :, :nq].double() - exact).abs() <= bound + 1e-30).all()
    gap = (dsum[:, :, :nq].double() - dsum_ref[:, :, :nq].double()).abs()
    assert (gap <= 2 * bound + 1e-30).all()  # the two summation orders, each within `bound`
    if zero:
        assert torch.equal(acc, torch.zeros_like(acc)) and torch.equal(acc, acc_ref)
    else:
        assert acc is None


@pytest.mark.gpu
@pytest.mark.parametrize("zero", [False, True])
def test_preprocess_writes_every_padded_row(zero) -> None:
    """The binary itself on NaN-filled outputs: every row of delta, lse2 and the accumulator up
    to Nq_pad written (Nq_pad two row blocks past Nq)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, nq, hq, d = 2, 113, 3, 128
    out, dout = (_rows(b, nq, hq, d, torch.bfloat16, False, gen) for _ in range(2))
    lse = torch.randn(b, hq, nq, device="cuda", generator=gen)
    nq_pad = 256
    delta, lse2 = (torch.full((b, hq, nq_pad), math.nan, device="cuda") for _ in range(2))
    acc = torch.full((b, hq, nq_pad, d), math.nan, device="cuda") if zero else None
    bp.get_preprocess(bp.PreprocessKey(torch.bfloat16, d, d if zero else 0))(
        out, dout, lse, delta, lse2, acc
    )
    torch.cuda.synchronize()
    assert not delta.isnan().any() and not lse2.isnan().any()
    assert (lse2[:, :, nq:] == math.inf).all() and (delta[:, :, nq:] == 0).all()
    if zero:
        assert (acc == 0).all()


# (tile_m, head_dim, dq_split) of the shipped tile-ordered configs, and D = 96 / 192 / 256.
POST_LAYOUTS = [(128, 64, "m"), (64, 64, "d"), (64, 96, "d"), (64, 128, "d"), (80, 128, "dt"),
                (64, 192, "d"), (64, 256, "d")]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("tile_m", "head_dim", "split"), POST_LAYOUTS)
@pytest.mark.parametrize("nq", [1, 17, 113, 1000])
@pytest.mark.parametrize("scale", [None, 0.125])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dq_from_tiles_matches_triton(tile_m, head_dim, split, nq, scale, dtype) -> None:
    """Bit for bit against common.bwd_postprocess on the same accumulator (a whole padding
    block past the ragged last one), into a view of a NaN-filled buffer: the rows around it
    stay NaN, and so do the padding rows."""
    from flashsuite.common.bwd_postprocess import dq_postprocess

    gen = torch.Generator(device="cuda").manual_seed(nq + head_dim)
    b, hq = 2, 3
    nq_pad = (-(-nq // tile_m) + 1) * tile_m
    acc = torch.randn(b, hq, nq_pad, head_dim, device="cuda", generator=gen)
    buf = torch.full((b, nq + 2, hq, head_dim), math.nan, dtype=dtype, device="cuda")
    dq = buf[:, 1 : nq + 1]
    got = bp.dq_from_tiles(acc, nq, tile_m, 2, dtype, split, scale, out=dq)
    assert got is dq
    row_off, col_off = bp.dq_offsets(tile_m, head_dim, 2, split, acc.device)
    want = torch.empty(b, nq, hq, head_dim, dtype=dtype, device="cuda")
    dq_postprocess(acc, row_off, col_off, want, scale)
    assert torch.equal(dq, want)
    assert buf[:, 0].isnan().all() and buf[:, -1].isnan().all()
    fresh = bp.dq_from_tiles(acc, nq, tile_m, 2, dtype, split, scale)  # (B, Nq, Hq, D), new
    assert fresh.is_contiguous() and torch.equal(fresh, want)
