r"""fa3's forward from two source trees, timed interleaved on one GPU (a GPU run).

    git archive --prefix=old/ OLD_COMMIT | tar -x -C /tmp
    python3 -m benchmarks.fwd_tree_ab --tree old=/tmp/old --tree new=. --passes 3
    python3 -m benchmarks.fwd_tree_ab --tree old=/tmp/old --tree nocache=. \
        --tree-env nocache=FLASHSUITE_CACHE_DIR=off --tree new=. \
        --match bf16-d128-n8192-causal --kernels
    python3 -m benchmarks.fwd_tree_ab --tree old=/tmp/old --tree new=. --match bf16 --rest 2
    python3 -m benchmarks.fwd_tree_ab --tree old=/tmp/old --tree new=. --seqlen 1024 --seqlen 4096

A change that should not move the forward (a refactor, a new module beside the kernel) is shown
to be neutral by timing the forward of the tree before it and the tree after it in one run:
each pass runs every tree once, each in a fresh process that imports `flashsuite` from that
tree (a temporary folder with one link, `flashsuite -> TREE`, first on PYTHONPATH), and times
`dispatch.attention(..., version="fa3")` over the standard sweep's quick shapes (B·N = 16k,
Hq·D = 2048, N 2k and 8k or `--seqlen`'s, D 64 / 128 / 256, causal or not) in bf16 and in
fp8 (e4m3 inputs, no descales) with triton.testing.do_bench (median). Each tree's best pass
and the median of its passes are printed per shape, with the ratios of the last tree to the
first (decide from the medians: single passes move by several percent). Correctness is the
test suite's job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQLENS = (2048, 8192)


def _shapes() -> list[tuple]:
    """(dtype, head_dim, N, causal) of the quick sweep, at FWD_TREE_AB_SEQLENS' comma-separated
    lengths (SEQLENS when unset)."""
    lens = [int(n) for n in os.environ.get("FWD_TREE_AB_SEQLENS", "").split(",") if n]
    return [
        (dtype, d, n, causal)
        for dtype in ("bf16", "fp8")
        for d in (64, 128, 256)
        for n in lens or SEQLENS
        for causal in (False, True)
    ]


def _shape_id(shape: tuple) -> str:
    dtype, d, n, causal = shape
    return f"{dtype}-d{d}-n{n}-{'causal' if causal else 'full'}"


def _selected() -> list[tuple]:
    """_shapes() whose id (e.g. bf16-d128-n8192-causal) contains one of FWD_TREE_AB_MATCH's
    comma-separated parts; every shape when it is unset."""
    parts = [m for m in os.environ.get("FWD_TREE_AB_MATCH", "").split(",") if m]
    return [s for s in _shapes() if not parts or any(m in _shape_id(s) for m in parts)]


def _child() -> None:
    """Time every shape with the flashsuite on PYTHONPATH; one JSON line per shape."""
    import torch
    import triton

    import flashsuite
    from flashsuite.dispatch import attention

    print(f"flashsuite from {list(flashsuite.__path__)}", flush=True)
    rest_s = float(os.environ.get("FWD_TREE_AB_REST_S", "0"))

    for dtype, d, n, causal in _selected():
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        if dtype == "fp8":
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        try:

            def fn(q=q, k=k, v=v, c=causal):
                return attention(q, k, v, causal=c, version="fa3")

            fn()  # compiled or loaded here, outside the timing
            torch.cuda.synchronize()
            time.sleep(rest_s)
            ms = triton.testing.do_bench(fn)
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            row = {"shape": [dtype, d, n, causal], "tflops": flops / ms / 1e9}
            if os.environ.get("FWD_TREE_AB_KERNELS") == "1":
                try:
                    row["kernels_us"] = kernel_us(fn)
                except Exception as exc:  # the profiler's failure costs only its column
                    row["kernels_us"] = {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # a failing shape is recorded and the next one runs
            row = {"shape": [dtype, d, n, causal], "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)


def kernel_us(fn, calls: int = 10) -> dict[str, float]:
    """GPU time per call of each kernel `fn` launches (torch.profiler), by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            out[e.key[:60]] = round(us / calls, 1)
    return out


def _run_tree(tree: Path, link_dir: Path, extra_env: dict[str, str]) -> dict[tuple, float]:
    env = {**os.environ, **extra_env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(link_dir), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", "from benchmarks.fwd_tree_ab import _child; _child()"],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("flashsuite from"):
            print(f"  {line}", flush=True)
        if line.startswith("{"):
            row = json.loads(line)
            rows[tuple(row["shape"])] = row.get("tflops", float("nan"))
            if "kernels_us" in row:
                print(f"  {row['shape']}: kernels (us per call) {row['kernels_us']}", flush=True)
            if "error" in row:
                print(f"  {tree}: {row['shape']}: {row['error']}", flush=True)
    if proc.returncode:
        print(f"  {tree}: exit {proc.returncode}: {proc.stderr[-2000:]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH (repeat)")
    ap.add_argument(
        "--tree-env",
        action="append",
        default=[],
        help="NAME=VAR=VALUE: set VAR in that tree's processes (repeat)",
    )
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument(
        "--seqlen", type=int, action="append", default=[], help="N (repeat; 2k and 8k unset)"
    )
    ap.add_argument(
        "--match",
        action="append",
        default=[],
        help="only the shapes whose id contains this (e.g. bf16-d128-n8192-causal; repeat)",
    )
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="also print each shape's kernels and their GPU time per call (torch.profiler)",
    )
    ap.add_argument(
        "--rest",
        type=float,
        default=0.0,
        help="seconds the GPU idles before each shape's timing, after its first call (a tree "
        "that compiles there idles the GPU for seconds, one that loads from disk does not, and "
        "a GPU that idled timed up to 14 %% faster at some shapes: docs/results.md)",
    )
    ap.add_argument("--json", default=None, help="write every pass's numbers here")
    args = ap.parse_args(argv)
    trees = []
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "fa3").is_dir():
            ap.error(f"--tree: expected NAME=PATH to a flashsuite source tree, got {spec!r}")
        trees.append((name, Path(path).resolve()))
    envs: dict[str, dict[str, str]] = {name: {} for name, _ in trees}
    for spec in args.tree_env:
        name, _, assignment = spec.partition("=")
        var, sep, value = assignment.partition("=")
        if name not in envs or not sep or not var:
            ap.error(f"--tree-env: expected NAME=VAR=VALUE with NAME a --tree, got {spec!r}")
        envs[name][var] = value
    if args.passes < 1:
        ap.error(f"--passes: expected >= 1, got {args.passes}")
    links = {}
    for name, path in trees:
        links[name] = Path(tempfile.mkdtemp(prefix=f"tree-{name}-"))
        (links[name] / "flashsuite").symlink_to(path)
    if args.kernels:
        for env in envs.values():
            env["FWD_TREE_AB_KERNELS"] = "1"
    if args.match:
        os.environ["FWD_TREE_AB_MATCH"] = ",".join(args.match)
    if bad := [n for n in args.seqlen if n < 1 or 16384 % n]:
        ap.error(f"--seqlen: expected divisors of 16384 (B·N = 16k), got {bad}")
    if args.seqlen:
        os.environ["FWD_TREE_AB_SEQLENS"] = ",".join(map(str, args.seqlen))
    if args.rest < 0:
        ap.error(f"--rest: expected >= 0 seconds, got {args.rest}")
    os.environ["FWD_TREE_AB_REST_S"] = str(args.rest)
    passes: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for i in range(args.passes):
        for name, path in trees:
            passes[name].append(_run_tree(path, links[name], envs[name]))
            print(f"pass {i} {name}: {len(passes[name][-1])} shapes", flush=True)
    if args.json:
        out = {
            n: [{" ".join(map(str, k)): v for k, v in p.items()} for p in ps]
            for n, ps in passes.items()
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    first, last = trees[0][0], trees[-1][0]
    print(f"forward TFLOP/s over {args.passes} passes, best and median; ratios {last} / {first}")
    for shape in _selected():
        best, mid = {}, {}
        for n, ps in passes.items():
            got = [p[shape] for p in ps if p.get(shape) == p.get(shape) and shape in p]
            best[n] = max(got, default=float("nan"))
            mid[n] = statistics.median(got) if got else float("nan")
        cols = " ".join(f"{n} {best[n]:6.1f} / {mid[n]:6.1f}" for n in best)
        mask = "causal" if shape[3] else "full  "
        ratios = f"{best[last] / best[first]:.3f} / {mid[last] / mid[first]:.3f}"
        print(f"{shape[0]} D {shape[1]:>3} N {shape[2]:>5} {mask}: {cols}  ratios {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
