"""Where fa3's fp8 error sits (sm90 GPU): per-block descales and the 1-bit rescale threshold.

For each per-block case of tests/test_fp8_blocks.py: the out and LSE checks the test makes,
the error by block of query rows, the kernel against its CPU emulation
(benchmarks/fp8_emulation.emulate_blocks) and the per-block build with every block's descale
equal to its head's against the per-head build (equal unless the block indexing is wrong).
The same values quantised per head run through the per-head build as well (does it meet its
own baseline on these scores?). For the growing-max case of tests/test_fp8.py: the checks
with the table's rescale_threshold and with 0 and with row_chains off.

    python -m benchmarks.fa3_fp8_blocks_probe [--cases 0,6] [--moderate] [--threshold]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from flashsuite import dispatch
from flashsuite.common.fp8 import block_view, quantize
from flashsuite.common.fp8_reference import attention_fp8
from flashsuite.common.testing import (
    FP8_ACC_BITS,
    FP8_FACTOR,
    compare,
    fp8_lse_baseline,
    reference_pair,
)
from flashsuite.common.validation import check_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
VERSION = "fa3" if DEV == "cuda" else "torch"  # the CPU runs the probe's own code only


def _rows_err(x: torch.Tensor, ref: torch.Tensor, block: int) -> str:
    """max |x - ref| / max |ref| per block of query rows; x, ref (B, Nq, H, D)."""
    err = (x.float() - ref.float()).abs().amax(dim=(0, 2, 3))  # (Nq,)
    scale = ref.float().abs().amax().clamp_min(1e-30)
    per = [f"{(err[i : i + block].max() / scale).item():.3g}" for i in range(0, len(err), block)]
    return " ".join(per)


def _run_and_check(label: str, t8: tuple, descales: dict, opts: dict) -> tuple:
    """fa3 (through dispatch) on Fp8Tensors `t8` with API `descales`; prints the out and LSE
    checks the tests make and returns (out, lse, the oracle pair, the e4m3 baseline's out)."""
    q8, k8, v8 = t8
    out, lse = dispatch.attention(
        q8.data, k8.data, v8.data, return_lse=True, version=VERSION, **opts, **descales
    )
    ref = reference_pair(q8.data, k8.data, v8.data, **opts, **descales)
    base = attention_fp8(q8, k8, v8, **opts)
    out_check = compare("out", out, ref["out"][0], base, factor=FP8_FACTOR, dtype=torch.bfloat16)
    ds_qk = (descales["descale_q"], descales["descale_k"])
    lse_base = fp8_lse_baseline(q8.data, k8.data, ds_qk, **opts)
    lse_check = compare("lse", lse, ref["lse"][0], lse_base, factor=FP8_FACTOR)
    print(f"   {label}{out_check}\n   {label}{lse_check}")
    return out, lse, ref, base


def probe_block_case(case: tuple, moderate: bool = False) -> None:
    from benchmarks.fp8_emulation import emulate_blocks
    from flashsuite.fa3.interface import config_for
    from tests.test_fp8_blocks import _block_inputs, _case_id

    causal, window, softcap = case[9:]
    print(f"== {_case_id(case)}")
    q8, k8, v8 = _block_inputs(case, DEV, moderate=moderate)
    views = dict(descale_q=q8.kernel_descale, descale_k=k8.kernel_descale,
                 descale_v=v8.kernel_descale)  # fmt: skip
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    p = check_inputs(q8.data, k8.data, v8.data, **opts, **views)
    cfg = config_for(p)
    print(f"   config tile {cfg.tile_m}x{cfg.tile_n} v_transpose {cfg.v_transpose}")
    out, lse, ref, base = _run_and_check("", (q8, k8, v8), views, opts)
    print(f"   out err / max|ref| by {case[6]}-row block: {_rows_err(out, ref['out'][0], case[6])}")
    print(f"   base err           by block: {_rows_err(base, ref['out'][0], case[6])}")
    dl = (lse.float() - ref["lse"][0].float()).abs()  # (B, H, Nq)
    dl = torch.where(torch.isfinite(dl), dl, torch.zeros_like(dl))
    per = [f"{dl[..., i : i + case[6]].max().item():.3g}" for i in range(0, case[1], case[6])]
    print(f"   |lse - ref| by block: {' '.join(per)}")
    # Which accumulator model the kernel's scores follow: the LSE baseline at a few widths of
    # the e4m3 wgmma's accumulator, each against the oracle and against the kernel.
    ds_qk = (views["descale_q"], views["descale_k"])
    for bits in (11, 12, 13, 14, 23):
        lb = fp8_lse_baseline(q8.data, k8.data, ds_qk, acc_bits=bits, **opts)
        fin = torch.isfinite(lb)
        e_ref = (lb - ref["lse"][0].float())[fin].abs().max().item()
        e_ker = (lb - lse.float())[fin].abs().max().item()
        print(f"   lse baseline at {bits:2d} bits: vs ref {e_ref:.3g}, vs kernel {e_ker:.3g}")
    if softcap == 0.0:
        cpu = [t.cpu() for t in views.values()]
        emu, _ = emulate_blocks(
            q8.data.cpu(), k8.data.cpu(), v8.data.cpu(), cpu, tile_n=cfg.tile_n,
            causal=causal, window_size=window, rescale_threshold=cfg.rescale_threshold,
        )  # fmt: skip
        print(f"   kernel vs emulation by block: {_rows_err(out.cpu(), emu, case[6])}")
        print(f"   emulation vs ref   by block: {_rows_err(emu, ref['out'][0].cpu(), case[6])}")
        emu13, _ = emulate_blocks(
            q8.data.cpu(), k8.data.cpu(), v8.data.cpu(), cpu, tile_n=cfg.tile_n,
            causal=causal, window_size=window, rescale_threshold=cfg.rescale_threshold,
            acc_bits=FP8_ACC_BITS,
        )  # fmt: skip
        print(f"   the same with the e4m3 accumulator ({FP8_ACC_BITS} bits) vs ref: "
              f"{_rows_err(emu13, ref['out'][0].cpu(), case[6])}")  # fmt: skip
    # Every block's descale equal to its head's: the per-block build must equal the per-head.
    ones = {}
    for name, t in views.items():
        b, h, nb, blk = t.shape
        ones[name] = block_view(torch.full((b, h, nb), 0.5, device=DEV), blk)
    hkv = (case[0], case[4])
    heads = {name: torch.full(hkv, 0.5, device=DEV) for name in views}
    o1 = dispatch.attention(q8.data, k8.data, v8.data, version=VERSION, **opts, **ones)
    o2 = dispatch.attention(q8.data, k8.data, v8.data, version=VERSION, **opts, **heads)
    print(f"   uniform blocks vs per head: max |diff| {(o1.float() - o2.float()).abs().max():.3g}"
          f" (max |out| {o2.float().abs().max():.3g})")  # fmt: skip
    # The same values quantised per head, through the per-head build: whether it meets its own
    # baseline on these scores (a miss here too says the regime, not the block arithmetic).
    group = case[3] // case[4]
    qh = quantize(q8.dequantize(), "head", group=group)
    kh, vh = quantize(k8.dequantize(), "head"), quantize(v8.dequantize(), "head")
    hv = dict(descale_q=qh.descale, descale_k=kh.descale, descale_v=vh.descale)
    _run_and_check("per head: ", (qh, kh, vh), hv, opts)


def probe_threshold(d: int, growth: float) -> None:
    from flashsuite.common.testing import fp8_baseline
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import config_for
    from tests.test_fp8 import growing_max_inputs

    q8, k8, v8, ds = growing_max_inputs(d, growth, DEV)
    kw = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
    p = check_inputs(q8, k8, v8, **kw)
    table = config_for(p)
    ref = reference_pair(q8, k8, v8, **kw)
    base = fp8_baseline(q8, k8, v8, ds, causal=False)
    lse_base = fp8_lse_baseline(q8, k8, ds)
    for label, cfg in (
        ("table", table),
        ("threshold 0", replace(table, rescale_threshold=0)),
        ("row_chains off", replace(table, row_chains=False)),
        ("both off", replace(table, rescale_threshold=0, row_chains=False)),
    ):
        out, lse = interface.forward(q8, k8, v8, p, *ds, cfg=cfg)
        checks = (
            compare("out", out, ref["out"][0], base, factor=FP8_FACTOR, dtype=torch.bfloat16),
            compare("lse", lse, ref["lse"][0], lse_base, factor=FP8_FACTOR),
        )
        for c in checks:
            print(f"   d {d} growth {growth} {label}: {c}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="indices into BLOCK_CASES (default all)")
    ap.add_argument("--threshold", action="store_true", help="the growing-max probe as well")
    ap.add_argument(
        "--moderate", action="store_true", help="inputs without outlier channels (scores ~30)"
    )
    args = ap.parse_args()
    from tests.test_fp8_blocks import BLOCK_CASES

    idx = [int(i) for i in args.cases.split(",") if i] or range(len(BLOCK_CASES))
    for i in idx:
        try:
            probe_block_case(BLOCK_CASES[i], args.moderate)
        except Exception as e:
            print(f"   error: {type(e).__name__}: {e}")
    if args.threshold:
        for d in (128, 256):
            for growth in (0.7, 3.0):
                try:
                    probe_threshold(d, growth)
                except Exception as e:
                    print(f"   error: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
