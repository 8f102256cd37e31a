"""Upper bounds of cuts to the fa3 forward's softmax: timed on a GPU, outputs wrong on purpose.

    python3 -m benchmarks.softmax_bound --fp8 --head-dim 128 --cut none --cut nosum --cut halfex2
    python3 -m benchmarks.softmax_bound --head-dim 64 --cut nosum --sass   # on a CPU

What would a faster softmax buy? Each cut removes work from `softmax.online_softmax` without
replacing it, so its time is a bound on what any real form of that cut can gain:

- `nosum`: the row sums are not accumulated (every block adds 1.0 instead of its sum of P), so
  the FADDs of P's row sum drop out (a row sum from the tensor cores, a ones column beside
  V, would remove them at the cost of more MMA work);
- `halfex2`: every other P of a row is its exponent instead of exp2 of it, so half the
  MUFU.EX2 drop out (exponentials moved to the FMA pipe, or a cheaper exponential, could at
  best gain this);
- `nomax`: each block's row max is not taken (the max subtracted is 0.0, the raw scores' scale
  keeps the randn inputs' exponentials finite), so the FMNMX chains and the quad's max
  shuffles drop out, and the exponentials wait on nothing but S: what a max taken off the
  exponentials' path (exponentials against the running max, checked after) could gain at best;
- `none`: the shipped build, the baseline.

Each cut is a source edit of online_softmax, compiled from a file of its own (the DSL reads a
function's source) and swapped into fwd_mainloop, so each cut runs in a process of its own
(this tool starts one per cut). The disk cache is off there: no edited binary is stored.
Problem: the standard sweep's N = 16k point (B 1, Hq·D = 2048, non-causal), randn inputs (e4m3
with unit descales under --fp8), the shipped config, through fa3.interface.forward (every
step of the call), TFLOP/s medians of --reps timings, the cuts interleaved over --rounds.
`--sass` compiles each cut for sm_90a on the CPU instead and prints the overlapped loop's
instruction counts (benchmarks.fa3_softmax_sass: loop_insns, MUFU and FADD of its body).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

# cut -> ((text of online_softmax, what replaces it), ...): each text is there once. halfex2
# edits both places P's exponentials are taken (before P·V's wait under pv_wait_exps, after it).
CUTS = {
    "none": None,
    "nosum": (
        (
            "row_sum[r] = row_sum[r] * corr[r] + s",
            "row_sum[r] = row_sum[r] * corr[r] + Float32(1.0)",
        ),
    ),
    "nomax": (
        (
            "m_new = cute.arch.warp_reduction_max(m_blk, threads_in_group=4)  # the quad",
            "m_new = Float32(0.0)",
        ),
    ),
    "halfex2": (
        (
            "else _exp2(x, emulated(k, ex2_emu))",
            "else (_exp2(x, emulated(k, ex2_emu)) if const_expr(k % 2 == 0) else x)",
        ),
        (
            "xs[r][k] = _exp2(xs[r][k], emulated(k, ex2_emu))",
            "xs[r][k] = (_exp2(xs[r][k], emulated(k, ex2_emu)) if const_expr(k % 2 == 0)"
            " else xs[r][k])",
        ),
    ),
}


def patched_source(cut: str) -> str:
    """online_softmax's source with `cut` applied (ValueError if one of its texts is not there
    once)."""
    from flashsuite.fa3 import softmax

    src = textwrap.dedent(inspect.getsource(softmax.online_softmax))
    for old, new in CUTS[cut] or ():
        if src.count(old) != 1:
            raise ValueError(
                f"cut {cut!r}: expected {old!r} once in online_softmax, found {src.count(old)}"
            )
        src = src.replace(old, new)
    return src


def apply(cut: str) -> None:
    """Swap `cut`'s online_softmax into fwd_mainloop (before any forward is compiled)."""
    if CUTS[cut] is None:
        return
    from flashsuite.fa3 import fwd_mainloop, softmax

    src = patched_source(cut)
    path = os.path.join(tempfile.mkdtemp(prefix="softmax_bound_"), f"online_softmax_{cut}.py")
    with open(path, "w") as f:  # the DSL re-reads the source of what it compiles
        f.write(src)
    ns = dict(softmax.__dict__)
    exec(compile(src, path, "exec"), ns)
    fwd_mainloop.online_softmax = ns["online_softmax"]


def time_cut(cut: str, fp8: bool, head_dim: int, reps: int) -> list[float]:
    """TFLOP/s of `reps` timings of the shipped forward with `cut` (this process: apply first)."""
    os.environ["FLASHSUITE_CACHE_DIR"] = "off"
    apply(cut)
    import torch

    from flashsuite.common.validation import check_inputs
    from flashsuite.dispatch.bench import time_ms
    from flashsuite.fa3 import interface as fa3

    n, heads = 16384, 2048 // head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q, k, v = (
        torch.randn(1, n, heads, head_dim, generator=g, device="cuda").to(dtype) for _ in range(3)
    )  # (B, N, H, D)
    descales = [torch.ones(1, heads, device="cuda") for _ in range(3)] if fp8 else []
    p = check_inputs(q, k, v)
    fn = lambda: fa3.forward(q, k, v, p, *descales)
    fn()
    flops = 4 * heads * n * n * head_dim
    return [flops / time_ms(fn) / 1e9 for _ in range(reps)]


def sass_counts(cut: str, fp8: bool, head_dim: int) -> dict:
    """The overlapped loop's counts of `cut`'s build for sm_90a (this process: compiles)."""
    from benchmarks import fa3_probe  # noqa: F401  (first: sets CUTE_DSL_* before cutlass)

    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"  # before the edited function is built
    apply(cut)
    from benchmarks.fa3_softmax_sass import _parser, build

    ap = _parser()
    args = ap.parse_args(["--head-dim", str(head_dim), *(["--fp8"] if fp8 else [])])
    res = build(ap, args)
    ops = res["loop_ops"]
    return {"loop_insns": res["loop_insns"], "MUFU": ops.get("MUFU", 0), "FADD": ops.get("FADD", 0),
            "spill_stores": res["spill_stores"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cut", action="append", choices=sorted(CUTS), default=[], help="(repeat)")
    ap.add_argument("--fp8", action="store_true", help="e4m3 inputs, unit descales")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sass", action="store_true", help="CPU: compile and count instead")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: this cut only
    args = ap.parse_args(argv)
    if args.one:
        res = (
            sass_counts(args.one, args.fp8, args.head_dim)
            if args.sass
            else time_cut(args.one, args.fp8, args.head_dim, args.reps)
        )
        print("RESULT", json.dumps(res), flush=True)
        return 0
    cuts = args.cut or ["none", "nosum", "halfex2"]
    what = f"{'e4m3' if args.fp8 else 'bf16'} D {args.head_dim}"
    for _ in range(1 if args.sass else args.rounds):
        for cut in cuts:
            flags = ["--fp8"] * args.fp8 + ["--sass"] * args.sass
            cmd = [sys.executable, "-m", "benchmarks.softmax_bound", "--one", cut,
                   "--head-dim", str(args.head_dim), "--reps", str(args.reps), *flags]  # fmt: skip
            run = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
            if run.returncode or not lines:
                print(f"{what} {cut}: failed\n{run.stderr[-2000:]}", flush=True)
                return 1
            res = json.loads(lines[-1].removeprefix("RESULT "))
            if args.sass:
                print(f"{what} {cut}: {res}", flush=True)
            else:
                passes = " ".join(f"{t:.0f}" for t in res)
                print(f"{what} {cut}: median {statistics.median(res):.1f} TFLOP/s ({passes})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
