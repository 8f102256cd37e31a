"""fa3's packed forward in several builds against each other and against the dense forward on
the same tokens (a GPU run): the plain grid's launch order against the sectioned one
(Fa3Config.head_section; varlen_configs.varlen_config ships S = VARLEN_CAUSAL_HEAD_SECTION for
causal problems), the dense entries' schedule options (`--options`: varlen_config(options=True)), or
any Fa3Config fields (`--variant`, as benchmarks.fa3_fwd_ab's).

    python -m benchmarks.fa3_varlen_order_ab                      # causal D 128: S = 4, 8, 16
    python -m benchmarks.fa3_varlen_order_ab --section 8 --passes 7
    python -m benchmarks.fa3_varlen_order_ab --head-dim 64 --options --passes 5
    python -m benchmarks.fa3_varlen_order_ab --non-causal --variant ka:k_ahead=0

The 64k-token mix of decode_bench's varlen prefill (35 sequences, mean 2k, Hq·D = 2048, bf16).
"shipped" is varlen_config's build and the reference: a build that changes only the order
(sections) must give its out and lse bit for bit, any other must stay within 2e-2 of its out
(bf16 rounding of a different schedule; the GPU oracle cases of tests/test_fa3_varlen.py are
what check a build's correctness). Then every contender is timed once per pass, passes
interleaved (triton.testing.do_bench), and the medians printed as TFLOP/s of the packed
problem (sum of L^2, halved when causal, per sequence) and of the dense B 32 x N 2048 one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

import torch


def main(argv: list[str] | None = None) -> int:
    from benchmarks.decode_bench import _mixed_lengths
    from benchmarks.fa3_fwd_ab import parse_variant
    from flashsuite import dispatch
    from flashsuite.common.validation import check_varlen_inputs
    from flashsuite.fa3 import interface as fa3
    from flashsuite.fa3.varlen_configs import varlen_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--section", type=int, action="append", default=[], help="S (repeat)")
    ap.add_argument("--options", action="store_true", help="varlen_config(options=True)")
    ap.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE,... (repeat)")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args(argv)
    causal, d = not args.non_causal, args.head_dim
    if bad := [s for s in args.section if s < 1]:
        ap.error(f"--section: expected >= 1, got {bad}")
    sections = args.section or ([] if args.options or args.variant or not causal else [4, 8, 16])
    try:
        variants = [parse_variant(s, table_ok=False) for s in args.variant]
    except ValueError as e:
        ap.error(str(e))
    import triton

    lens = _mixed_lengths(65536, 2048, torch.Generator().manual_seed(0))
    heads = 2048 // d
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), heads, d, device="cuda").to(torch.bfloat16) for _ in "qkv")
    vp = check_varlen_inputs(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    shipped = varlen_config(d, torch.bfloat16, causal)
    orders = {f"S{s}": replace(shipped, head_section=s) for s in sections}
    if causal and sections:
        orders["plain"] = replace(shipped, head_section=0)
    others = {n: replace(shipped, **c) for n, c in variants}
    if args.options:
        others["options"] = varlen_config(d, torch.bfloat16, causal, options=True)
    cfgs = {"shipped": shipped, **orders, **others}
    ref = fa3.varlen_forward(q, k, v, cu, cu, vp, cfg=shipped)
    for name, cfg in cfgs.items():
        out, lse = fa3.varlen_forward(q, k, v, cu, cu, vp, cfg=cfg)
        same = torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
        err = (out.float() - ref[0].float()).abs().max().item()
        print(f"{name}: bitwise equal to shipped: {same}, max |out - shipped's| {err:.2e}")
        if (name in orders and not same) or not err <= 2e-2:
            return 1
    dq, dk, dv = (torch.randn(32, 2048, heads, d, device="cuda").to(torch.bfloat16) for _ in "qkv")
    fns = {n: (lambda c=c: fa3.varlen_forward(q, k, v, cu, cu, vp, cfg=c)) for n, c in cfgs.items()}
    fns["dense"] = lambda: dispatch.attention(dq, dk, dv, causal=causal, version="fa3")
    half = 2 if causal else 1
    flops_packed = sum(4 * heads * d * n * n / half for n in lens)
    flops_dense = 32 * 4 * heads * d * 2048 * 2048 / half
    ms: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(args.passes):
        for name, fn in fns.items():
            ms[name].append(triton.testing.do_bench(fn, warmup=10, rep=60))
    tflops = {
        n: (flops_dense if n == "dense" else flops_packed) / statistics.median(x) / 1e9
        for n, x in ms.items()
    }
    kind = "causal" if causal else "non-causal"
    print(f"D {d}, {kind}, {len(lens)} sequences, {sum(lens)} tokens")
    for name, x in ms.items():
        passes = " ".join(f"{t * 1e3:.0f}" for t in x)
        print(
            f"{name:>8}: median {statistics.median(x) * 1e3:7.1f} us, {tflops[name]:6.1f} TFLOP/s,"
            f" {tflops[name] / tflops['dense']:.3f}x dense,"
            f" {tflops[name] / tflops['shipped']:.3f}x shipped (passes {passes})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
