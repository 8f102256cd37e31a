"""The fp8 backward error study's emulation (benchmarks/fp8_bwd_study.py): its bf16 backward
meets the suite's gradient rule, each GEMM put in fp8 changes exactly the gradients that GEMM
feeds, and the per-tile quantiser keeps the formats' rounding bound."""

from __future__ import annotations

import pytest
import torch

from benchmarks.fp8_bwd_study import GEMMS, backward, oracle, quantize_tiles
from benchmarks.fp8_scaling_study import make_qkv
from flashsuite.common.fp8 import E4M3, E5M2, FP8_MANTISSA_BITS, FP8_MAX, FP8_MIN_SUBNORMAL
from flashsuite.common.testing import compare

CASE = (2, 70, 90, 4, 2, 64, True)  # GQA, causal with Nq < Nk, odd lengths, 2 x 1 key tiles


@pytest.fixture(scope="module")
def problem():
    q, k, v = make_qkv(CASE, "randn")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref, pt, (out, lse) = oracle(q, k, v, do, causal=True)
    return q, k, v, do, out, lse, ref, pt


def test_bf16_emulation_meets_the_gradient_rule(problem) -> None:
    q, k, v, do, out, lse, ref, pt = problem
    grads = backward(q, k, v, do, out, lse, causal=True)
    results = [
        compare(name, g, r, p, dtype=torch.bfloat16)
        for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref, pt, strict=True)
    ]
    bad = [str(r) for r in results if not r.ok]
    assert not bad, "\n".join(bad)


# Which of dq, dk, dv each GEMM feeds: S -> P -> all three; dP -> dS -> dq, dk; the others one.
FEEDS = {"S": (1, 1, 1), "dP": (1, 1, 0), "dV": (0, 0, 1), "dK": (0, 1, 0), "dQ": (1, 0, 0)}


@pytest.mark.parametrize("gemm", GEMMS)
def test_each_fp8_gemm_changes_the_gradients_it_feeds(problem, gemm: str) -> None:
    q, k, v, do, out, lse, ref, _ = problem
    base = backward(q, k, v, do, out, lse, causal=True)
    grads = backward(q, k, v, do, out, lse, causal=True, fp8=(gemm,))
    for name, g, b, r, fed in zip(("dq", "dk", "dv"), grads, base, ref, FEEDS[gemm], strict=True):
        if not fed:
            assert torch.equal(g, b), f"{gemm} in fp8 changed {name}"
            continue
        # Quantised operands: the error grows well past the bf16 backward's (e4m3 and e5m2
        # round to 2^-4 and 2^-3, bf16 to 2^-8).
        err, base_err = ((t.double() - r).abs().mean().item() for t in (g, b))
        assert err > 4 * base_err, f"{gemm} in fp8: {name} error {err:.3g} vs {base_err:.3g}"


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_tile_quantiser_within_the_format_bound(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 70, 90, generator=gen)
    x[..., :32, :] *= 1e-12  # tiles at scales further apart than either format's range
    x[0, 1, 50, 80] = 0.0
    x[1, 2] = 0.0  # all-zero tiles
    bm, bn = 32, 64
    got = quantize_tiles(x, bm, bn, dtype)
    ds = torch.empty_like(x, dtype=torch.float64)
    for i in range(0, 70, bm):
        for j in range(0, 90, bn):
            amax = x[..., i : i + bm, j : j + bn].abs().amax(dim=(-1, -2)).double()
            ds[..., i : i + bm, j : j + bn] = torch.where(amax > 0, amax / FP8_MAX[dtype], 1.0)[
                ..., None, None
            ]
    u = 2.0 ** -(FP8_MANTISSA_BITS[dtype] + 1) + 2**-22
    bound = u * x.abs().double() + FP8_MIN_SUBNORMAL[dtype] / 2 * ds * (1 + 2**-22)
    err = (got.double() - x.double()).abs()
    assert bool((err <= bound).all()), (err / bound).max()
    assert torch.equal(got[1, 2], x[1, 2])
    wrong = quantize_tiles(x, bm + 1, bn, dtype)  # row 32 (x1) in the first (x1e-12) tile
    assert not bool(((wrong.double() - x.double()).abs() <= bound).all())
