"""fa3's packed causal forward with the plain grid's launch order against the sectioned one
(Fa3Config.head_section; configs.varlen_config ships S = VARLEN_CAUSAL_HEAD_SECTION), and the
dense forward on the same tokens (a GPU run).

    python -m benchmarks.fa3_varlen_order_ab                      # S = 4, 8, 16; 5 passes
    python -m benchmarks.fa3_varlen_order_ab --section 8 --passes 7

The 64k-token mix of decode_bench's varlen prefill (35 sequences, mean 2k, H 16, D 128, bf16,
causal). Each sectioned build's out and lse must equal the plain grid's bit for bit (the order
changes which CTA runs a tile, not its arithmetic); then every contender is timed once per
pass, passes interleaved (triton.testing.do_bench), and the medians printed as TFLOP/s of the
causal packed problem (sum of L^2 / 2 per sequence) and of the dense B 32 x N 2048 one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

import torch


def main(argv: list[str] | None = None) -> int:
    from benchmarks.decode_bench import _mixed_lengths
    from flashsuite import dispatch
    from flashsuite.common.validation import check_varlen_inputs
    from flashsuite.fa3 import interface as fa3
    from flashsuite.fa3.configs import varlen_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--section", type=int, action="append", default=[], help="S (repeat)")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args(argv)
    sections = args.section or [4, 8, 16]
    if bad := [s for s in sections if s < 1]:
        ap.error(f"--section: expected >= 1, got {bad}")
    import triton

    lens = _mixed_lengths(65536, 2048, torch.Generator().manual_seed(0))
    heads, d = 16, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), heads, d, device="cuda").to(torch.bfloat16) for _ in "qkv")
    vp = check_varlen_inputs(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    plain = replace(varlen_config(d, torch.bfloat16, True), head_section=0)
    cfgs = {"plain": plain, **{f"S{s}": replace(plain, head_section=s) for s in sections}}
    ref = fa3.varlen_forward(q, k, v, cu, cu, vp, cfg=plain)
    for name, cfg in cfgs.items():
        out, lse = fa3.varlen_forward(q, k, v, cu, cu, vp, cfg=cfg)
        same = torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
        print(f"{name}: bitwise equal to the plain grid: {same}", flush=True)
        if not same:
            return 1
    dq, dk, dv = (torch.randn(32, 2048, heads, d, device="cuda").to(torch.bfloat16) for _ in "qkv")
    fns = {n: (lambda c=c: fa3.varlen_forward(q, k, v, cu, cu, vp, cfg=c)) for n, c in cfgs.items()}
    fns["dense"] = lambda: dispatch.attention(dq, dk, dv, causal=True, version="fa3")
    flops_packed = sum(4 * heads * d * n * n / 2 for n in lens)
    flops_dense = 32 * 4 * heads * d * 2048 * 2048 / 2
    ms: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(args.passes):
        for name, fn in fns.items():
            ms[name].append(triton.testing.do_bench(fn, warmup=10, rep=60))
    tflops = {
        n: (flops_dense if n == "dense" else flops_packed) / statistics.median(x) / 1e9
        for n, x in ms.items()
    }
    for name, x in ms.items():
        passes = " ".join(f"{t * 1e3:.0f}" for t in x)
        print(
            f"{name:>6}: median {statistics.median(x) * 1e3:7.1f} us, {tflops[name]:6.1f} TFLOP/s,"
            f" {tflops[name] / tflops['dense']:.3f}x dense (passes {passes})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
