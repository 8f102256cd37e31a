"""fp8 scaling modes (common/fp8.py), the Hadamard rotation (common/hadamard.py) and the
reference fp8 attention (common/fp8_reference.py), against bounds derived from the formats.

Every bound here follows from round-to-nearest on a format with m mantissa bits (e4m3: m = 3,
e5m2: m = 2): a value x whose scaled magnitude |x| / descale is in the normal range is stored
with error <= 2^-(m+1) |x|; below it (subnormals) with error <= half the smallest subnormal
times the descale. No factor is fitted to the observed errors. The descales the bounds use are
computed here independently, in float64, so a descale read from the wrong block shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.fp8 import (
    E4M3,
    E5M2,
    FP8_MANTISSA_BITS,
    FP8_MAX,
    FP8_MIN_SUBNORMAL,
    Fp8Tensor,
    quantize,
)
from flashsuite.common.fp8_reference import attention_fp8, scores_capped_and_masked
from flashsuite.common.hadamard import hadamard, rotate
from flashsuite.common.reference import attention_reference
from flashsuite.common.testing import FP8_FACTOR, compare, reference_pair

F32_ULP = 2.0**-23  # float32 rounding of a dequantised value, a descale, a product


def _blocky(
    b: int, n: int, h: int, d: int, block: int, seed: int = 0, amps=(1.0, 4.0, 16.0, 64.0)
) -> torch.Tensor:
    """float64 (B, N, H, D) standard normal, every (batch, head, block of rows) at its own
    amplitude (`amps` by block, cycling, times 2^-(b + h)): a descale taken from the wrong
    block, head or batch is off by a factor of 2 or more."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, h, d, generator=gen, dtype=torch.float64)
    amp = torch.tensor(amps, dtype=torch.float64)
    rows = amp[(torch.arange(n) // block) % len(amps)]  # (N,)
    bh = 2.0 ** -(torch.arange(b)[:, None] + torch.arange(h)[None, :]).double()  # (B, H)
    return x * rows[None, :, None, None] * bh[:, None, :, None]


def _descale_f64(x: torch.Tensor, mode: str, group: int, block: int, dtype) -> torch.Tensor:
    """Per-element descale (B, N, H, 1) in float64, from the block amax by plain loops."""
    b, n, h, _ = x.shape
    out = torch.empty(b, n, h, 1, dtype=torch.float64)
    fmax = FP8_MAX[dtype]
    starts = range(0, n, block) if mode == "block" else [0]
    size = block if mode == "block" else n
    for bi in range(b):
        for g0 in range(0, h, group):
            for r0 in starts:
                if mode == "tensor":
                    amax = x.abs().max().item()
                else:
                    amax = x[bi, r0 : r0 + size, g0 : g0 + group].abs().max().item()
                out[bi, r0 : r0 + size, g0 : g0 + group] = amax / fmax if amax > 0 else 1.0
    return out


def _rounding_bound(x: torch.Tensor, ds: torch.Tensor, dtype) -> torch.Tensor:
    """Largest |dequantised - x| elementwise: 2^-(m+1) |x| + half a subnormal step, both
    widened by float32 rounding of the descale and of the product."""
    u = 2.0 ** -(FP8_MANTISSA_BITS[dtype] + 1) + 2 * F32_ULP
    return u * x.abs() + FP8_MIN_SUBNORMAL[dtype] / 2 * ds * (1 + 2 * F32_ULP)


MODES = [("tensor", 0), ("head", 0), ("block", 32), ("block", 128)]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("mode", "block"), MODES, ids=[f"{m}{b or ''}" for m, b in MODES])
@pytest.mark.parametrize("group", [1, 2])
def test_round_trip_within_the_format_bound(mode: str, block: int, group: int, dtype) -> None:
    x = _blocky(2, 300, 4, 16, 32)  # N = 300: the last block of 32 and of 128 is partial
    t = quantize(x, mode, group=group, block=block, dtype=dtype)
    assert t.data.dtype == dtype and t.descale.dtype == torch.float32
    ds = _descale_f64(x, mode, group, block or 300, dtype)  # (B, N, H, 1)
    torch.testing.assert_close(t.descale_per_row().expand_as(ds).double(), ds, rtol=F32_ULP, atol=0)
    if mode == "tensor":
        assert t.descale.shape == (2, 2 if group == 2 else 4) and t.descale.unique().numel() == 1
    # Each block's largest element lands on +-fp8_max: the full range is used, nothing saturates.
    top = x.abs() >= ds * FP8_MAX[dtype] * (1 - 2**-20)  # (B, N, H, D): the blocks' amax
    assert top.any() and bool((t.data.double().abs()[top] == FP8_MAX[dtype]).all())
    err = (t.dequantize().double() - x).abs()
    bound = _rounding_bound(x, ds, dtype)
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max():.3g}"
    # The bound is not vacuous: some element uses more than a quarter of it.
    assert (err / bound).max() > 0.25


def test_a_descale_from_the_wrong_block_or_head_is_caught() -> None:
    x = _blocky(2, 200, 4, 16, 32)
    t = quantize(x, "block", block=32)
    ds = _descale_f64(x, "block", 1, 32, E4M3)
    bound = _rounding_bound(x, ds, E4M3)
    for wrong in (t.descale.roll(1, dims=2), t.descale.roll(1, dims=1), t.descale.flip(0)):
        err = (Fp8Tensor(t.data, wrong, "block", 1, 32).dequantize().double() - x).abs()
        assert not bool((err <= bound).all())
    # A block of 16 rows is not the block of 32 the data was quantised in.
    t16 = Fp8Tensor(t.data, t.descale.repeat_interleave(2, dim=2)[..., :13], "block", 1, 16)
    err16 = (t16.dequantize().double() - x).abs()
    assert torch.equal(err16, (t.dequantize().double() - x).abs())  # same layout, same values
    shifted = Fp8Tensor(t.data, t.descale.repeat_interleave(2, dim=2)[..., 1:14], "block", 1, 16)
    assert not bool(((shifted.dequantize().double() - x).abs() <= bound).all())


def test_quantize_with_given_descales_and_zero_blocks() -> None:
    x = torch.zeros(1, 70, 2, 8)
    x[0, 40:, 1] = 3.0
    t = quantize(x, "block", block=32)
    want = torch.tensor([[[1.0, 1.0, 1.0], [1.0, 3.0 / 448.0, 3.0 / 448.0]]])  # float32
    assert torch.equal(t.descale, want)
    ds = torch.full((1, 2, 3), 1.0 / 64.0)
    t = quantize(x, "block", block=32, descale=ds)  # 3 / (1 / 64) = 192, representable
    assert torch.equal(t.dequantize(), x) and t.descale is ds
    t = quantize(x * 100, "block", block=32, descale=ds)  # 19200 saturates at 448
    assert t.data.float().max().item() == 448.0


def test_hadamard_is_orthonormal_with_entries_one_over_root_n() -> None:
    for n in (1, 2, 12, 24, 64, 96, 128, 192, 256):
        h = hadamard(n)
        eye = torch.eye(n, dtype=torch.float64)
        assert (h @ h.T - eye).abs().max() <= 4 * n * 2.0**-53, n
        assert torch.allclose(h.abs() * math.sqrt(n), torch.ones_like(h), rtol=2**-52, atol=0), n
    assert hadamard(64, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_rotation_preserves_scores_in_float64(d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    q = torch.randn(2, 33, 4, d, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 47, 2, d, generator=gen, dtype=torch.float64)
    q[..., 5] *= 20.0  # outlier channels
    k[..., [1, 7]] *= 20.0
    qr, kr = rotate(q), rotate(k)
    assert qr.dtype == torch.float64
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2))
    sr = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(2, dim=2))
    # Each score is a float64 dot product of length d of rotated vectors, each coordinate of
    # which is a float64 dot product of length d with entries +-1/sqrt(d): both within gamma_d
    # = d ulps of their absolute sums, which Cauchy-Schwarz bounds by |q| |k| (3 such terms).
    qn = q.norm(dim=-1).transpose(1, 2)[..., None]  # (B, Hq, Nq, 1)
    kn = k.repeat_interleave(2, dim=2).norm(dim=-1).transpose(1, 2)[:, :, None, :]  # (B,Hq,1,Nk)
    bound = 3 * d * 2.0**-53 * math.sqrt(d) * qn * kn * 1.01
    assert bool(((sr - s).abs() <= bound).all()), ((sr - s).abs() / bound).max()
    # Spread: a rotated coordinate is at most |x|_1 / sqrt(d); the x20 channel no longer stands out.
    assert bool((qr.abs() <= q.abs().sum(-1, keepdim=True) / math.sqrt(d) * (1 + 1e-12)).all())
    assert qr.abs().amax() < q.abs().amax() / 2
    # x H Hᵀ: two products, each element within gamma_d |x|_1 / sqrt(d) and then gamma_d |x|_1.
    back_err = (rotate(qr, inverse=True) - q).abs()
    assert bool((back_err <= 2 * d * 2.0**-53 * 1.01 * q.abs().sum(-1, keepdim=True)).all())
    assert rotate(q.float()).dtype == torch.float32 and rotate(q.bfloat16()).dtype == torch.float32


def _attention_bound(xq, xk, xv, ds_q, ds_k, ds_v, *, scale: float, **options):
    """Largest |attention_fp8 - exact attention| elementwise (B, Nq, Hq, Dv), float64, from
    e4m3 rounding of q, k, v (per-element descales ds_*, (B, N, H, 1) float64) and of P.

    With a_x = 2^-4 |x| + 2^-10 ds_x the rounding error of each operand, score s_ij is off by
    at most eta_ij = scale (a_q|k| + |q|a_k + a_q a_k)_ij + float32 accumulation (gamma_D).
    The normalised weight w^_j = w_j e^d_j / sum_k w_k e^d_k (|d_k| <= eta_k) then lies in
    [w_j e^-eta_j / Z+, w_j e^eta_j / Z-] with Z+- = sum_k w_k e^(+-eta_k), so
    |w^_j - w_j| <= c_j w_j, c_j = max(e^eta_j / Z- - 1, 1 - e^-eta_j / Z+). P rounded to e4m3
    (no scale: P <= 1) adds 2^-4 relative, or 2^-10 absolute where P is subnormal (P < 2^-6,
    hence exact p_j < 2^-6 e^(eta_j + rho), rho = max eta bounding the row max's error), over
    a row sum >= 1 (the max's P is 1):
        |out - o| <= sum_j ((c_j + 2^-4 E_j) w_j + 2^-10 [P_j subnormal]) |v^_j| + sum_j w_j a_v_j
    with E_j = e^eta_j / Z-, each widened by float32 exp / sums (gamma_N), then bf16 rounding
    of the output: + 2^-8 (|o| + that).
    """
    u, tau = 2.0**-4 + 2 * F32_ULP, 2.0**-10 * (1 + 2 * F32_ULP)
    g = xq.shape[2] // xk.shape[2]
    q, k, v = (
        t.transpose(1, 2) for t in (xq, xk.repeat_interleave(g, 2), xv.repeat_interleave(g, 2))
    )  # (B, Hq, N, D)
    aq = u * q.abs() + tau * ds_q.transpose(1, 2)  # (B, Hq, Nq, D)
    ak = u * k.abs() + tau * ds_k.repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, D)
    av = u * v.abs() + tau * ds_v.repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, Dv)
    d, nk = q.shape[-1], k.shape[2]
    gamma_d, gamma_n = (d + 2) * 2.0**-24, (nk + 4) * 2.0**-24
    qa, ka = q.abs(), k.abs()
    eta = scale * (aq @ ka.mT + qa @ ak.mT + aq @ ak.mT + gamma_d * (qa + aq) @ (ka + ak).mT)
    s = scores_capped_and_masked(scale * q @ k.mT, options)  # (B, Hq, Nq, Nk) exact scores
    visible = ~torch.isinf(s)  # a softcap is 1-Lipschitz: eta bounds the capped scores too
    eta = eta.masked_fill(~visible, 0.0)  # (B, Hq, Nq, Nk)
    rho = eta.amax(-1, keepdim=True)  # (B, Hq, Nq, 1)
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    p = torch.exp(s - m)  # (B, Hq, Nq, Nk), 0 where masked
    w = p / p.sum(-1, keepdim=True).clamp_min(1.0)  # rows that see nothing: all 0
    z_plus = (w * eta.exp()).sum(-1, keepdim=True).clamp_min(1e-300)  # (B, Hq, Nq, 1)
    z_minus = (w * (-eta).exp()).sum(-1, keepdim=True).clamp_min(1e-300)
    e_j = eta.exp() / z_minus * (1 + gamma_n)  # w^_j <= E_j w_j
    c_j = torch.maximum(e_j - 1, 1 - (-eta).exp() / z_plus / (1 + gamma_n))
    small = (p < 2.0**-6 * (eta + rho).exp() * (1 + gamma_n)) & visible
    vhat = v.abs() + av  # (B, Hq, Nk, Dv)
    coef = (c_j + (u + gamma_n) * e_j) * w + (1 + gamma_n) * tau * small
    bound = coef @ vhat + w @ av  # (B, Hq, Nq, Dv)
    o = w @ v  # (B, Hq, Nq, Dv)
    bound = bound + 2.0**-8 * (o.abs() + bound)
    return bound.transpose(1, 2), o.transpose(1, 2)


ATTN_CASES = [
    # (B, Nq, Nk, Hq, Hkv, D, causal)
    (2, 77, 100, 4, 2, 64, True),
    (1, 100, 77, 2, 1, 128, True),  # Nq > Nk: 23 rows see no key
    (2, 40, 33, 2, 2, 256, False),
]


def _case_inputs(case, rotated: bool = False):
    """q, k, v (float64) with blocks of 32 queries and 48 keys at amplitudes 3x apart, and
    scores of rms ~0.3-1: where the bound's e^eta factors stay near 1, so it is tight enough
    (within ~5x of the worst error) to see a descale from the wrong block."""
    b, nq, nk, hq, hkv, d, _ = case
    c = (2.0 / math.sqrt(d)) ** 0.5
    xq = c * _blocky(b, nq, hq, d, 32, seed=1, amps=(0.5, 1.5))
    xk = c * _blocky(b, nk, hkv, d, 48, seed=2, amps=(1.5, 0.5))
    xv = _blocky(b, nk, hkv, d, 48, seed=3, amps=(1.0, 4.0))
    if rotated:
        xq, xk = rotate(xq), rotate(xk)
    return xq, xk, xv


@pytest.mark.parametrize(("mode", "block"), MODES[:3], ids=["tensor", "head", "block"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"d{c[5]}")
def test_reference_attention_within_the_derived_bound(case, mode: str, block: int) -> None:
    b, nq, nk, hq, hkv, d, causal = case
    gq = hq // hkv if mode != "block" else 1
    bq, bk = (32, 48) if mode == "block" else (nq, nk)
    xq, xk, xv = _case_inputs(case, rotated=d == 128)
    q = quantize(xq, mode, group=gq, block=bq if block else 0)
    k, v = (quantize(x, mode, block=bk if block else 0) for x in (xk, xv))
    out = attention_fp8(q, k, v, causal=causal)
    assert out.dtype == torch.bfloat16 and out.shape == (b, nq, hq, d)
    ds = [
        _descale_f64(x, mode, g, bl, E4M3) for x, g, bl in ((xq, gq, bq), (xk, 1, bk), (xv, 1, bk))
    ]
    bound, exact = _attention_bound(xq, xk, xv, *ds, scale=d**-0.5, causal=causal)
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max():.3g}"
    # The same operands with v's descales read one block (or head) off: outside the bound.
    wrong = v.descale.roll(1, dims=-1)
    if torch.equal(wrong, v.descale):  # one head, or "tensor" mode: nothing to mix up
        wrong = v.descale * 2
    v_wrong = Fp8Tensor(v.data, wrong, mode, 1, v.block)
    bad = (attention_fp8(q, k, v_wrong, causal=causal).double() - exact).abs()
    assert not bool((bad <= bound).all())


def test_reference_attention_options_and_lse() -> None:
    """Causal, window and softcap reach the scores: the output stays within the derived bound
    and the LSE is the oracle's up to float32 roundoff (inputs exact in e4m3 at descale 1),
    which the same call without the option misses."""
    gen = torch.Generator().manual_seed(0)
    x = [torch.randint(-4, 5, (1, n, 2, 16), generator=gen).double() / 8 for n in (20, 30)]
    x.append(torch.randint(-8, 9, (1, 30, 2, 16), generator=gen).double())
    ones = torch.ones(1, 2)
    q, k, v = (Fp8Tensor(t.to(E4M3), ones) for t in x)
    ds = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    plain_lse = attention_fp8(q, k, v, return_lse=True)[1].double()
    for opts in (dict(causal=True), dict(window_size=(3, 2)), dict(softcap=0.1)):
        out, lse = attention_fp8(q, k, v, return_lse=True, **opts)
        bound, exact = _attention_bound(*x, ds, ds, ds, scale=0.25, **opts)
        err = (out.double() - exact).abs()
        assert bool((err <= bound).all()), (opts, (err / bound).max())
        ref_lse = attention_reference(*x, compute_dtype=torch.float64, **opts)[1]
        torch.testing.assert_close(lse.double(), ref_lse, rtol=2**-20, atol=2**-20)
        assert (plain_lse - ref_lse).abs().max() > 1e-2, opts


def test_tensor_and_head_modes_feed_dispatch_attention() -> None:
    """The "tensor" and "head" descales are the (B, Hkv) the fp8 forward takes: the torch
    version on them meets the fp8 rule against the reference."""
    case = (2, 45, 60, 4, 2, 64, True)
    xq, xk, xv = _case_inputs(case)
    for mode in ("tensor", "head"):
        q = quantize(xq, mode, group=2)
        k, v = quantize(xk, mode), quantize(xv, mode)
        kw = dict(descale_q=q.descale, descale_k=k.descale, descale_v=v.descale)
        out = dispatch.attention(q.data, k.data, v.data, causal=True, version="torch", **kw)
        ref = reference_pair(q.data, k.data, v.data, causal=True, **kw)["out"][0]
        base = attention_fp8(q, k, v, causal=True)
        res = compare("out", out, ref, base, factor=FP8_FACTOR, dtype=torch.bfloat16)
        assert res.ok, str(res)


def test_bad_arguments_name_the_argument_and_the_values() -> None:
    x = torch.randn(1, 10, 4, 8)
    cases = [
        (lambda: quantize(x, "row"), ValueError, r"mode: expected one of .*got 'row'"),
        (lambda: quantize(x, "block"), ValueError, r"block: expected a positive int .*got 0"),
        (lambda: quantize(x, "head", block=16), ValueError, r"block: expected 0 .*got 16"),
        (lambda: quantize(x, dtype=torch.float16), ValueError, r"dtype: expected .*got float16"),
        (lambda: quantize(x[0]), ValueError, r"x: expected a 4-d floating tensor .*got 3-d"),
        (lambda: quantize(x.to(E4M3)), ValueError, r"x: expected a wide .*got float8_e4m3fn"),
        (lambda: quantize(x, group=3), ValueError, r"group: expected a divisor of the 4 .*got 3"),
        (
            lambda: quantize(x, "block", block=4, descale=torch.ones(1, 4, 2)),
            ValueError,
            r"descale: expected float32 of shape \(B, H, nblocks\) = \(1, 4, 3\) .*got float32 "
            r"\(1, 4, 2\)",
        ),
        (
            lambda: Fp8Tensor(x.to(E4M3), torch.ones(1, 4, dtype=torch.float64)),
            ValueError,
            r"descale: expected float32 .*got float64 \(1, 4\)",
        ),
        (
            lambda: Fp8Tensor(x.to(E4M3), -torch.ones(1, 4)),
            ValueError,
            "descale: expected positive",
        ),
        (lambda: Fp8Tensor(x, torch.ones(1, 4)), ValueError, r"data: expected .*got 4-d float32"),
        (lambda: hadamard(80), ValueError, r"n: expected 2\^k or 12·2\^k .*got 80"),
        (lambda: rotate(torch.randn(3, 80)), ValueError, r"x: expected a head dim .*got D = 80"),
        (lambda: rotate(x.to(E4M3)), ValueError, r"x: expected the unquantised tensor"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn()
    q = quantize(x)
    k2 = quantize(torch.randn(1, 12, 2, 8), group=2)
    k = quantize(torch.randn(1, 12, 2, 8))
    v_batch = quantize(torch.randn(2, 12, 2, 8))
    with pytest.raises(TypeError, match="v: expected an Fp8Tensor"):
        attention_fp8(q, k, k.data)
    with pytest.raises(ValueError, match=r"k: expected group 1 \(a descale per kv head\), got 2"):
        attention_fp8(q, k2, k)
    with pytest.raises(ValueError, match=r"k, v: expected batch 1 \(q's\), got 1 and 2"):
        attention_fp8(q, k, v_batch)
    with pytest.raises(ValueError, match="q: expected a group dividing Hq // Hkv = 2"):
        attention_fp8(quantize(x, group=4), k, k)
    with pytest.raises(ValueError, match=r"k: expected head dim 8 \(q's\), got 16"):
        attention_fp8(q, quantize(torch.randn(1, 12, 2, 16)), k)
