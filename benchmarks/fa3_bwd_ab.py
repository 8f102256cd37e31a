"""Interleaved A/B timing of fa3 backward variants against each other and cuDNN (a GPU run).

    python3 -m benchmarks.fa3_bwd_ab --variant pipe80 --variant pipe_stm --head-dim 128 \
        --repeats 3
    python3 -m benchmarks.fa3_bwd_ab --variant pipe_sec4_tma --variant pipe_stm_tma --causal \
        --seqlen 1024 --seqlen 4096 --seqlen 8192
    python3 -m benchmarks.fa3_bwd_ab --variant pipe_sec4_wgdq_tma --causal --step \
        --seqlen 8192 --repeats 7          # the training step: forward + backward

One variant's run after another's on the same machine drifts by several percent (clocks,
temperature, what ran before), more than the differences being decided. This script times
every contender on every shape once per pass, passes interleaved, and prints each one's
TFLOP/s per pass and their median, then each contender's per-pass ratio to SDPA's cuDNN
backend and FA4 (`paired_ratios`): variants by name (benchmarks/fa3_bwd_variants.py, through
fa3.interface.backward with the variant's config), "fa3" (the shipped path through dispatch and
autograd), SDPA's cuDNN backend and, when flash-attn-4 is importable, FA4's SM90 backward.
Shapes: the standard sweep's B·N = 16k, Hq·D = 2048 at N 4k and 16k (or each --seqlen),
non-causal unless --causal. With --step, the training step (forward + backward TFLOP/s): a
variant's is fa3's forward through dispatch (no autograd) followed by its backward, the shipped
"fa3" and the peers' a forward and torch.autograd.grad. Correctness is fa3_bwd_check's job:
run it first.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.ab_stats import paired_ratios
from benchmarks.fa3_bwd_check import time_case, time_variant
from benchmarks.fa3_bwd_variants import VARIANTS, add_variant_option
from flashsuite.common.testing import Case
from flashsuite.dispatch.bench import fa4_function


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_variant_option(ap)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--seqlen", type=int, action="append", default=[], help="N (repeat; default 4096, 16384)"
    )
    ap.add_argument("--step", action="store_true", help="time forward + backward")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: expected >= 1, got {args.repeats}")
    seqlens = args.seqlen or [4096, 16384]
    if bad := [n for n in seqlens if n < 1 or 16384 % n]:
        ap.error(f"--seqlen: expected divisors of 16384 (B * N = 16k), got {bad}")
    d, heads = args.head_dim, 2048 // args.head_dim
    cases = [
        Case(16384 // n, n, n, heads, heads, d, dtype=torch.bfloat16, causal=args.causal)
        for n in seqlens
    ]
    fa4, _ = fa4_function()
    contenders = [*args.variant, "fa3", "sdpa-cudnn", *(["fa4"] if fa4 is not None else [])]
    tflops: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for case in cases:
            for name in contenders:
                if name in VARIANTS:
                    row = time_variant(name, VARIANTS[name][0], case, step=args.step)
                else:
                    row = time_case(name, case, step=args.step)
                tflops.setdefault((name, case.seqlen_q), []).append(row["tflops"])
    what = "training step (fwd + bwd)" if args.step else "backward"
    print(f"{what} TFLOP/s, D {d}, {'causal' if args.causal else 'non-causal'}, bf16")
    for (name, n), values in tflops.items():
        passes = " ".join(f"{x:.1f}" for x in values)
        print(f"{name:>12} N {n:>5}: median {statistics.median(values):.1f} (passes {passes})")
    peers = [c for c in contenders if c in ("sdpa-cudnn", "fa4")]
    for line in paired_ratios(tflops, peers):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
