"""fa3's fp8 forward emulated in PyTorch on the CPU, measured against the e4m3 baseline.

    python -m benchmarks.fp8_emulation [--acc-bits 23 13] [--rescale-threshold 8]

The emulation follows the kernel's fp8 branch (fa3/kernels.py, fa3/softmax.py,
fa3/fwd_mainloop.py, fa3/fp8_ops.py): raw scores q8·k8 (products of e4m3 values, exact in
float32), key blocks of the kernel's tile_n taken from the last block down to the first, the
online softmax in base 2 against the running row max
(corr = exp2((m_old - m_new) * scale_log2), row sums of the float32 P), P rounded to e4m3
(round to nearest even, as cvt.rn.satfinite) before each P·V, O rescaled by corr per block,
O * descale_v / l at the end and delivered in bf16; LSE = (m * scale_log2 + log2 l) * ln 2.

`acc_bits` models the wgmma accumulator: 23 is float32; fewer bits accumulate every k = 32 step
of both products (QKᵀ over the head dim, P·V over the keys) as common.testing.mma_truncated
does (addends aligned to the largest and cut, the sum cut: read off the kernel by
benchmarks/fp8_acc_probe.py). `rescale_threshold`
t > 0 models Fa3Config.rescale_threshold: a row keeps its running max while a block's max
exceeds it by at most t in log2 units (P up to 2^t, rounded to e4m3 there).

Each case of tests/test_fp8.py is checked with the suite's rule (common.testing.compare): out
against common.testing.fp8_baseline at FP8_FACTOR, the LSE against PyTorch's float32 LSE.
"""

from __future__ import annotations

import argparse
import math

import torch

from flashsuite.common.fp8 import E4M3
from flashsuite.common.reference import visibility_mask
from flashsuite.common.testing import (
    FP8_FACTOR,
    Comparison,
    compare,
    fp8_baseline,
    reference_pair,
)
from flashsuite.common.testing import mma_truncated as _mma


def emulate(
    q8, k8, v8, descales, *, causal: bool, tile_n: int, acc_bits: int = 23,
    rescale_threshold: int = 0,
):  # fmt: skip
    """(out (B, Nq, Hq, Dv) bf16, lse (B, Hq, Nq) fp32) as the fa3 fp8 kernel computes them."""
    b, nq, hq, d = q8.shape
    nk, hkv = k8.shape[1], k8.shape[2]
    g = hq // hkv
    ds_q, ds_k, ds_v = descales
    qf = q8.float().transpose(1, 2)  # (B, Hq, Nq, D)
    kf = k8.float().repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, D)
    vf = v8.float().repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, Dv)
    s_raw = _mma(torch.zeros(b, hq, nq, nk), qf, kf.transpose(-1, -2), acc_bits)
    qk_descale = (ds_q * ds_k).repeat_interleave(g, 1)[:, :, None, None]  # (B, Hq, 1, 1)
    scale_log2 = math.log2(math.e) * d**-0.5 * qk_descale
    visible = visibility_mask(nq, nk, causal=causal, window_size=(-1, -1), device=q8.device)
    s_raw = s_raw.masked_fill(~visible, float("-inf"))
    m = torch.full((b, hq, nq, 1), float("-inf"))
    row_sum = torch.zeros(b, hq, nq, 1)
    acc = torch.zeros(b, hq, nq, vf.shape[-1])
    for start in reversed(range(0, nk, tile_n)):
        s = s_raw[..., start : start + tile_n]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        if rescale_threshold > 0:  # NaN (both -inf) and +inf growth compare False: a new max
            m_new = torch.where((m_new - m) * scale_log2 <= rescale_threshold, m, m_new)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        corr = torch.exp2(m * scale_log2 - m_safe * scale_log2)
        p = torch.exp2(s * scale_log2 - m_safe * scale_log2)
        row_sum = row_sum * corr + p.sum(-1, keepdim=True)
        acc = _mma(acc * corr, p.to(E4M3).float(), vf[:, :, start : start + tile_n], acc_bits)
        m = m_new
    empty = row_sum == 0
    l_safe = torch.where(empty, torch.ones_like(row_sum), row_sum)
    ds_v = ds_v.repeat_interleave(g, 1)[:, :, None, None]
    out = torch.where(empty, torch.zeros_like(acc), acc * (ds_v / l_safe))
    lse = torch.where(empty, -math.inf, (m * scale_log2 + torch.log2(l_safe)) * math.log(2))
    return out.transpose(1, 2).to(torch.bfloat16), lse[..., 0]


def emulate_blocks(
    q8, k8, v8, views, *, causal: bool, tile_n: int, acc_bits: int = 23,
    rescale_threshold: int = 0, window_size=(-1, -1), carry_v: bool = True,
):  # fmt: skip
    """`emulate` for fa3's per-block build (FP8_BLOCKS): descales as the attention API's block
    views (common.fp8.block_view; (B, Hkv) or None also work). Each row's exp2 scale takes its
    q descale and each key block's k descale, the running max is kept in log2 units, and O in
    units of the current block's v descale (its rescale between blocks gains the ratio of the
    previous block's to this one's; the epilogue multiplies by the last block's).
    `carry_v=False` drops that ratio: the error the GPU mutant "O's units not carried" makes."""
    from flashsuite.common.fp8 import descale_rows

    b, nq, hq, d = q8.shape
    nk, hkv = k8.shape[1], k8.shape[2]
    g = hq // hkv
    ones = torch.ones(b, hkv)

    def rows(view, n):  # (B, Hq, N or 1)
        r = descale_rows(view if view is not None else ones, n)
        return r if r.shape[1] == hq else r.repeat_interleave(g, 1)

    ds_q, ds_k, ds_v = (rows(t, n) for t, n in zip(views, (nq, nk, nk), strict=True))
    qf = q8.float().transpose(1, 2)  # (B, Hq, Nq, D)
    kf = k8.float().repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, D)
    vf = v8.float().repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, Dv)
    s_raw = _mma(torch.zeros(b, hq, nq, nk), qf, kf.transpose(-1, -2), acc_bits)
    visible = visibility_mask(nq, nk, causal=causal, window_size=window_size, device=q8.device)
    s_raw = s_raw.masked_fill(~visible, float("-inf"))
    row_pre = math.log2(math.e) * d**-0.5 * ds_q[..., None]  # (B, Hq, Nq or 1, 1)
    m = torch.full((b, hq, nq, 1), float("-inf"))  # log2 units
    row_sum = torch.zeros(b, hq, nq, 1)
    acc = torch.zeros(b, hq, nq, vf.shape[-1])
    dsv_prev = torch.ones(b, hq, 1, 1)
    for start in reversed(range(0, nk, tile_n)):
        s = s_raw[..., start : start + tile_n]
        blk = min(start, ds_k.shape[-1] - 1)  # the block's first key's (one per block)
        scale = row_pre * ds_k[..., blk : blk + 1, None]  # (B, Hq, Nq or 1, 1)
        dsv = ds_v[..., blk : blk + 1, None]  # (B, Hq, 1, 1)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True) * scale)
        if rescale_threshold > 0:
            m_new = torch.where(m_new - m <= rescale_threshold, m, m_new)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        corr = torch.exp2(m - m_safe)
        p = torch.exp2(s * scale - m_safe)
        row_sum = row_sum * corr + p.sum(-1, keepdim=True)
        ratio = dsv_prev / dsv if carry_v else torch.ones_like(dsv)
        acc = _mma(acc * (corr * ratio), p.to(E4M3).float(), vf[:, :, start : start + tile_n],
                   acc_bits)  # fmt: skip
        m, dsv_prev = m_new, dsv
    empty = row_sum == 0
    l_safe = torch.where(empty, torch.ones_like(row_sum), row_sum)
    out = torch.where(empty, torch.zeros_like(acc), acc * (dsv_prev / l_safe))
    lse = torch.where(empty, -math.inf, (m + torch.log2(l_safe)) * math.log(2))
    return out.transpose(1, 2).to(torch.bfloat16), lse[..., 0]


def check_case(
    case, acc_bits: int = 23, rescale_threshold: int = 0
) -> tuple[Comparison, Comparison]:
    """(out, lse) comparisons of the emulation on one tests/test_fp8.py case, the test's rule."""
    from flashsuite.fa3.configs import FP8_DTYPE, get_config
    from tests.test_fp8 import _fp8_inputs

    b, nq, nk, hq, hkv, d, causal = case[:7]
    q8, k8, v8, ds = _fp8_inputs(b, nq, nk, hq, hkv, d, "cpu")
    kwargs = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    ref = reference_pair(q8, k8, v8, causal=causal, **kwargs)
    base = fp8_baseline(q8, k8, v8, ds, causal=causal)
    cfg = get_config(d, FP8_DTYPE, causal)
    out, lse = emulate(
        q8, k8, v8, ds, causal=causal, tile_n=cfg.tile_n, acc_bits=acc_bits,
        rescale_threshold=rescale_threshold,
    )  # fmt: skip
    return (
        compare("out", out, ref["out"][0], base, factor=FP8_FACTOR, dtype=torch.bfloat16),
        compare("lse", lse, *ref["lse"]),
    )


def main() -> None:
    from tests.test_fp8 import FP8_CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--acc-bits", type=int, nargs="+", default=[23, 13])
    parser.add_argument("--rescale-threshold", type=int, default=0)
    args = parser.parse_args()
    for case in FP8_CASES:
        for bits in args.acc_bits:
            print(f"{case[:7]} acc_bits={bits} rescale_threshold={args.rescale_threshold}")
            for result in check_case(case, bits, args.rescale_threshold):
                print(f"    {result}")


if __name__ == "__main__":
    main()
