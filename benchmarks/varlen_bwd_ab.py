"""fa3's varlen backward on packed sequences against its dense backward on the same tokens,
with named configs beside the table's, timed call by call in rotation (a GPU run).

    python3 -m benchmarks.varlen_bwd_ab --head-dim 128 --mean 2048
    python3 -m benchmarks.varlen_bwd_ab --head-dim 64 --causal --variant pipe128_dqm_tma

The packed batch is decode_bench's: 65,536 tokens in sequences of random lengths around
`--mean` (uniform in [mean/8, 2 mean - mean/8]), H = 2048 / D heads (Hq = Hkv), bf16, dO
randn. Each contender is the backward alone, on one saved forward:

- `fa3`: `fa3.interface.varlen_backward` with the table's config (what dispatch runs);
- each `--variant NAME`: the same with a config of benchmarks/fa3_bwd_variants.py (one that
  packed sequences cannot take, lpt or head_section, is reported and left out);
- `fa3-dense`: fa3's dense backward on the same tokens cut into B = total / mean sequences of
  `mean` each (the table's dense config): the #13 reference, "0.9x the dense kernel";
- `sdpa-cudnn`: SDPA's cuDNN backward on that dense batch.

Each repetition calls every contender once in a rotated order with the L2 flushed before each
call (step_ab.time_interleaved). TFLOP/s count the backward as 2.5x each sequence's own forward
FLOPs (causal: the visible pairs). Printed: each contender's median, the median and quartiles
of its per-repetition TFLOP/s ratio to `fa3-dense` and `fa3`, and each variant's largest
gradient difference from the table's config (the bf16 rounding of a different order; the oracle
is tests/test_fa3_varlen_bwd.py's, which runs the table's config).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.decode_bench import _mixed_lengths
from benchmarks.fa3_bwd_variants import VARIANTS, add_variant_option
from benchmarks.step_ab import _step_fn, print_timings, time_interleaved
from flashsuite.common.flops import attention_flops
from flashsuite.common.testing import Case

TOKENS = 65536


def _packed(mean: int, d: int, causal: bool):
    """(run, flops, sequences, longest): run(cfg) makes a closure of fa3's varlen backward
    with `cfg` (None: the table's) on one saved forward of the packed batch; its FLOPs."""
    from flashsuite.common.validation import check_varlen_inputs
    from flashsuite.fa3 import interface

    heads = 2048 // d
    lens = _mixed_lengths(TOKENS, mean, torch.Generator().manual_seed(0))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (
        torch.randn(TOKENS, heads, d, device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(4)
    )
    vp = check_varlen_inputs(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    with torch.no_grad():
        out, lse = interface.varlen_forward(q, k, v, cu, cu, vp)

    def run(cfg=None):
        return lambda: interface.varlen_backward(dout, q, k, v, out, lse, cu, cu, vp, cfg=cfg)

    flops = sum(attention_flops(1, heads, n, n, d, causal=causal, backward=True) for n in lens if n)
    return run, flops, len(lens), max(lens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--mean", type=int, action="append", default=[], help="default 2048")
    ap.add_argument("--reps", type=int, default=30)
    add_variant_option(ap)
    args = ap.parse_args(argv)
    if args.reps < 4:
        ap.error(f"--reps: expected >= 4, got {args.reps}")
    d = args.head_dim
    if 2048 % d:
        ap.error(f"--head-dim: expected a divisor of 2048 (H * D = 2048), got {d}")
    for mean in args.mean or [2048]:
        if mean < 64 or TOKENS % mean:
            ap.error(f"--mean: expected a divisor of {TOKENS} of at least 64, got {mean}")
        run, flops, n_seqs, longest = _packed(mean, d, args.causal)
        case = Case(TOKENS // mean, mean, mean, 2048 // d, 2048 // d, d,
                    dtype=torch.bfloat16, causal=args.causal)  # fmt: skip
        dense_flops = attention_flops(
            case.batch, case.heads_q, mean, mean, d, causal=args.causal, backward=True
        )
        fns, fl = {"fa3": run()}, {"fa3": flops}
        for name in args.variant:
            try:
                fn = run(VARIANTS[name][0])
                fn()  # compiles, and refuses a config packed sequences cannot take
            except Exception as exc:
                print(f"{name}: {type(exc).__name__}: {exc}"[:300])
                continue
            fns[name], fl[name] = fn, flops
        for name in ("fa3-dense", "sdpa-cudnn"):
            fns[name] = _step_fn("fa3" if name == "fa3-dense" else name, case, True)
            fl[name] = dense_flops
        ms = time_interleaved(fns, args.reps)
        mask = "causal" if args.causal else "non-causal"
        print(f"varlen backward, D {d}, {n_seqs} sequences of mean {mean} (longest {longest}), "
              f"{TOKENS} tokens, H {2048 // d}, {mask}, bf16, {args.reps} repetitions")  # fmt: skip
        pairs = [(c, "fa3-dense") for c in ("fa3", *args.variant, "sdpa-cudnn")]
        pairs += [(c, "fa3") for c in args.variant]
        print_timings(ms, fl, pairs)
        ref = fns["fa3"]()
        for name in (n for n in args.variant if n in fns):
            diff = max((a.float() - b.float()).abs().max().item()
                       for a, b in zip(fns[name](), ref, strict=True))  # fmt: skip
            print(f"  {name:>12}: max |grad - fa3's| {diff:.3e}")
        fns.clear()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
