"""Warm start of fa3: a fresh process's first call, with an empty and then a filled disk cache.

    python -m benchmarks.warm_start                  # GPU: bf16 D = 128 forward via dispatch
    python -m benchmarks.warm_start --backward       # and fa3's own backward (D = 64 / 128)
    python -m benchmarks.warm_start --fp8            # and the e4m3 forward
    python -m benchmarks.warm_start --cpu            # no GPU: the binaries only, for sm_90a

Two child processes (`--child`) share one cache folder (a new temporary one unless
`--cache-dir`): the first finds it empty and compiles, the second loads. On the GPU each child
times its first call of every step (forward; forward + backward; fp8 forward), synchronised
wall time, and then the same call once warm (median of 20): "first - warm" is what a new
process pays beyond the host path and the kernel; the goal for a warm cache is <= 0.2 s. With
`--cpu` a child fetches each step's binary from fa3's compile cache (`get_forward`, ...),
counts the compiles and calls the binary once with CPU tensors: the DSL's argument check
answers with the binary's full signature before anything touches a device. Each child also
says whether it imported the CuTe DSL (`cutlass`), which a warm 16-bit step never needs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("fwd", "bwd", "fp8")


def _signature_error(fn, args: tuple) -> str:
    """What the binary answers to CPU tensors: the argument check's message (names every
    parameter with its dtype and symbolic shape); "ran" would mean it launched."""
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ran"


def _cpu_step(step: str, head_dim: int, causal: bool) -> dict:
    """Fetch one step's binary through fa3's compile cache; count compiles; probe it."""
    import torch

    from flashsuite.fa3 import compile as fa3_compile

    bf16 = torch.bfloat16
    q = torch.zeros(1, 128, 1, head_dim, dtype=bf16)  # (B, N, H, D)
    lse = torch.zeros(1, 1, 128)  # (B, H, N)
    built = []

    def counting(build):
        def wrapped(key, *args):
            compiled = build(key, *args)
            built.append(compiled)
            return compiled

        return wrapped

    if step == "fwd":
        from flashsuite.fa3.configs import get_config

        mod, name, getter = fa3_compile, "compile_forward", fa3_compile.get_forward
        key = fa3_compile.CompileKey(
            bf16, head_dim, causal, False, False, get_config(head_dim, bf16, causal)
        )
        args = (q, q, q, q.clone(), lse, *(None,) * 5, 1.0, 1.0, 0, 0, 1)  # no descales/cu_seqlens
    elif step == "bwd":
        from flashsuite.fa3 import bwd_host
        from flashsuite.fa3.bwd_configs import bwd_config_for

        mod, name, getter = bwd_host, "compile_backward", bwd_host.get_backward
        key = bwd_host.BwdCompileKey(bf16, head_dim, causal, bwd_config_for(head_dim, bf16, causal))
        acc = torch.zeros(1, 128, 1, head_dim)
        tensors = (q, q, q, q, lse, lse, acc, q.clone(), q.clone())
        args = bwd_host.launch_args(key, tensors, 1.0, 0.0, (-1, -1), 128, 128)
    else:
        from flashsuite.fa3.configs import FP8_DTYPE, get_config

        mod, name, getter = fa3_compile, "compile_forward", fa3_compile.get_forward
        key = fa3_compile.CompileKey(
            FP8_DTYPE, head_dim, causal, False, False, get_config(head_dim, FP8_DTYPE, causal)
        )
        q8 = torch.zeros(1, 128, 1, head_dim, dtype=FP8_DTYPE)
        vt = torch.zeros(1, 1, head_dim, 128, dtype=FP8_DTYPE)  # (B, Hkv, D, Nk)
        ds = torch.ones(1, 1)
        args = (q8, q8, vt, q.clone(), lse, ds, ds, ds, None, None, 1.0, 1.0, 0, 0, 1)
    original = getattr(mod, name)
    setattr(mod, name, counting(original))
    try:
        t0 = time.perf_counter()
        fn = getter(key)
        seconds = time.perf_counter() - t0
    finally:
        setattr(mod, name, original)
    row = {"step": step, "seconds": seconds, "compiles": len(built)}
    row["signature"] = _signature_error(fn, args)
    if built:  # the DSL's own object, as compiled (the cache hands back the stored binary)
        row["compiled_signature"] = _signature_error(built[0], args)
    return row


def _gpu_step(step: str, head_dim: int, causal: bool) -> dict:
    """Time the first call of one step through dispatch on the GPU, then the warm call."""
    import torch

    from flashsuite import dispatch
    from flashsuite.common.fp8 import quantize_e4m3

    dev, shape = "cuda", (2, 1024, 8, head_dim)  # (B, N, H, D)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(shape, device=dev, generator=gen, dtype=torch.bfloat16) for _ in "qkv")
    if step == "fp8":
        (q8, dq), (k8, dk), (v8, dv) = (quantize_e4m3(t) for t in (q, k, v))

        def call():
            return dispatch.attention(
                q8,
                k8,
                v8,
                causal=causal,
                descale_q=dq,
                descale_k=dk,
                descale_v=dv,
                version="fa3",
            )
    elif step == "bwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def call():
            dispatch.attention(q, k, v, causal=causal, version="fa3").sum().backward()
    else:

        def call():
            with torch.no_grad():
                return dispatch.attention(q, k, v, causal=causal, version="fa3")

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    warm = []
    for _ in range(20):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        warm.append(time.perf_counter() - t0)
    warm_s = sorted(warm)[len(warm) // 2]
    return {"step": step, "seconds": first, "warm_call_s": warm_s, "beyond_s": first - warm_s}


def child(args: argparse.Namespace) -> dict:
    """One fresh process: every requested step's first call, in order."""
    t0 = time.perf_counter()
    import torch  # noqa: F401

    if not args.cpu:  # the GPU steps go through dispatch; its import is not the first call's
        from flashsuite import dispatch  # noqa: F401

    report = {"import_s": time.perf_counter() - t0, "steps": []}
    run = _cpu_step if args.cpu else _gpu_step
    for step in args.steps:
        report["steps"].append(run(step, args.head_dim, args.causal))
        report["steps"][-1]["dsl_imported"] = "cutlass" in sys.modules
    report["entry_kinds"] = entry_kinds()
    return report


def entry_kinds() -> dict[str, int]:
    """How many entries of each kind the cache holds: "so" (shared libraries, loaded without
    the DSL) or "o" (object files, loaded through the DSL: no C compiler driver was found)."""
    from flashsuite.fa3 import disk_cache

    kinds: dict[str, int] = {}
    root = disk_cache.cache_root()
    for path in root.glob("*/*.bin") if root else ():
        kind = disk_cache.stored_header(path)["kind"]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def run_child(cache_dir: str, args: argparse.Namespace, env: dict | None = None) -> dict:
    """`child` in a new interpreter with FLASHSUITE_CACHE_DIR=cache_dir; its report."""
    env = dict(os.environ if env is None else env, FLASHSUITE_CACHE_DIR=cache_dir)
    if args.cpu:
        env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if "bwd" in args.steps:
        env["FLASHSUITE_FA3_BWD"] = "1"
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "benchmarks.warm_start", "--child", "--json", out.name]
        cmd += ["--steps", ",".join(args.steps), "--head-dim", str(args.head_dim)]
        cmd += ["--cpu"] * args.cpu + ["--causal"] * args.causal
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(Path(out.name).read_text())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="no GPU: fetch the binaries only")
    ap.add_argument("--backward", action="store_true", help="also fa3's own backward")
    ap.add_argument("--fp8", action="store_true", help="also the e4m3 forward")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--cache-dir", help="the cache folder (default: a new temporary one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the reports here")
    args = ap.parse_args(argv)
    if args.steps:
        args.steps = args.steps.split(",")
    else:
        args.steps = ["fwd"] + ["bwd"] * args.backward + ["fp8"] * args.fp8
    if bad := [s for s in args.steps if s not in STEPS]:
        ap.error(f"--steps: expected names from {STEPS}, got {bad}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        Path(args.json).write_text(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory(prefix="flashsuite-warm-") as tmp:
        cache_dir = args.cache_dir or tmp
        reports = {"cold": run_child(cache_dir, args), "warm": run_child(cache_dir, args)}
    where = "CPU, binaries for sm_90a" if args.cpu else "GPU, first call through dispatch"
    print(f"fa3 warm start ({where}), D = {args.head_dim}, causal = {args.causal}")
    print(f"{'process':<8}{'step':<6}{'first s':>10}{'warm s':>10}{'beyond s':>10}  notes")
    for name, rep in reports.items():
        for row in rep["steps"]:
            notes = [f"DSL imported: {row['dsl_imported']}"]
            if "compiles" in row:
                notes.append(f"compiles: {row['compiles']}")
            warm = row.get("warm_call_s", float("nan"))
            beyond = row.get("beyond_s", float("nan"))
            print(
                f"{name:<8}{row['step']:<6}{row['seconds']:>10.3f}{warm:>10.4f}{beyond:>10.3f}"
                f"  {', '.join(notes)}"
            )
    print(f"entries: {reports['warm']['entry_kinds']} (so: loaded without the DSL)")
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
