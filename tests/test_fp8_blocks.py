"""fp8 attention with per-block descales: q per block of query rows, k and v per block of keys.

The attention API takes a block descale as a (B, H, nblocks, block) view whose last dim has
stride 0 (`common.fp8.block_view`), so the block size travels with the tensor. On the CPU:
the views, their validation, the torch version against the block-mode e4m3 baseline
(`common.fp8_reference.attention_fp8`) and fa3's choice of key tile for a block size. On an
sm90 GPU (gpu-marked): fa3's per-block build (FP8_BLOCKS) on inputs whose blocks sit at scales
16x apart, so a descale read from a neighbouring block, or O's units not carried from one key
block to the next, shows as a large error: out within FP8_FACTOR of the baseline's error
against the float64 oracle, the LSE within FP8_FACTOR of the fp8 accumulator's emulation, as
tests/test_fp8.py holds the per-head build. With outlier channels the scores reach 2e4 and
the build misses that rule (an expected failure); the main cases keep them within a few tens.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.fp8 import block_view, descale_rows, quantize
from flashsuite.common.fp8_reference import attention_fp8
from flashsuite.common.testing import FP8_FACTOR, compare, fp8_lse_baseline, reference_pair
from flashsuite.common.validation import check_inputs
from tests.conftest import DEVICE, HAS_CUDA


def _blocky(b, n, h, d, block, gen, device, outliers=True) -> torch.Tensor:
    """float32 (B, N, H, D) whose row blocks of `block` rows sit at 2^0 .. 2^4 by block index
    and head, with two outlier channels x20 (the same for every token)."""
    x = torch.randn((b, n, h, d), generator=gen, device=device)
    blk = torch.arange(n, device=device) // block  # (N,)
    amp = 2.0 ** ((blk[:, None] + torch.arange(h, device=device)[None, :]) % 5)  # (N, H)
    x = x * amp[None, :, :, None]
    if outliers:
        x[..., 1] *= 20
        x[..., d // 2] *= 20
    return x


def _block_inputs(case, device, seed=0, moderate=False):
    """Quantised q, k, v (Fp8Tensor, "block" mode) for `case` and their API descales.
    `moderate`: no outlier channels in q and k and k at 1/32, so scores stay within a few tens
    (with the outliers they reach 2e4, where an e4m3 wgmma's accumulation of S errs by units)."""
    b, nq, nk, hq, hkv, d, block_q, block_kv, q_group = case[:9]
    gen = torch.Generator(device=device).manual_seed(seed)
    group = hq // hkv if q_group else 1
    out = not moderate
    q8 = quantize(_blocky(b, nq, hq, d, block_q, gen, device, out), "block", block=block_q,
                  group=group)  # fmt: skip
    k_scale = 1 / 32 if moderate else 0.25
    k8 = quantize(_blocky(b, nk, hkv, d, block_kv, gen, device, out) * k_scale, "block",
                  block=block_kv)  # fmt: skip
    v8 = quantize(_blocky(b, nk, hkv, d, block_kv, gen, device, False), "block", block=block_kv)
    return q8, k8, v8


# ------------------------------------------------------------------------------------------
# The views and their validation (CPU)
# ------------------------------------------------------------------------------------------
def test_block_view_carries_the_block_size_without_a_copy() -> None:
    ds = torch.tensor([[[1.0, 2.0, 3.0]]])  # (B 1, H 1, 3 blocks)
    view = block_view(ds, 4)
    assert view.shape == (1, 1, 3, 4) and view.stride(3) == 0
    assert view.data_ptr() == ds.data_ptr()
    rows = descale_rows(view, 10)  # (1, 1, 10): rows 0-3, 4-7, 8-9
    assert rows.tolist() == [[[1.0] * 4 + [2.0] * 4 + [3.0] * 2]]
    assert descale_rows(torch.tensor([[5.0]]), 7).tolist() == [[[5.0]]]
    with pytest.raises(ValueError, match=r"block: expected a positive int .*got 0"):
        block_view(ds, 0)
    with pytest.raises(ValueError, match=r"descale: expected a 3-d tensor .*got 2-d"):
        block_view(ds[0], 4)


def test_fp8_tensor_gives_the_api_descale_of_its_mode() -> None:
    x = torch.randn(2, 10, 4, 16)
    t = quantize(x, "block", block=4)
    assert t.kernel_descale.shape == (2, 4, 3, 4) and t.kernel_descale.stride(3) == 0
    h = quantize(x, "head")
    assert h.kernel_descale is h.descale


def _fp8(b, n, h, d=64):
    return torch.zeros(b, n, h, d).to(torch.float8_e4m3fn)


def test_validation_reads_the_block_sizes() -> None:
    q, k, v = _fp8(2, 300, 4), _fp8(2, 500, 2), _fp8(2, 500, 2)
    dq = block_view(torch.ones(2, 4, 3), 128)  # per query head
    dk = block_view(torch.ones(2, 2, 3), 192)
    p = check_inputs(q, k, v, descale_q=dq, descale_k=dk, descale_v=dk)
    assert (p.fp8_block_q, p.fp8_block_kv) == (128, 192)
    # q's group sharing one descale (H = Hkv), k per head, v per block: still 192 keys.
    p = check_inputs(q, k, v, descale_q=block_view(torch.ones(2, 2, 1), 300),
                     descale_k=torch.ones(2, 2), descale_v=dk)  # fmt: skip
    assert (p.fp8_block_q, p.fp8_block_kv) == (300, 192)
    p = check_inputs(q, k, v, descale_q=torch.ones(2, 2))
    assert (p.fp8_block_q, p.fp8_block_kv) == (0, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(descale_k=block_view(torch.ones(2, 2, 2), 192)),
         r"descale_k: expected a block view \(B, H, ceil\(N / block\), block\) with B = 2, "
         r"H = 2, N = 500, got \(2, 2, 2, 192\)"),
        (dict(descale_q=block_view(torch.ones(2, 3, 3), 128)),
         r"descale_q: .*H = 4 or 2, N = 300, got \(2, 3, 3, 128\)"),
        (dict(descale_k=torch.ones(2, 2, 3, 192)),
         r"descale_k: expected a block view with stride 0 in its last dim .*got strides "
         r"\(1152, 576, 192, 1\)"),
        (dict(descale_k=block_view(torch.ones(2, 2, 3), 192),
              descale_v=block_view(torch.ones(2, 2, 2), 384)),
         r"descale_v: expected blocks of 192 keys \(descale_k's\), got 384"),
        (dict(descale_v=torch.ones(2, 2, 3)),
         r"descale_v: expected shape \(B, Hkv\) or a block view .*got 3-d \(2, 2, 3\)"),
    ],
    ids=["nblocks", "heads", "stride", "kv-mismatch", "3d"],
)  # fmt: skip
def test_validation_names_a_bad_block_descale(kwargs: dict, match: str) -> None:
    q, k, v = _fp8(2, 300, 4), _fp8(2, 500, 2), _fp8(2, 500, 2)
    with pytest.raises(ValueError, match=match):
        check_inputs(q, k, v, **kwargs)


# ------------------------------------------------------------------------------------------
# The torch version and the references (CPU)
# ------------------------------------------------------------------------------------------
def test_torch_version_is_within_the_block_baseline() -> None:
    case = (2, 150, 210, 4, 2, 64, 64, 96, False)
    q8, k8, v8 = _block_inputs(case, "cpu")
    views = dict(descale_q=q8.kernel_descale, descale_k=k8.kernel_descale,
                 descale_v=v8.kernel_descale)  # fmt: skip
    out = dispatch.attention(q8.data, k8.data, v8.data, causal=True, version="torch", **views)
    ref = reference_pair(q8.data, k8.data, v8.data, causal=True, **views)["out"][0]
    base = attention_fp8(q8, k8, v8, causal=True)
    check = compare("out", out, ref, base, factor=FP8_FACTOR, dtype=torch.bfloat16)
    assert check.ok, str(check)
    # The oracle dequantises per block: it equals float64 attention on Fp8Tensor.dequantize().
    deq = reference_pair(q8.dequantize(), k8.dequantize(), v8.dequantize(), causal=True)
    torch.testing.assert_close(ref, deq["out"][0], rtol=1e-12, atol=1e-12)


def test_lse_baseline_takes_block_descales() -> None:
    """fp8_lse_baseline with block views is the head-mode one where every block of a head
    holds the same descale, and moves where one block's descale changes."""
    case = (1, 40, 60, 4, 2, 64, 16, 32, True)
    q8, k8, _ = _block_inputs(case, "cpu")
    ds_q = torch.full((1, 2), 0.5)
    ds_k = torch.full((1, 2), 0.25)
    head = fp8_lse_baseline(q8.data, k8.data, (ds_q, ds_k))
    same_q = block_view(ds_q[:, :, None].expand(1, 2, 3).contiguous(), 16)
    same_k = block_view(ds_k[:, :, None].expand(1, 2, 2).contiguous(), 32)
    torch.testing.assert_close(fp8_lse_baseline(q8.data, k8.data, (same_q, same_k)), head)
    other = ds_k[:, :, None].expand(1, 2, 2).contiguous()
    other[0, 1, 1] = 4.0  # kv head 1, keys 32..59
    moved = fp8_lse_baseline(q8.data, k8.data, (same_q, block_view(other, 32)))
    assert torch.equal(moved[:, :2], head[:, :2]) and not torch.equal(moved[:, 2:], head[:, 2:])


@pytest.mark.parametrize(
    ("case", "tile_n", "causal", "window"),
    [
        ((2, 150, 300, 4, 2, 64, 64, 96, False), 96, True, (-1, -1)),
        ((1, 130, 260, 4, 1, 64, 50, 128, True), 64, False, (-1, -1)),
        ((1, 200, 200, 2, 2, 128, 128, 64, False), 64, False, (40, 10)),
    ],
    ids=["causal", "gqa-qgroup-2tiles", "window"],
)
def test_the_per_block_kernel_s_arithmetic_is_within_the_block_baseline(
    case, tile_n, causal, window
) -> None:
    """fa3's per-block build emulated on the CPU (benchmarks/fp8_emulation.emulate_blocks: the
    running max in log2 units, O in units of the current block's v descale) is within the
    block-mode baseline; without carrying O's units between v blocks it is not."""
    from benchmarks.fp8_emulation import emulate_blocks

    q8, k8, v8 = _block_inputs(case, "cpu")
    views = (q8.kernel_descale, k8.kernel_descale, v8.kernel_descale)
    api = dict(zip(("descale_q", "descale_k", "descale_v"), views, strict=True))
    opts = dict(causal=causal, window_size=window)
    ref = reference_pair(q8.data, k8.data, v8.data, **opts, **api)
    base = attention_fp8(q8, k8, v8, **opts)
    out, lse = emulate_blocks(q8.data, k8.data, v8.data, views, tile_n=tile_n, **opts)
    check = compare("out", out, ref["out"][0], base, factor=FP8_FACTOR, dtype=torch.bfloat16)
    assert check.ok, str(check)
    lse_check = compare("lse", lse, *ref["lse"])
    assert lse_check.ok, str(lse_check)
    bad, _ = emulate_blocks(q8.data, k8.data, v8.data, views, tile_n=tile_n, carry_v=False, **opts)
    miss = compare("out", bad, ref["out"][0], base, factor=FP8_FACTOR, dtype=torch.bfloat16)
    assert not miss.ok, str(miss)


# ------------------------------------------------------------------------------------------
# fa3: the key tile a block size takes (CPU: planning only)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("d", "causal", "nk", "block_kv", "tile_n"),
    [
        (128, False, 20000, 192, 192),
        (128, True, 20000, 384, 192),
        (64, True, 20000, 256, 256),  # the causal table's tile
        (64, True, 20000, 192, 192),  # the 2-WG tile of _FP8_BLOCK_EXTRA divides 192
        (64, False, 20000, 192, 192),  # the 3-WG table entry runs blocks on its 2-WG tile
        (64, False, 20000, 768, 192),
        (256, False, 2048, 96, 96),  # V transposed on the host: the smem entry's tile is 64
        (256, False, 512, 64, 64),  # the smem entry's own tile (the table's up to 512 keys)
        (96, False, 20000, 256, 128),
    ],
)
def test_fa3_takes_a_key_tile_that_divides_the_block(d, causal, nk, block_kv, tile_n) -> None:
    from flashsuite.fa3.interface import config_for, supports

    q, k = _fp8(1, 256, 2, d), _fp8(1, nk, 2, d)
    ds = block_view(torch.ones(1, 2, math.ceil(nk / block_kv)), block_kv)
    p = check_inputs(q, k, k, causal=causal, descale_k=ds, descale_v=ds)
    ok, reason = supports(p, 90)
    assert ok, reason
    assert config_for(p).tile_n == tile_n
    # On the plain grid, where its GPU cases ran, also for the persistent causal entries.
    assert not config_for(p).persistent


def test_fa3_refuses_a_block_no_key_tile_divides() -> None:
    from flashsuite.fa3.interface import supports

    q, k = _fp8(1, 256, 2, 128), _fp8(1, 1000, 2, 128)
    ds = block_view(torch.ones(1, 2, 11), 96)
    p = check_inputs(q, k, k, descale_k=ds, descale_v=ds)
    ok, reason = supports(p, 90)
    assert not ok
    assert reason == (
        "fa3: fp8 k/v descales every 96 keys need a multiple of the key tile (192 at head_dim 128)"
    )
    # D 64's 3-WG entry (tile_n 160) is not a per-block tile: 320 keys fit no 2-WG one.
    q, k = _fp8(1, 256, 2, 64), _fp8(1, 1000, 2, 64)
    p = check_inputs(q, k, k, descale_k=block_view(torch.ones(1, 2, 4), 320), descale_v=None)
    ok, reason = supports(p, 90)
    assert not ok and reason.endswith("(192 or 256 at head_dim 64)"), reason


# ------------------------------------------------------------------------------------------
# fa3's per-block build (GPU)
# ------------------------------------------------------------------------------------------
# (B, Nq, Nk, Hq, Hkv, D, block_q, block_kv, q per kv head, causal, window, softcap)
BLOCK_CASES = [
    (2, 777, 1031, 8, 2, 128, 128, 192, False, True, (-1, -1), 0.0),
    (2, 1031, 777, 4, 4, 128, 64, 384, False, False, (-1, -1), 0.0),
    (3, 1000, 1000, 6, 2, 64, 128, 192, True, False, (-1, -1), 0.0),
    (2, 900, 1100, 4, 2, 64, 100, 192, False, True, (-1, -1), 0.0),
    (1, 513, 700, 8, 1, 256, 100, 96, False, True, (-1, -1), 0.0),
    (2, 600, 5000, 4, 2, 256, 128, 288, False, False, (-1, -1), 0.0),
    (1, 400, 520, 4, 2, 96, 128, 128, False, False, (-1, -1), 0.0),
    (1, 400, 520, 2, 2, 192, 256, 256, True, True, (-1, -1), 0.0),
    (1, 500, 800, 4, 2, 128, 128, 192, False, False, (-1, -1), 30.0),
    (1, 700, 700, 4, 2, 128, 128, 192, False, False, (200, 50), 0.0),
]


def _case_id(c) -> str:
    s = f"b{c[0]}-q{c[1]}-k{c[2]}-h{c[3]}-{c[4]}-d{c[5]}-bq{c[6]}-bk{c[7]}"
    s += "-qgroup" if c[8] else ""
    s += "-causal" if c[9] else ""
    s += f"-win{c[10][0]}_{c[10][1]}" if c[10] != (-1, -1) else ""
    return s + (f"-cap{c[11]:g}" if c[11] else "")


def _need_sm90() -> None:
    """Skip off an sm90 GPU."""
    if not (HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("fa3's fp8 kernel runs on an sm90 GPU")


def _run_block_case(case: tuple, moderate: bool) -> None:
    _need_sm90()
    causal, window, softcap = case[9:]
    q8, k8, v8 = _block_inputs(case, DEVICE, moderate=moderate)
    views = dict(descale_q=q8.kernel_descale, descale_k=k8.kernel_descale,
                 descale_v=v8.kernel_descale)  # fmt: skip
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    assert dispatch.select(q8.data, k8.data, v8.data, version="fa3", **opts, **views)
    out, lse = dispatch.attention(
        q8.data, k8.data, v8.data, return_lse=True, version="fa3", **opts, **views
    )
    ref = reference_pair(q8.data, k8.data, v8.data, **opts, **views)
    base = attention_fp8(q8, k8, v8, **opts)
    out_check = compare("out", out, ref["out"][0], base, factor=FP8_FACTOR, dtype=torch.bfloat16)
    assert out_check.ok, str(out_check)
    lse_base = fp8_lse_baseline(q8.data, k8.data, (views["descale_q"], views["descale_k"]), **opts)
    lse_check = compare("lse", lse, ref["lse"][0], lse_base, factor=FP8_FACTOR)
    assert lse_check.ok, str(lse_check)


@pytest.mark.gpu
@pytest.mark.parametrize("case", BLOCK_CASES, ids=_case_id)
def test_fa3_fp8_blocks_within_the_block_baseline(case: tuple) -> None:
    """Scores within a few tens (`_block_inputs(moderate=True)`), where the per-block
    arithmetic emulated with the 13-bit accumulator meets this rule and each planted fault
    misses it (test_moderate_inputs_catch_each_block_mistake, on two of these shapes)."""
    _run_block_case(case, True)


@pytest.mark.gpu
@pytest.mark.xfail(
    strict=True,
    reason="scores up to 2e4 (outlier channels): on an H100 (2026-12-05) out missed the block "
    "baseline by 6-82x in every case (LSE 2.7-22 against bounds of 6.5-7.1), while with every "
    "block's descale equal the per-block build matched the per-head one to 1 bf16 ulp; "
    "the baseline's out does not model the e4m3 accumulator: emulated with it (CPU), the D 96 "
    "case errs 0.26 / 0.74 / 0.09 / 0.01 of max|out| per 128-row block, the kernel 0.20 / "
    "1.01 / 0.27 / 0.007, float32 accumulation 0.004-0.007",
)
@pytest.mark.parametrize("case", [BLOCK_CASES[0], BLOCK_CASES[6]], ids=_case_id)
def test_fa3_fp8_blocks_at_scores_of_2e4(case: tuple) -> None:
    _run_block_case(case, False)


@pytest.mark.gpu
def test_fa3_fp8_blocks_mixed_with_head_descales() -> None:
    """q per block, k per head, v per block (and the other way round): the per-head ones run
    as one block of the per-block build, within the baseline of the same operands."""
    _need_sm90()
    case = (2, 700, 900, 4, 2, 128, 128, 192, False)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q8, _, v8 = _block_inputs(case, DEVICE, moderate=True)
    k8 = quantize(torch.randn(2, 900, 2, 128, generator=gen, device=DEVICE), "head")
    for views, (qt, kt, vt) in (
        (dict(descale_q=q8.kernel_descale, descale_k=k8.descale, descale_v=v8.kernel_descale),
         (q8, k8, v8)),
        (dict(descale_q=None, descale_k=k8.descale, descale_v=v8.kernel_descale),
         (quantize(q8.data.float(), "head", descale=torch.ones(2, 4, device=DEVICE)), k8, v8)),
    ):  # fmt: skip
        out = dispatch.attention(q8.data, k8.data, v8.data, causal=True, version="fa3", **views)
        ref = reference_pair(q8.data, k8.data, v8.data, causal=True, **views)["out"][0]
        base = attention_fp8(qt, kt, vt, causal=True)
        check = compare("out", out, ref, base, factor=FP8_FACTOR, dtype=torch.bfloat16)
        assert check.ok, str(check)


def _neighbour(view: torch.Tensor) -> torch.Tensor:
    """A block view whose block i holds block i - 1's descale (the last wraps to 0)."""
    return block_view(view[..., 0].roll(1, dims=2).contiguous(), view.shape[3])


@pytest.mark.parametrize(
    ("case", "tile_n", "causal"),
    [(BLOCK_CASES[6][:9], 128, False), ((2, 150, 300, 4, 2, 64, 64, 96, True), 96, True)],
    ids=["d96", "causal-qgroup"],
)
def test_moderate_inputs_catch_each_block_mistake(case, tile_n, causal) -> None:
    """The GPU cases' moderate inputs (scores within a few tens) keep the per-block mistakes
    visible: fa3's per-block arithmetic emulated with the 13-bit accumulator
    (fp8_emulation.emulate_blocks) meets the block baseline, and misses it with O's units not
    carried between v blocks, with k and v descales read from the neighbouring key block, and
    with q's from the neighbouring row block (the GPU mutants' three faults)."""
    from benchmarks.fp8_emulation import emulate_blocks
    from flashsuite.common.testing import FP8_ACC_BITS

    q8, k8, v8 = _block_inputs(case, "cpu", moderate=True)
    dq, dk, dv = q8.kernel_descale, k8.kernel_descale, v8.kernel_descale
    api = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    ref = reference_pair(q8.data, k8.data, v8.data, causal=causal, **api)["out"][0]
    base = attention_fp8(q8, k8, v8, causal=causal)

    def ok(views, **kw) -> bool:
        out, _ = emulate_blocks(q8.data, k8.data, v8.data, views, tile_n=tile_n, causal=causal,
                                acc_bits=FP8_ACC_BITS, **kw)  # fmt: skip
        return compare("out", out, ref, base, factor=FP8_FACTOR, dtype=torch.bfloat16).ok

    assert ok((dq, dk, dv))
    assert not ok((dq, dk, dv), carry_v=False)
    assert not ok((dq, _neighbour(dk), _neighbour(dv)))
    assert not ok((_neighbour(dq), dk, dv))


@pytest.mark.parametrize("per_head", ["descale_k", "descale_v"])
def test_a_per_head_k_or_v_takes_its_partners_blocks(per_head: str, monkeypatch) -> None:
    """interface.forward on the CPU with the binary stubbed: the kernel finds a K/V block's k
    and v descales with one block index, so a (B, Hkv) k or v descale beside a per-block
    partner reaches it as blocks of the partner's size, every one reading the head's value
    (as one block of 2^30 keys, the partner's later blocks read block 0's descale: out 58
    off its bound on an H100)."""
    from flashsuite.fa3 import compile as fa3_compile
    from flashsuite.fa3 import interface

    calls = []
    monkeypatch.setattr(fa3_compile, "get_forward", lambda key: lambda *a: calls.append(a))
    props = type("Props", (), {"multi_processor_count": 132})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(interface, "_plans", {})
    q, k = _fp8(1, 256, 2, 128), _fp8(1, 1000, 2, 128)
    head = torch.tensor([[2.0, 3.0]])  # (B 1, Hkv 2)
    blocks = block_view(torch.rand(1, 2, 6) + 0.5, 192)
    ds = {"descale_q": None, "descale_k": blocks, "descale_v": blocks, per_head: head}
    p = check_inputs(q, k, k, **ds)
    interface.forward(q, k, k, p, *ds.values())
    ((*_, dq, dk, dv, _cq, _ck, _s0, _s1, _s2, _s3, _sms),) = calls
    assert dk.shape[2:] == dv.shape[2:] == (6, 192) and dq.shape[2] == 1
    mine = dk if per_head == "descale_k" else dv
    assert mine.stride()[2:] == (0, 0)
    assert descale_rows(mine, 1000).tolist() == [[[2.0] * 1000, [3.0] * 1000]]
