"""The main job: `flashsuite` (or `python -m flashsuite.dispatch`).

    flashsuite                 machine, versions, what dispatch picks, correctness vs the oracle,
                               and on a GPU a short timing table next to PyTorch SDPA
    flashsuite bench [--out D] the standard sweep (forward and backward) with a progress bar:
                               bench.json, bench.md (table) and bench-fwd.png / bench-bwd.png
                               (TFLOP/s vs N per version and peer) in D
    flashsuite --version       flashsuite's version and the torch / triton / CuTe DSL it sees

Useful on a CPU-only machine too: there it checks the portable version (and the Triton
versions under TRITON_INTERPRET=1) and says why the GPU versions are unavailable.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from flashsuite.common import arch as arch_mod
from flashsuite.common.testing import Case, compare, make_inputs, reference_pair
from flashsuite.dispatch import api, registry
from flashsuite.dispatch.bench import FA4, MODEL_DIM, PEERS, TOKENS

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _pkg_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def print_machine() -> None:
    print("== machine")
    cute = _pkg_version("nvidia-cutlass-dsl")
    print(f"  python {platform.python_version()}, torch {torch.__version__}")
    print(f"  triton {_pkg_version('triton')}, nvidia-cutlass-dsl {cute}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        arch = arch_mod.arch_name(arch_mod.real_arch(0))
        gib = props.total_memory / 2**30
        print(f"  device: {props.name}, {props.multi_processor_count} SMs, {gib:.0f} GiB, {arch}")
    else:
        print("  device: cpu (no CUDA GPU visible to torch)")
    if arch_mod.is_overridden():
        planned = arch_mod.arch_name(arch_mod.device_arch())
        print(f"  arch override in force: dispatch plans for {planned}")
    if arch_mod.triton_interpreter():
        print("  TRITON_INTERPRET=1: Triton kernels run on the CPU interpreter (slow; for tests)")


def print_versions() -> None:
    print("== versions")
    for name in registry.VERSIONS:
        ok, reason = registry.available(name)
        print(f"  {name:6s} {'available  ' if ok else 'unavailable'} {reason}")


def _case(b: int, nq: int, nk: int, hq: int, hkv: int, d: int, dtype, **options) -> Case:
    return Case(
        batch=b,
        seqlen_q=nq,
        seqlen_k=nk,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        dtype=dtype,
        **options,
    )


def typical_cases() -> list[Case]:
    """Shapes a user would ask about; the picks are printed for each."""
    return [
        _case(4, 4096, 4096, 16, 16, 128, BF16, causal=True),  # LLM prefill
        _case(8, 2048, 2048, 32, 8, 64, F16),  # GQA
        _case(1, 1, 8192, 32, 8, 128, BF16, causal=True),  # decode step
        _case(2, 8192, 8192, 8, 8, 256, BF16, window_size=(1024, 0)),  # sliding window
        _case(2, 1024, 1024, 8, 8, 96, F32),
        _case(2, 1024, 1024, 8, 8, 80, BF16, softcap=30.0),  # an odd head_dim
    ]


def print_picks(arch: int | None, note: str = "") -> None:
    print(f"== what dispatch picks on {arch_mod.arch_name(arch)}{note}")
    for case in typical_cases():
        q, k, v = (torch.empty(s, dtype=case.dtype, device="meta") for s in _shapes(case))
        # Meta tensors (no memory, no device behind them): plan for the given architecture.
        with arch_mod.override_arch(arch):
            choice = api.select(q, k, v, **case.options())
        why = choice.reasons[-1].split(" - ", 1)[-1]
        print(f"  {choice.params.describe():58s} -> {choice.version:5s} ({why})")


def _shapes(case: Case):
    return (
        (case.batch, case.seqlen_q, case.heads_q, case.head_dim),
        (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
        (case.batch, case.seqlen_k, case.heads_kv, case.dv),
    )


def check_cases(device: str) -> list[Case]:
    n = 1024 if device == "cuda" else 128
    return [
        _case(2, n, n, 4, 4, 128, BF16, causal=True),
        _case(2, n + 17, n - 5, 8, 2, 64, F16),
        _case(1, n // 2, n, 4, 1, 256, BF16, causal=True),
    ]


def run_checks(device: str) -> bool:
    print("== check against the oracle (forward out and LSE; bound = 2x PyTorch's own error)")
    all_ok = True
    for case in check_cases(device):
        q, k, v = make_inputs(case, device)
        ref = None
        for name in registry.available_versions():
            label = f"  {name:6s} {case.id:44s}"
            try:
                api.select(q, k, v, version=name, **case.options())
            except api.Unsupported as exc:
                print(f"{label} skipped: {str(exc).rsplit(': ', 1)[-1]}")
                continue
            ref = ref or reference_pair(q, k, v, **case.options())
            try:
                out, lse = api.attention(q, k, v, **case.options(), return_lse=True, version=name)
            except Exception as exc:  # report and go on: the other versions still get checked
                all_ok = False
                print(f"{label} ERROR {type(exc).__name__}: {str(exc).splitlines()[-1][:120]}")
                continue
            c_out = compare("out", out, *ref["out"])
            c_lse = compare("lse", lse, *ref["lse"], dtype=F32)
            ok = c_out.ok and c_lse.ok
            all_ok &= ok
            print(
                f"{label} max|out-ref| {c_out.err:.2e} (bound {c_out.bound:.2e})  "
                f"max|lse-ref| {c_lse.err:.2e}  {'PASS' if ok else 'FAIL'}"
            )
    return all_ok


def print_timing() -> None:
    from flashsuite.dispatch.bench import measure, standard_sweep

    print("== timing (bf16, B·N = 16k, Hq·D = 2048, forward, TFLOP/s; median of CUDA-event runs)")
    contenders = [*registry.available_versions(kernels_only=True), "sdpa-flash", "sdpa-cudnn"]
    print("  " + f"{'shape':28s}" + "".join(f"{c:>12s}" for c in contenders))
    for case in standard_sweep(head_dims=(64, 128), seqlens=(4096,)):
        cells = []
        for c in contenders:
            r = measure(c, case, "fwd")
            cells.append(f"{r.tflops:12.0f}" if not r.error else f"{'n/a':>12s}")
        label = f"N={case.seqlen_q} D={case.head_dim}" + (" causal" if case.causal else "")
        print(f"  {label:28s}" + "".join(cells))


def cmd_check(args: argparse.Namespace) -> int:
    device = _device()
    if device == "cpu" and not args.no_interpreter:
        # No GPU: still run the Triton versions, on small shapes, through the CPU interpreter.
        # TRITON_INTERPRET must be set before triton is first imported (torch.library already
        # imports it), so start again with it set.
        if not arch_mod.triton_interpreter():
            os.environ["TRITON_INTERPRET"] = "1"
            os.execv(sys.executable, [sys.executable, "-m", "flashsuite.dispatch", *sys.argv[1:]])
        from flashsuite.common.testing import patch_triton_interpreter_bf16

        patch_triton_interpreter_bf16()
    print_machine()
    print_versions()
    arch = arch_mod.device_arch(device)
    print_picks(arch)
    if arch is None:
        print_picks(90, " (an H100/H200; shown for planning, FLASHSUITE_ARCH=sm90 does the same)")
    ok = run_checks(device)
    if device == "cuda" and not args.no_timing:
        print_timing()
    print(f"== {'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


class _Progress:
    """A tqdm bar when tqdm is installed (the `bench` extra), else one line per result; either
    way every result is printed as a line, so a log keeps them."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.time()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, unit="run", desc="flashsuite bench", dynamic_ncols=True)

    def step(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(line)
            self.bar.update(1)
            return
        bar = "#" * (30 * self.done // self.total)
        print(f"[{bar:30s}] {self.done}/{self.total} {time.time() - self.start:5.0f}s  {line}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_bench(args: argparse.Namespace) -> int:
    from flashsuite.dispatch.bench import available_peers, measure, standard_sweep
    from flashsuite.dispatch.report import render

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "flashsuite bench needs a CUDA GPU (timings on the CPU would mean nothing; "
            "--device cpu runs the sweep's machinery there anyway)"
        )
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.versions:
        versions = args.versions
    elif args.device == "cpu":
        versions = ["torch"]
    else:
        versions = registry.available_versions(kernels_only=True)
    if args.peers is not None:
        peers = args.peers
    else:
        peers = available_peers(args.device)
    contenders = versions + peers
    seqlens = args.seqlens or ((2048, 8192) if args.quick else (512, 1024, 2048, 4096, 8192, 16384))
    try:
        cases = standard_sweep(
            head_dims=args.head_dims, seqlens=seqlens, tokens=args.tokens, model_dim=args.model_dim
        )
    except ValueError as exc:
        print(f"flashsuite bench: {exc}")
        return 2
    # The long sequences (the headline numbers) first, should the run be cut short.
    cases.sort(key=lambda c: (c.seqlen_q < 2048, -c.seqlen_q, c.head_dim, c.causal))
    directions = ["fwd"] if args.fwd_only else ["fwd", "bwd"]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({platform.machine()})"
    meta = dict(
        gpu=gpu,
        torch=torch.__version__,
        triton=_pkg_version("triton"),
        date=time.strftime("%Y-%m-%d"),
        commit=os.environ.get("FLASHSUITE_COMMIT", "unknown"),
    )
    results = []
    progress = _Progress(len(cases) * len(contenders) * len(directions))
    for case in cases:
        for direction in directions:
            for c in contenders:
                r = measure(c, case, direction, device=args.device)
                results.append(r.as_dict())
                status = f"{r.ms:9.3f} ms {r.tflops:7.4g} TFLOP/s"
                status = f"error: {r.error[:60]}" if r.error else status
                causal = "causal " if case.causal else ""
                progress.step(
                    f"{c} {direction} N={case.seqlen_q} D={case.head_dim} {causal}{status}"
                )
        # Written after every shape, so a run cut short still leaves what it measured.
        (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "results": results}))
    progress.close()
    print(render(results, meta, out_dir))
    return 0


def version_line() -> str:
    """`flashsuite --version`: the package and what it runs on."""
    deps = ", ".join(
        f"{name} {_pkg_version(name)}" for name in ("torch", "triton", "nvidia-cutlass-dsl")
    )
    return f"flashsuite {_pkg_version('flashsuite')} ({deps})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashsuite", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check", help="the default: machine, versions, picks, oracle checks")
    check.add_argument("--no-timing", action="store_true", help="skip the GPU timing table")
    check.add_argument(
        "--no-interpreter", action="store_true", help="on a CPU, do not run Triton kernels"
    )
    bench = sub.add_parser("bench", help="the standard benchmark sweep (GPU)")
    bench.add_argument("--out", default="bench-results", help="folder for bench.json and plots")
    bench.add_argument("--quick", action="store_true", help="N in {2k, 8k} only")
    bench.add_argument("--seqlens", type=int, nargs="+", default=None, help="N values to run")
    bench.add_argument("--fwd-only", action="store_true")
    bench.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    bench.add_argument("--tokens", type=int, default=TOKENS, help="B·N (default %(default)s)")
    bench.add_argument("--model-dim", type=int, default=MODEL_DIM, help="Hq·D (%(default)s)")
    bench.add_argument("--versions", nargs="+", default=None, choices=registry.VERSIONS)
    bench.add_argument(
        "--peers",
        nargs="*",
        default=None,
        choices=sorted({*PEERS, "sdpa-math", FA4}),
        help="peers timed beside: SDPA backends and fa4 (default: SDPA's but math, and fa4 "
        "where flash-attn-4 imports; on --device cpu: sdpa-math)",
    )
    bench.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: wall-clock timing of the portable version, to check the machinery",
    )
    args = parser.parse_args(argv)
    if args.command == "bench":
        return cmd_bench(args)
    if args.command is None:
        args.no_timing = args.no_interpreter = False
    return cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
