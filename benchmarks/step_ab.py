"""A training step (forward + backward, or with --backward the backward alone) of fa3 against
SDPA's cuDNN backend and FA4, timed call by call in rotation, and the kernels each step
launches (a GPU run).

    python3 -m benchmarks.step_ab --head-dim 128 --seqlen 8192 --reps 60 --profile
    python3 -m benchmarks.step_ab --causal --seqlen 4096 --seqlen 16384
    python3 -m benchmarks.step_ab --backward --head-dim 256 --causal --seqlen 4096 \
        --variant wide256_red80_wgs_sec4

fa3_bwd_ab --step times each contender for 100 ms per pass, so a pass's ratio compares timings
taken a second or more apart; on an H100 its per-pass ratios of the D 128, N 8k step spread
from 0.96 to 1.25x cuDNN. Here each repetition runs every contender once, in an order rotated
each time, with the L2 flushed before each call and CUDA events around it: a repetition's ratio
compares calls milliseconds apart, so clock and temperature drift cancel. Printed per shape:
each contender's median ms and TFLOP/s, and the median and quartiles of its per-repetition
ratio to each peer. With --profile, one step of each under torch.profiler: the GPU time of each
kernel it launches, so the step's extra kernels (pre/post-processing, copies, memsets) show
next to the attention kernels. --variant NAME adds fa3's backward with a named config of
benchmarks/fa3_bwd_variants.py (fa3_bwd_check's route: fa3.interface.backward on the saved
forward; in a step, dispatch's forward without autograd before it) as contender NAME.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.fa3_bwd_variants import VARIANTS, add_variant_option
from flashsuite.common.flops import attention_flops
from flashsuite.common.testing import Case, make_grad_out, make_inputs
from flashsuite.dispatch.bench import FA4, fa4_function, make_callable


def _step_fn(contender: str, case: Case, backward_only: bool = False):
    """A closure running one forward + torch.autograd.grad of `contender` on `case` (with
    `backward_only`, the backward of one forward made here)."""
    if contender in VARIANTS:
        from benchmarks.fa3_bwd_check import _variant_backward

        q, k, v = make_inputs(case, "cuda")
        dout = make_grad_out(case, "cuda")
        run, _ = _variant_backward(case, VARIANTS[contender][0], q, k, v, dout, not backward_only)
        return run
    q, k, v = make_inputs(case, "cuda", requires_grad=True)
    if contender == "fa3":
        from flashsuite import dispatch

        def run():
            return dispatch.attention(
                q, k, v, causal=case.causal, window_size=case.window_size, version="fa3"
            )

        leaves = (q, k, v)
    else:
        run, leaves = make_callable(contender, case, q, k, v)
    dout = make_grad_out(case, "cuda")
    out = run()
    if out.shape != dout.shape:  # SDPA works in (B, H, N, D)
        dout = dout.transpose(1, 2).contiguous()
    if backward_only:
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(run(), leaves, dout)


def _window(text: str) -> tuple[int, int]:
    """argparse `type` of --window: "L,R", each an int >= -1."""
    parts = text.split(",")
    try:
        left, right = (int(x) for x in parts)
    except ValueError:
        left = right = -2
    if len(parts) != 2 or min(left, right) < -1:
        raise argparse.ArgumentTypeError(f"expected L,R with each >= -1, got {text!r}")
    return left, right


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def time_interleaved(fns: dict[str, object], reps: int, warmup: int = 3) -> dict[str, list[float]]:
    """ms per call of each closure, `reps` calls each, interleaved (the order rotated)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than any L2
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    events = {name: [] for name in names}
    for r in range(reps):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: [s.elapsed_time(e) for s, e in ev] for name, ev in events.items()}


def print_timings(
    ms: dict[str, list[float]], flops: dict[str, float], pairs: list[tuple[str, str]]
) -> None:
    """Each contender's median ms and TFLOP/s (`flops` per call), then for each (name, peer) in
    `pairs` the median and quartiles of the per-repetition TFLOP/s ratio name / peer (the time
    ratio where both do the same FLOPs)."""
    for name, xs in ms.items():
        lo, med, hi = _quartiles(xs)
        print(f"  {name:>10}: median {med:.3f} ms ({flops[name] / med / 1e9:.1f} TFLOP/s), "
              f"quartiles {lo:.3f}-{hi:.3f}")  # fmt: skip
    for name, peer in [(a, b) for a, b in pairs if a in ms and b in ms]:
        ratios = [
            (flops[name] / a) / (flops[peer] / b) for a, b in zip(ms[name], ms[peer], strict=True)
        ]
        lo, med, hi = _quartiles(ratios)
        print(f"  {name:>10} / {peer}: median {med:.3f} (quartiles {lo:.3f}-{hi:.3f})")


def profile_step(name: str, fn, steps: int = 3) -> list[str]:
    """Lines: GPU µs per step of each kernel `fn` launches, largest first, and their sum."""
    from benchmarks.fwd_tree_ab import kernel_us

    rows = sorted(kernel_us(fn, steps).items(), key=lambda kv: -kv[1])
    lines = [f"  {name}: {sum(us for _, us in rows):.1f} us of kernels per step"]
    lines += [f"    {us:9.1f} us  {key}" for key, us in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, action="append", default=[], help="N (default 8192)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--profile", action="store_true", help="each contender's kernels per step")
    ap.add_argument("--backward", action="store_true", help="the backward alone (2.5x FLOPs)")
    add_variant_option(ap)
    ap.add_argument("--flash", action="store_true", help="SDPA's flash backend as a peer too")
    ap.add_argument(
        "--window", type=_window, default=(-1, -1), metavar="L,R",
        help="a sliding window (window_size; -1 an open edge): SDPA's backends take none",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.reps < 4:
        ap.error(f"--reps: expected >= 4, got {args.reps}")
    d = args.head_dim
    fa4 = [FA4] if fa4_function()[0] is not None else []
    flash = ["sdpa-flash"] if args.flash else []
    sdpa = ["sdpa-cudnn", *flash] if args.window == (-1, -1) else []  # SDPA takes no window
    contenders = [*args.variant, "fa3", *sdpa, *fa4]
    for n in args.seqlen or [8192]:
        if n < 1 or 16384 % n:
            ap.error(f"--seqlen: expected a divisor of 16384 (B * N = 16k), got {n}")
        case = Case(16384 // n, n, n, 2048 // d, 2048 // d, d, dtype=torch.bfloat16,
                    causal=args.causal, window_size=args.window)  # fmt: skip
        flops = sum(
            attention_flops(
                case.batch,
                case.heads_q,
                n,
                n,
                d,
                causal=case.causal,
                window_size=case.window_size,
                backward=bwd,
            )
            for bwd in ((True,) if args.backward else (False, True))
        )
        fns = {}
        for name in contenders:
            try:
                fns[name] = _step_fn(name, case, args.backward)
            except Exception as exc:
                print(f"{name}: {type(exc).__name__}: {exc}"[:300])
        ms = time_interleaved(fns, args.reps)
        mask = "causal" if case.causal else "non-causal"
        if case.window_size != (-1, -1):
            mask += f", window {case.window_size}"
        what = "backward" if args.backward else "training step"
        print(f"{what}, D {d}, N {n}, B {case.batch}, H {case.heads_q}, {mask}, bf16, "
              f"{args.reps} repetitions")  # fmt: skip
        # each variant against the shipped fa3, everything against cuDNN, ours against FA4
        ours = [c for c in (*args.variant, "fa3") if c in ms]
        pairs = [(c, "fa3") for c in args.variant]
        pairs += [(c, "sdpa-cudnn") for c in (*ours, *fa4)] + [(c, FA4) for c in ours if fa4]
        pairs += [(c, "sdpa-flash") for c in ours if flash]
        print_timings(ms, dict.fromkeys(ms, flops), pairs)
        if args.profile:
            for name, fn in fns.items():
                print("\n".join(profile_step(name, fn)))
        fns.clear()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
