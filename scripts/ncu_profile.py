"""Nsight Compute sections of one forward (or backward) per (contender, shape), side by side.

For questions a timing table cannot answer (why fa3 trails cuDNN at N = 512): on a GPU host,

    python scripts/ncu_profile.py --out DIR --shape 128:0:512 --shape 128:0:16384 \\
        --contender fa3 --contender sdpa-cudnn

    python scripts/ncu_profile.py --out DIR --direction bwd --shape 64:1:1024 \\
        --contender fa3 --contender sdpa-cudnn --contender fa4

Shapes are D:causal:N of the standard sweep (B·N = 16k tokens, Hq·D = 2048, bf16); peers are
SDPA backends and fa4 (dispatch.bench). `--direction bwd` profiles one backward (of a forward
made before the range: its kernels, pre/postprocess included). It runs
itself under `ncu --clock-control none` (the card's clocks are left alone) with the
SpeedOfLight, LaunchStats, Occupancy, WarpStateStats and SchedulerStats sections; each case is
one call inside the NVTX range "measure" after a warm-up call outside it, and a marker kernel
before it tells the cases apart. Writes DIR/ncu.json (every metric of every kernel, per case)
and prints the headline metrics of each case's longest kernel.

`--fa3-variant NAME:FIELD=VALUE,...` adds the contender "fa3-NAME": fa3's shipped config for
the shape with those Fa3Config fields replaced (benchmarks/fa3_fwd_ab's variant syntax), called
through fa3.interface.forward (the variant's oracle cases are fa3_fwd_ab's to run).

`--fp8` profiles fa3's e4m3 forward (the inputs cast to float8_e4m3fn, unit descales; fa3 and
its `--fa3-variant` builds only): its main kernel is the longest one.

`--source` also collects the SourceCounters section (warp-state samples per SASS instruction),
keeps the report (DIR/report.ncu-rep), writes its source page as DIR/source.csv and sums the
samples of each case's longest kernel per instruction and per opcode (DIR/source_summary.txt):
where in the loop the warps wait, not only why.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from flashsuite.common import ncu
from flashsuite.common.testing import make_inputs
from flashsuite.dispatch.bench import PEERS, make_callable, prepare, standard_sweep

SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "SchedulerStats")
HEADLINE = (
    "Duration",
    "Compute (SM) Throughput",
    "Memory Throughput",
    "Registers Per Thread",
    "Waves Per SM",
    "Achieved Occupancy",
    "Warp Cycles Per Issued Instruction",
    "Issued Warp Per Scheduler",
    "No Eligible",
)


def _case(spec: str):
    d, causal, n = (int(x) for x in spec.split(":"))
    (case,) = standard_sweep(head_dims=(d,), seqlens=(n,), causals=(bool(causal),))
    return case


def _variant_callable(changes: dict, q, k, v, case):
    """fa3's forward with the shipped config for `case` and `changes` applied."""
    import dataclasses

    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface as fa3
    from flashsuite.fa3.configs import config_for

    p = check_inputs(q, k, v, **case.options())
    cfg = dataclasses.replace(config_for(p), **changes)
    return lambda: fa3.forward(q, k, v, p, cfg=cfg)


def profile_child(
    contenders: list[str],
    shapes: list[str],
    direction: str = "fwd",
    variants: dict | None = None,
    fp8: bool = False,
) -> None:
    """Under ncu: per (contender, shape), one forward or backward in the profiled range
    (common/ncu.py). `variants`: fa3-NAME -> Fa3Config changes (forward only). `fp8`: e4m3
    inputs, fa3 and its variants only (fa3's shipped e4m3 config, Vᵀ made in the call)."""
    variants = variants or {}
    for spec in shapes:
        case = _case(spec)
        if direction == "bwd":
            for name in contenders:
                ncu.measure_once(prepare(name, case, "bwd", "cuda"))
                torch.cuda.empty_cache()
            continue
        q, k, v = make_inputs(case, "cuda")
        if fp8:
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        for name in contenders:
            if fp8:
                run = _variant_callable(variants.get(name, {}), q, k, v, case)
            elif name in variants:
                run = _variant_callable(variants[name], q, k, v, case)
            else:
                run, _ = make_callable(name, case, q, k, v)
            with torch.no_grad():
                ncu.measure_once(run)
        del q, k, v
        torch.cuda.empty_cache()


def _text(metric: tuple[str, str]) -> str:
    return f"{metric[0]} {metric[1]}".strip()


def _duration_us(kern: dict) -> float:
    scales = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    return ncu.value(kern["metrics"].get("Duration", ("0", "us")), scales)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for ncu.json")
    ap.add_argument("--shape", action="append", required=True, help="D:causal:N (repeatable)")
    ap.add_argument(
        "--contender", action="append", help=f"fa1/fa2/fa3, fa4 or one of {sorted(PEERS)}"
    )
    ap.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--section", action="append", default=[], help="another ncu section")
    ap.add_argument(
        "--metrics", default="",
        help="more metrics, ncu's --metrics syntax (e.g. 'regex:smsp__average_warps_issue_"
        "stalled_.*_per_issue_active.ratio' for the stall reasons per issued instruction)",
    )  # fmt: skip
    ap.add_argument(
        "--source", action="store_true",
        help="also warp-state samples per SASS instruction (SourceCounters; keeps the report)",
    )  # fmt: skip
    ap.add_argument(
        "--fa3-variant", action="append", default=[],
        help="NAME:FIELD=VALUE,...: the contender fa3-NAME (forward; fa3_fwd_ab's syntax)",
    )  # fmt: skip
    ap.add_argument(
        "--fp8", action="store_true",
        help="e4m3 inputs (forward; contenders fa3 and its --fa3-variant builds only)",
    )  # fmt: skip
    ap.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    contenders = args.contender or (["fa3"] if args.fp8 else ["fa3", "sdpa-cudnn"])
    if args.fp8 and (args.direction != "fwd" or set(contenders) - {"fa3"}):
        ap.error(f"--fp8: forward of fa3 and its variants only, got {contenders} {args.direction}")
    variants = {}
    if args.fa3_variant:
        if args.direction != "fwd":
            ap.error("--fa3-variant: forward only (--direction fwd)")
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.fa3_fwd_ab import parse_variant

        for spec in args.fa3_variant:
            try:
                name, changes = parse_variant(spec)
            except ValueError as exc:
                ap.error(str(exc))
            variants[f"fa3-{name}"] = changes
        contenders += [c for c in variants if c not in contenders]
    if args.profile_child:
        profile_child(contenders, args.shape, args.direction, variants, args.fp8)
        return 0
    exe = shutil.which("ncu")
    if exe is None:
        print("ncu not on PATH", file=sys.stderr)
        return 2
    sections = (*SECTIONS, *args.section, *(("SourceCounters",) if args.source else ()))
    cmd = ncu.command(exe, *(arg for s in sections for arg in ("--section", s)))
    if args.metrics:
        cmd += ["--metrics", args.metrics]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "report.ncu-rep"
    if args.source:
        cmd += ["--export", str(report_path), "--force-overwrite", "--import-source", "no"]
    cmd += [sys.executable, __file__, "--profile-child", "--out", args.out]
    cmd += ["--direction", args.direction, *(["--fp8"] if args.fp8 else [])]
    cmd += [arg for s in args.shape for arg in ("--shape", s)]
    cmd += [arg for c in contenders if c not in variants for arg in ("--contender", c)]
    cmd += [arg for spec in args.fa3_variant for arg in ("--fa3-variant", spec)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    stdout = res.stdout
    if args.source and res.returncode == 0 and not ncu.cases(stdout):
        # With --export ncu may print no metrics: read them back from the report.
        page = [exe, "--import", str(report_path), "--csv", "--page", "details"]
        stdout = subprocess.run(page, capture_output=True, text=True).stdout
    cases = ncu.cases(stdout)
    labels = [(s, c) for s in args.shape for c in contenders]
    if res.returncode != 0 or len(cases) != len(labels):
        print(f"ncu rc {res.returncode}, {len(cases)} cases for {len(labels)}:")
        print(res.stdout[-3000:], res.stderr[-3000:], sep="\n")
        return 1
    report = [
        {"shape": s, "contender": c, "kernels": ks}
        for (s, c), ks in zip(labels, cases, strict=True)
    ]
    (out / "ncu.json").write_text(json.dumps(report, indent=1))
    for r in report:
        if not r["kernels"]:
            print(f"== {r['contender']} D:causal:N={r['shape']}: no kernel profiled")
            continue
        main_kernel = max(r["kernels"], key=_duration_us)
        print(f"== {r['contender']} D:causal:N={r['shape']} ({len(r['kernels'])} kernels), "
              f"longest: {main_kernel['name'][:60]}")  # fmt: skip
        for name in HEADLINE:
            for metric, value in main_kernel["metrics"].items():
                if metric.startswith(name):
                    print(f"   {metric:45s} {_text(value)}")
    if args.source:
        page = [exe, "--import", str(report_path), "--csv", "--page", "source"]
        page += ["--print-source", "sass"]
        src = subprocess.run(page, capture_output=True, text=True)
        (out / "source.csv").write_text(src.stdout + src.stderr)
        summary = ncu.source_summary(src.stdout, kernels=2 * len(labels))
        (out / "source_summary.txt").write_text(summary)
        print(summary[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
