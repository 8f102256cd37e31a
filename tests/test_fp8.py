"""The float8 (e4m3) path: quantisation helpers against a float64 emulation, and the fp8
forward against a baseline that rounds Q, K, V and P to e4m3 the same way.

On the CPU the `torch` version runs the fp8 forward (it dequantises to float32); fa3's fp8
kernel runs on an sm90 GPU (gpu-marked cases). Both must stay within FP8_FACTOR (1.5x) of the
e4m3-rounding baseline's error against the float64 oracle. The torch version's LSE meets the
suite's float32 rule; fa3's comes from the fp8 wgmma's reduced-precision accumulator and is held
to FP8_FACTOR of an emulation of it (common/testing.py, FP8_ACC_BITS).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.fp8 import E4M3, E4M3_MAX, dequantize_e4m3, quantize_e4m3
from flashsuite.common.testing import (
    FP8_FACTOR,
    compare,
    fp8_baseline,
    fp8_lse_baseline,
    reference_pair,
)
from tests.conftest import DEVICE, HAS_CUDA


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative float8_e4m3fn value, ascending, in float64."""
    codes = torch.arange(128, dtype=torch.uint8)  # sign bit clear
    values = codes.view(E4M3).double()
    return values[torch.isfinite(values)]


def _round_e4m3_f64(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3 grid, saturating at 448, all in float64."""
    grid = _e4m3_grid()  # (G,) ascending; code i has value grid[i]
    a = x.double().abs().clamp(max=E4M3_MAX)
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)  # first grid value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    even_hi = hi % 2 == 0  # an even code has an even last mantissa bit
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
    return torch.where(pick_hi, grid[hi], grid[lo]) * x.double().sign()


def test_quantize_matches_float64_emulation() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 3, 16, generator=gen, dtype=torch.float64)
    x[1, :, 2] *= 1e-3  # one (batch, head) slice at a very different scale
    x[0, 5, 1, 7] = 40.0  # an outlier: only descale[0, 1] may change
    x8, ds = quantize_e4m3(x)
    amax = x.abs().amax(dim=(1, 3))  # (B, H) float64
    torch.testing.assert_close(ds.double(), amax / E4M3_MAX, rtol=2**-23, atol=0)
    assert x8.dtype == E4M3 and ds.dtype == torch.float32 and ds.shape == (2, 3)
    want = _round_e4m3_f64(x / ds.double()[:, None, :, None])
    assert torch.equal(x8.double(), want), "quantize_e4m3 is not round-to-nearest-even e4m3"
    # Each slice's largest element lands on +-448 exactly: the full range is used.
    assert torch.equal(x8.double().abs().amax(dim=(1, 3)), torch.full((2, 3), E4M3_MAX).double())
    back = dequantize_e4m3(x8, ds)
    rel = ((back.double() - x).abs() / amax[:, None, :, None]).max()
    assert rel <= 2**-4, f"dequantised error {rel:.3g} of amax, e4m3 promises <= 2^-4"


def test_quantize_saturates_and_rejects_non_finite() -> None:
    x = torch.tensor([1.0, 500.0, -1e4, 0.0]).view(1, 4, 1, 1)
    x8, ds = quantize_e4m3(x, descale=torch.ones(1, 1))
    assert x8.float().flatten().tolist() == [1.0, 448.0, -448.0, 0.0]
    assert ds.item() == 1.0
    assert quantize_e4m3(torch.zeros(1, 3, 2, 4))[1].eq(1.0).all()  # all-zero slice: descale 1
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match="x: expected finite values, got 1 NaN"):
            quantize_e4m3(x.clone().index_fill_(1, torch.tensor([2]), bad))
    with pytest.raises(ValueError, match=r"descale: expected float32 of shape \(B, H\)"):
        quantize_e4m3(x, descale=torch.ones(2, 1))
    with pytest.raises(ValueError, match="descale: expected positive"):
        quantize_e4m3(x, descale=torch.zeros(1, 1))


def test_keys_major_v_is_the_same_values_and_an_accepted_v() -> None:
    """quantize(keys_major=True) / common.fp8.keys_major: the same e4m3 values with the keys
    contiguous and every other stride a multiple of 16 (TMA's Vᵀ, no copy in fa3); check_inputs
    takes such a V (fp8 only, v only), and the torch version gives the same bits from it."""
    from flashsuite.common.fp8 import keys_major
    from flashsuite.common.validation import check_inputs

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 3, 16, generator=gen)
    x8, ds = quantize_e4m3(x)
    xk, dsk = quantize_e4m3(x, keys_major=True)
    assert torch.equal(dsk, ds) and torch.equal(xk.view(torch.uint8), x8.view(torch.uint8))
    assert xk.stride(1) == 1 and all(st % 16 == 0 for st in xk.permute(0, 2, 3, 1).stride()[:3])
    assert torch.equal(keys_major(x8).view(torch.uint8), x8.view(torch.uint8))
    assert keys_major(x8).stride() == xk.stride()
    q8 = quantize_e4m3(torch.randn(2, 20, 6, 16, generator=gen), group=2)[0]
    p = check_inputs(q8, x8, xk, causal=True)
    assert (p.seqlen_k, p.heads_kv, p.head_dim) == (37, 3, 16)
    with pytest.raises(ValueError, match=r"k: the last dim \(head_dim\) must be contiguous"):
        check_inputs(q8, xk, xk)  # k keys-major: only v may be
    xb = keys_major(x.bfloat16())
    with pytest.raises(ValueError, match=r"v: the last dim \(head_dim\) must be contiguous: "
                       r"expected stride\(-1\) == 1, got"):  # fmt: skip
        check_inputs(q8.bfloat16(), x.bfloat16(), xb)  # 16-bit V: head_dim contiguous only
    with pytest.raises(ValueError, match=r"or, float8 only, the key dim stride\(1\) == 1"):
        check_inputs(q8, x8, x8.transpose(2, 3).contiguous().transpose(2, 3))  # heads innermost
    kw = dict(descale_q=torch.ones(2, 3), descale_k=ds, descale_v=ds, causal=True)
    a = dispatch.attention(q8, x8, x8, version="torch", return_lse=True, **kw)
    b = dispatch.attention(q8, x8, keys_major(x8), version="torch", return_lse=True, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [E4M3, torch.bfloat16], ids=["e4m3", "bf16"])
def test_keys_major_copy_is_the_torch_copy(dtype, device, monkeypatch) -> None:
    """common.transpose.keys_major_copy (one Triton launch: compiled on a GPU, the interpreter
    on a CPU) writes the bytes PyTorch's strided copy writes, for key counts that are no
    multiple of its key block (1 included), head dims that are no multiple of its channel
    block, and an input with outer strides of its own; fa3's Vᵀ copy is the same bytes, and
    the permuted one (transpose_keys_permuted) the bytes of its PyTorch path."""
    pytest.importorskip("triton")
    from flashsuite.common import transpose
    from flashsuite.common.fp8 import keys_major_empty
    from flashsuite.fa3.interface import transpose_v

    gen = torch.Generator().manual_seed(3)
    for b, n, h, d in ((2, 131, 3, 96), (1, 1, 2, 64), (1, 300, 1, 256), (3, 17, 2, 24)):
        x = torch.randn(b, n, h, d + 8, generator=gen).to(device=device, dtype=dtype)[..., :d]
        got = transpose.keys_major_copy(x, keys_major_empty((b, n, h, d), dtype, device))
        want = keys_major_empty((b, n, h, d), dtype, device).copy_(x)
        assert got.stride() == want.stride()
        bits = (lambda t: t.view(torch.uint8)) if dtype == E4M3 else (lambda t: t)
        assert torch.equal(bits(got), bits(want)), (b, n, h, d)
        if dtype == E4M3:
            vt = transpose_v(x)  # (B, H, D, N), keys contiguous
            assert torch.equal(vt.view(torch.uint8), x.view(torch.uint8).permute(0, 2, 3, 1))
            got = transpose.transpose_keys_permuted(x)  # (B, H, D, N rounded up to 32)
            with monkeypatch.context() as m:  # PyTorch's path, on the CPU
                m.setattr(transpose, "triton_interpreter", lambda: False)
                want = transpose.transpose_keys_permuted(x.cpu())
            assert got.shape == (b, h, d, -(-n // 32) * 32) and got.stride(-1) == 1
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), (b, n, h, d)
    if device == "cuda":  # the compiled kernel ran, not the fallback
        from flashsuite.common import triton_launch

        assert transpose._keys_major_copy in {key[0] for key in triton_launch._compiled}
    with pytest.raises(ValueError, match=r"out: expected a 4-d tensor of x's shape \(2, 3"):
        transpose.keys_major_copy(x[:2, :3], keys_major_empty((2, 4, 2, 24), dtype, device))


def test_dequantize_uses_the_group_s_kv_head_descale() -> None:
    x8 = torch.ones(2, 3, 4, 8).to(E4M3)  # Hq = 4 query heads, 2 kv heads
    ds = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # (B, Hkv)
    got = dequantize_e4m3(x8, ds, group=2)[:, 0, :, 0]  # (B, Hq)
    assert got.tolist() == [[1.0, 1.0, 2.0, 2.0], [3.0, 3.0, 4.0, 4.0]]


def _fp8_inputs(b, nq, nk, hq, hkv, d, device, seed=0):
    """e4m3 q, k, v and their (B, Hkv) descales; every (batch, kv head) at its own scale (a
    descale read from the wrong entry shows), q's shared by its GQA group."""
    gen = torch.Generator(device=device).manual_seed(seed)
    amp = 2.0 ** (torch.arange(b * hkv, device=device) % 5).view(b, 1, hkv, 1)  # 1 .. 16

    def rnd(n, h, a):
        return torch.randn((b, n, h, d), generator=gen, device=device) * a

    q8, ds_q = quantize_e4m3(rnd(nq, hq, amp.repeat_interleave(hq // hkv, dim=2)), group=hq // hkv)
    k8, ds_k = quantize_e4m3(rnd(nk, hkv, 1.0 / amp))
    v8, ds_v = quantize_e4m3(rnd(nk, hkv, amp.flip(2)))
    return q8, k8, v8, (ds_q, ds_k, ds_v)


FP8_CASES = [
    # (B, Nq, Nk, Hq, Hkv, D, causal, gpu only)
    (2, 40, 56, 6, 3, 64, False, False),
    (2, 47, 33, 4, 2, 128, True, False),
    (1, 24, 40, 2, 1, 256, True, False),
    (3, 1000, 1000, 6, 2, 64, False, True),
    (2, 777, 1031, 8, 2, 128, True, True),
    (2, 1031, 777, 4, 4, 128, False, True),
    (1, 513, 700, 8, 1, 256, True, True),
    (2, 600, 600, 4, 2, 256, False, True),
]


def _fp8_params():
    for version in ("torch", "fa3"):
        for case in FP8_CASES:
            b, nq, nk, hq, hkv, d, causal, gpu_only = case
            case_id = f"{version}-b{b}-q{nq}-k{nk}-h{hq}-{hkv}-d{d}" + ("-causal" if causal else "")
            marks = [pytest.mark.gpu] if (gpu_only or version == "fa3") else []
            if version == "torch" and gpu_only:
                continue  # the torch version's maths is the same at every size
            yield pytest.param(version, case[:-1], id=case_id, marks=marks)


@pytest.mark.parametrize(("version", "case"), list(_fp8_params()))
def test_fp8_forward_within_the_e4m3_baseline(version: str, case: tuple) -> None:
    b, nq, nk, hq, hkv, d, causal = case
    q8, k8, v8, ds = _fp8_inputs(b, nq, nk, hq, hkv, d, DEVICE)
    kwargs = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    try:
        dispatch.select(q8, k8, v8, causal=causal, version=version, **kwargs)
    except dispatch.Unsupported as exc:
        if version == "fa3" and HAS_CUDA and torch.cuda.get_device_capability() == (9, 0):
            raise  # fa3's fp8 path must run on an sm90 GPU
        pytest.skip(str(exc))
    out, lse = dispatch.attention(
        q8, k8, v8, causal=causal, return_lse=True, version=version, **kwargs
    )
    _assert_within_fp8_baseline(out, lse, q8, k8, v8, ds, causal, fa3=version == "fa3")


def _assert_within_fp8_baseline(
    out, lse, q8, k8, v8, ds, causal: bool, fa3: bool, **options
) -> None:
    """out / lse of an fp8 forward against the float64 oracle, within FP8_FACTOR of the e4m3
    baseline's error (fa3's LSE: of the emulation of the e4m3 wgmma's accumulator,
    common.testing.mma_truncated). `options`: window_size, softcap, as the call had them."""
    kwargs = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref = reference_pair(q8, k8, v8, causal=causal, **kwargs, **options)
    base = fp8_baseline(q8, k8, v8, ds, causal=causal, **options)
    if fa3:  # fp8 wgmma: the LSE against the reduced-precision accumulation
        lse_base = fp8_lse_baseline(q8, k8, ds, causal=causal, **options)
        lse_check = compare("lse", lse, ref["lse"][0], lse_base, factor=FP8_FACTOR)
    else:  # the torch version dequantises: float32 all the way
        lse_check = compare("lse", lse, *ref["lse"])
    out_check = compare("out", out, ref["out"][0], base, factor=FP8_FACTOR, dtype=torch.bfloat16)
    assert out_check.ok, str(out_check)
    assert lse_check.ok, str(lse_check)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "options",
    [{"window_size": (300, 40)}, {"softcap": 30.0}, {"window_size": (500, 0), "softcap": 20.0}],
    ids=["window", "softcap", "both"],
)
def test_fa3_fp8_window_and_softcap_past_the_smem_route(options: dict) -> None:
    """Windowed and softcapped e4m3 D = 128 problems with more keys than the smem-Vᵀ build takes
    (FP8_SMEM_VT_MAX_SEQLEN_K) run the table's host-Vᵀ entry (192 x 96 on three warpgroups, V's
    keys permuted on the host) without its schedule options (configs.dense_options_off):
    through dispatch, within the e4m3 baseline, MQA with per-(batch, kv head) descales."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3's fp8 kernel runs on an sm90 GPU")
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.configs import (
        FP8_DTYPE,
        FP8_SMEM_VT_MAX_SEQLEN_K,
        config_for,
        dense_options_off,
        get_config,
    )

    nk = FP8_SMEM_VT_MAX_SEQLEN_K[128] + 257
    q8, k8, v8, ds = _fp8_inputs(2, 611, nk, 6, 1, 128, "cuda")
    kwargs = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    cfg = config_for(check_inputs(q8, k8, v8, **kwargs, **options))
    table = get_config(128, FP8_DTYPE, False, seqlen_k=nk)
    assert table.num_consumer_wgs == 3 and table.permute_v_keys and table.wg_slice, table
    assert cfg == dense_options_off(table), cfg
    out, lse = dispatch.attention(q8, k8, v8, return_lse=True, version="fa3", **kwargs, **options)
    _assert_within_fp8_baseline(out, lse, q8, k8, v8, ds, False, fa3=True, **options)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("nk", [1024, 1025, 3000])
def test_fa3_fp8_causal_d128_either_side_of_the_short_limit(nk: int) -> None:
    """Causal e4m3 D = 128 through dispatch at FP8_CAUSAL_SHORT's limit (1k keys: the two-WG
    build) and past it (the table's entry: 192 x 96 on three warpgroups, V's keys permuted,
    the 1-bit rescale threshold): the config asserted, within the e4m3 baseline, GQA with
    per-(batch, kv head) descales and more queries than keys."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3's fp8 kernel runs on an sm90 GPU")
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.configs import FP8_CAUSAL_SHORT, config_for

    q8, k8, v8, ds = _fp8_inputs(2, nk + 200, nk, 8, 2, 128, "cuda")
    kwargs = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    cfg = config_for(check_inputs(q8, k8, v8, causal=True, **kwargs))
    limit, short = FP8_CAUSAL_SHORT[128]
    if nk <= limit:
        assert cfg == short, cfg
    else:
        assert cfg.num_consumer_wgs == 3 and cfg.permute_v_keys and cfg.persistent, cfg
        assert cfg.rescale_threshold == 1 and cfg.split_loops, cfg
    out, lse = dispatch.attention(q8, k8, v8, causal=True, return_lse=True, version="fa3", **kwargs)
    _assert_within_fp8_baseline(out, lse, q8, k8, v8, ds, True, fa3=True)


@pytest.mark.gpu
@pytest.mark.parametrize("build", ["smem", "host_pk", "smem_pk"])
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-d{c[5]}-{c[6]}")
def test_fa3_fp8_v_routes(case: tuple, build: str) -> None:
    """fa3's fp8 builds other than the host-Vᵀ one, launched through fa3.interface with their
    config, each within the e4m3 baseline. "smem": V transposed in shared memory
    (Fa3Config.v_transpose, the table's pick up to FP8_SMEM_VT_MAX_SEQLEN_K keys), and bit for
    bit the host-Vᵀ build's output where both use the same tiles (the transpose moves bytes;
    the arithmetic is the same). "host_pk" / "smem_pk": V's keys in fp8_ops.slot_key order
    (Fa3Config.permute_v_keys: P stays in its thread, no quad exchange); the products of P·V
    are the same, their order within a 32-key block is not, so the bits may differ."""
    if not (HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("fa3's fp8 kernel runs on an sm90 GPU")
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import FP8_DTYPE, fp8_smem_transpose_config, get_config

    b, nq, nk, hq, hkv, d, causal, _ = case
    q8, k8, v8, ds = _fp8_inputs(b, nq, nk, hq, hkv, d, DEVICE)
    kwargs = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    p = check_inputs(q8, k8, v8, causal=causal, **kwargs)
    host = replace(get_config(d, FP8_DTYPE, causal), v_transpose="host")
    cfg = fp8_smem_transpose_config(d, causal) if build.startswith("smem") else host
    cfg = replace(cfg, permute_v_keys=build.endswith("_pk"))
    out, lse = interface.forward(q8, k8, v8, p, *ds, cfg=cfg)
    _assert_within_fp8_baseline(out, lse, q8, k8, v8, ds, causal, fa3=True)
    if build == "smem" and host.tile_n == cfg.tile_n:
        out_h, lse_h = interface.forward(q8, k8, v8, p, *ds, cfg=host)
        assert torch.equal(out, out_h) and torch.equal(lse, lse_h)


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_CASES[3:6], ids=lambda c: f"b{c[0]}-q{c[1]}-k{c[2]}-d{c[5]}")
def test_fa3_fp8_keys_major_v_gives_the_same_bits(case: tuple) -> None:
    """fa3 on a keys-major V (common.fp8.keys_major): through dispatch (the table takes the
    host-Vᵀ build for it: V's own storage as Vᵀ, no copy) and through the smem build (V copied
    token-major first), bit for bit the outputs of the same build on V as it lies."""
    if not (HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("fa3's fp8 kernel runs on an sm90 GPU")
    from flashsuite.common.fp8 import keys_major
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import config_for, fp8_smem_transpose_config

    b, nq, nk, hq, hkv, d, causal, _ = case
    q8, k8, v8, ds = _fp8_inputs(b, nq, nk, hq, hkv, d, DEVICE)
    vk = keys_major(v8)
    kw = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    p = check_inputs(q8, k8, v8, causal=causal, **kw)
    pk = check_inputs(q8, k8, vk, causal=causal, **kw)
    host = config_for(pk)
    assert host.v_transpose == "host"
    got = dispatch.attention(q8, k8, vk, causal=causal, return_lse=True, version="fa3", **kw)
    want = interface.forward(q8, k8, v8, p, *ds, cfg=host)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _assert_within_fp8_baseline(*got, q8, k8, v8, ds, causal, fa3=True)
    smem = fp8_smem_transpose_config(d, causal)
    got = interface.forward(q8, k8, vk, pk, *ds, cfg=smem)
    want = interface.forward(q8, k8, v8, p, *ds, cfg=smem)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def growing_max_inputs(d: int, growth: float, device) -> tuple:
    """e4m3 q, k, v (1 x 300 x 4 query heads, 1500 keys, 2 kv heads) and their descales whose
    scores' row max grows by about `growth` bits per key block of the fp8 table's entry, in
    the order the kernel visits the blocks (the last first, rising towards key 0)."""
    from flashsuite.fa3.configs import FP8_DTYPE, get_config

    b, nq, nk, hq, hkv = 1, 300, 1500, 4, 2
    gen = torch.Generator(device=device).manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(d, device=device, generator=gen), dim=0)
    amp = 4.0  # q's component along u
    q = torch.randn(b, nq, hq, d, device=device, generator=gen) + amp * u
    tile_n = get_config(d, FP8_DTYPE, False, nk).tile_n
    # Key j's component along u falls with j: the scores (scale D^-1/2, log2 e) grow by
    # `growth` bits per tile_n keys from the last key to the first.
    per_key = growth / (tile_n * amp * d**-0.5 * 1.4426950408889634)
    ramp = per_key * torch.arange(nk - 1, -1, -1, device=device, dtype=torch.float32)
    k = torch.randn(b, nk, hkv, d, device=device, generator=gen) + ramp[None, :, None, None] * u
    v = torch.randn(b, nk, hkv, d, device=device, generator=gen)
    (q8, ds_q), (k8, ds_k), (v8, ds_v) = (
        quantize_e4m3(q, group=hq // hkv), quantize_e4m3(k), quantize_e4m3(v)
    )  # fmt: skip
    return q8, k8, v8, (ds_q, ds_k, ds_v)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("growth", [0.05, 0.7, 3.0], ids=lambda g: f"grow{g}")
@pytest.mark.parametrize("d", [128, 256])
def test_fa3_fp8_threshold_while_the_max_grows(d: int, growth: float) -> None:
    """The fp8 table at non-causal D = 128 / 256 keeps a row's max while a block raises it by at
    most 1 bit (rescale_threshold 1): scores whose row max grows by about `growth` bits per
    key block in the order the kernel visits them (the last block first, rising towards key
    0). 0.05 keeps the first block's max for the whole row (P climbs towards 2), 0.7 keeps it
    for a block and then rescales, 3 rescales every block. Out and LSE within the e4m3
    baseline's rule.

    At growth 3 the LSE missed the bound of the earlier accumulator model (the running sum cut
    to 13 bits; H100, 2026-12-05: D = 128 0.0100 against 0.0058, D = 256 0.0312 against
    0.0281) by the same amount with rescale_threshold 0 and without row_chains
    (benchmarks/fa3_fp8_blocks_probe --threshold), so the departure was not the threshold's.
    Against mma_truncated's model, read off the kernel since, those same errors sit within the
    bounds computed on the CPU for these inputs (0.0143 at D = 128, 0.0637 at D = 256)."""
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.configs import config_for

    q8, k8, v8, ds = growing_max_inputs(d, growth, "cuda")
    ds_q, ds_k, ds_v = ds
    cfg = config_for(check_inputs(q8, k8, v8))
    assert (cfg.rescale_threshold, cfg.row_chains) == (1, True), cfg
    kwargs = dict(descale_q=ds_q, descale_k=ds_k, descale_v=ds_v)
    out, lse = dispatch.attention(q8, k8, v8, return_lse=True, version="fa3", **kwargs)
    _assert_within_fp8_baseline(out, lse, q8, k8, v8, ds, False, fa3=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("d", "causal"), [(128, False), (256, False), (256, True)])
@pytest.mark.parametrize("growth", [0.05, 0.7, 3.0], ids=lambda g: f"grow{g}")
def test_fa3_fp8_spec_exps_gives_the_same_bits(growth: float, d: int, causal: bool) -> None:
    """Fa3Config.spec_exps on the fp8 table's host-Vᵀ entries (rescale_threshold 1): P taken
    against the running max beside the block's max, and again from S where a row's max grew
    past the threshold. On scores whose row max grows by about `growth` bits a block (kept
    for the whole row, for a block at a time, or at every block: the fast path, both, the
    slow one) it gives bit for bit the entry's out and LSE."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3's fp8 kernel runs on an sm90 GPU")
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import FP8_DTYPE, get_config

    q8, k8, v8, ds = growing_max_inputs(d, growth, "cuda")
    p = check_inputs(q8, k8, v8, causal=causal, descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    table = replace(get_config(d, FP8_DTYPE, causal), v_transpose="host")
    assert table.rescale_threshold == 1, table
    want = interface.forward(q8, k8, v8, p, *ds, cfg=table)
    got = interface.forward(q8, k8, v8, p, *ds, cfg=replace(table, spec_exps=True))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _assert_within_fp8_baseline(*got, q8, k8, v8, ds, causal, fa3=True)


@pytest.mark.parametrize("case", [c for c in FP8_CASES if not c[-1]], ids=lambda c: f"d{c[5]}")
def test_running_max_emulation_is_within_the_baseline(case: tuple) -> None:
    """fa3's fp8 numerics emulated in PyTorch (benchmarks/fp8_emulation.py: P rounded to e4m3
    per key block against the running max, float32 row sums and rescaling, bf16 out) meet the
    rule fa3's kernel is held to: the baseline's final-max rounding of P is a fair yardstick
    for a kernel that rounds against the running max. (With the accumulator cut to 13 mantissa
    bits the out still passes and the LSE fails the float32 rule: see docs/testing.md.)"""
    from benchmarks.fp8_emulation import check_case

    bad = [str(r) for r in check_case(case) if not r.ok]
    assert not bad, "\n".join(bad)


def test_stale_max_in_e4m3_is_within_the_baseline_at_one_bit_not_at_eight() -> None:
    """Fa3Config.rescale_threshold in e4m3, emulated (benchmarks/fp8_emulation.py): with a row
    max that may go stale by 8 bits the largest P of a row is no longer exactly 1 (P = 1 is
    exact in e4m3, 2^δ for a fractional δ is not), and the emulation fails the out rule on
    the D = 256 case that the kernel with the threshold failed on the H200; with 1 bit it
    passes every case of the suite. So fp8 could take a threshold of 1, not 8."""
    from benchmarks.fp8_emulation import check_case

    for case in FP8_CASES:
        bad = [str(r) for r in check_case(case, rescale_threshold=1) if not r.ok]
        assert not bad, (case, bad)
    d256 = next(c for c in FP8_CASES if c[:7] == (1, 513, 700, 8, 1, 256, True))
    out, lse = check_case(d256, rescale_threshold=8)
    assert not out.ok and lse.ok, (out, lse)


@pytest.mark.parametrize("case", [c for c in FP8_CASES if not c[-1]], ids=lambda c: f"d{c[5]}")
def test_fp8_lse_rule_admits_the_accumulator_and_catches_1_percent(case: tuple) -> None:
    """fa3's fp8 LSE rule: the kernel's numerics emulated with the accumulator cut to
    FP8_ACC_BITS pass it, and the same LSE 1 % off fails it."""
    from benchmarks.fp8_emulation import emulate
    from flashsuite.common.testing import FP8_ACC_BITS
    from flashsuite.fa3.configs import FP8_CAUSAL_CONFIGS, FP8_CONFIGS

    b, nq, nk, hq, hkv, d, causal = case[:7]
    q8, k8, v8, ds = _fp8_inputs(b, nq, nk, hq, hkv, d, "cpu")
    kwargs = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    ref = reference_pair(q8, k8, v8, causal=causal, **kwargs)["lse"][0]
    base = fp8_lse_baseline(q8, k8, ds, causal=causal)
    cfg = (FP8_CAUSAL_CONFIGS.get(d) if causal else None) or FP8_CONFIGS[d]
    _, lse = emulate(q8, k8, v8, ds, causal=causal, tile_n=cfg.tile_n, acc_bits=FP8_ACC_BITS)
    ok = compare("lse", lse, ref, base, factor=FP8_FACTOR)
    assert ok.ok, str(ok)
    off = compare("lse", lse * 1.01, ref, base, factor=FP8_FACTOR)
    assert not off.ok, str(off)


def test_accumulator_model_reproduces_the_kernels_dot_products() -> None:
    """common.testing.mma_truncated (the fp8 LSE baseline's accumulator) against what fa3's
    e4m3 Q·Kᵀ wgmma returned on an H100 for benchmarks/fp8_acc_probe.py's 166 crafted and
    random dot products (docs/results/fp8-acc-probe-h100.json): every one to the LSE's float32
    round trip, while cutting only the running sum to 13 bits (the model it replaced) misses
    most of them."""
    import json
    from pathlib import Path

    from benchmarks.fp8_acc_probe import D, _rows
    from flashsuite.common.testing import FP8_ACC_BITS, mma_truncated, truncate_mantissa

    rec = json.loads(
        (Path(__file__).parents[1] / "docs/results/fp8-acc-probe-h100.json").read_text()
    )
    rows, labels = _rows()
    assert labels == rec["labels"]
    kernel = torch.tensor(rec["kernel"], dtype=torch.float64)
    tol = 32 * 2.0**-23 * kernel.abs().clamp_min(1.0)  # the round trip through log2 units
    model = mma_truncated(torch.zeros(len(labels), 1), rows, torch.ones(D, 1), FP8_ACC_BITS)
    off = (model[:, 0].double() - kernel).abs() > tol
    assert not off.any(), [labels[i] for i in off.nonzero()[:, 0].tolist()]
    acc = torch.zeros(len(labels))
    for k0 in range(0, D, 32):  # the running sum cut after each k = 32 step
        acc = truncate_mantissa(acc + rows[:, k0 : k0 + 32].sum(-1), FP8_ACC_BITS)
    assert ((acc.double() - kernel).abs() > tol).sum() > len(labels) // 2
