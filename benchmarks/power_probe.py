"""Clock and power of the GPU while each contender runs back to back (a GPU run).

    python3 -m benchmarks.power_probe --head-dim 128 --seqlen 1024 --seqlen 16384 \
        --variant p2m:persistent=1,overlap_tiles=1,balanced_order=1,o_alias_q=0,q_stages=2

A timing ratio between two kernels is a ratio of cycles only if both ran at the same clock.
An H100 or H200 that reaches its power limit lowers its SM clock under load, by more for a
kernel that draws more power, so a kernel with fewer cycles can still take longer. For each
contender ("fa3": the shipped path; the peers sdpa-cudnn and fa4; fa3_fwd_ab-style variants
of the shipped config) and shape (the standard sweep's B·N = 16k, Hq·D = 2048, bf16), this runs
the forward back to back for --seconds while `nvidia-smi` samples the SM clock, the board
power, the temperature and the active throttle reasons every 50 ms, in --rounds interleaved
rounds, and prints per contender the TFLOP/s of the run, the mean clock and power over the
samples inside it, TFLOP/s per GHz (work per cycle) and TFLOP/s per 100 W (work per joule).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import threading
import time

QUERY = (
    "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.sw_power_cap,"
    "clocks_throttle_reasons.hw_slowdown,clocks_throttle_reasons.sw_thermal_slowdown"
)


class Sampler:
    """`nvidia-smi` in a subprocess, one line every 50 ms, each kept with its arrival time."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, list[str]]] = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.rows.append((time.perf_counter(), [x.strip() for x in line.split(",")]))

    def between(self, t0: float, t1: float) -> list[list[str]]:
        return [r for t, r in self.rows if t0 <= t <= t1]

    def close(self) -> None:
        self.proc.terminate()


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.fa3_fwd_ab import parse_sweep
    from flashsuite.common.testing import Case, make_inputs
    from flashsuite.common.validation import check_inputs
    from flashsuite.dispatch.bench import prepare
    from flashsuite.fa3 import interface as fa3
    from flashsuite.fa3.configs import config_for

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE,... (repeat)")
    ap.add_argument("--peer", action="append", default=None, help="default: fa3, sdpa-cudnn, fa4")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, action="append", default=[], help="N (repeat)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    seqlens, variants = parse_sweep(ap, args, [1024, 16384])
    d, heads = args.head_dim, 2048 // args.head_dim
    limit = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,power.limit,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(f"GPU: {limit}", flush=True)
    fns = {}
    for n in seqlens:
        case = Case(16384 // n, n, n, heads, heads, d, dtype=torch.bfloat16, causal=args.causal)
        for peer in args.peer or ["fa3", "sdpa-cudnn", "fa4"]:
            try:
                fns[peer, n] = prepare(peer, case)
            except Exception as exc:  # FA4 not installed, a backend refusing the shape
                print(f"{peer}: not run ({type(exc).__name__}: {exc})"[:200], flush=True)
        q, k, v = make_inputs(case, "cuda")
        p = check_inputs(q, k, v, causal=args.causal)
        for name, changes in variants:
            cfg = dataclasses.replace(config_for(p), **changes)
            fns[name, n] = lambda q=q, k=k, v=v, p=p, cfg=cfg: fa3.forward(q, k, v, p, cfg=cfg)
    results: dict = {key: [] for key in fns}
    sampler = Sampler()
    try:
        for _ in range(args.rounds):
            for (name, n), fn in fns.items():
                flops = 4 * (16384 // n) * heads * n * n * d / (2 if args.causal else 1)
                with torch.no_grad():
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    calls, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < args.seconds:
                        for _ in range(10):
                            fn()
                        calls += 10
                        torch.cuda.synchronize()
                    t1 = time.perf_counter()
                rows = sampler.between(t0 + 0.25 * (t1 - t0), t1)  # past the ramp
                clocks = [_num(r[0]) for r in rows]
                power = [_num(r[1]) for r in rows]
                capped = sum(r[3] == "Active" for r in rows)
                results[name, n].append(
                    {
                        "tflops": flops * calls / (t1 - t0) / 1e12,
                        "mhz": statistics.fmean(clocks) if clocks else float("nan"),
                        "watts": statistics.fmean(power) if power else float("nan"),
                        "temp": _num(rows[-1][2]) if rows else float("nan"),
                        "power_capped": f"{capped}/{len(rows)}",
                    }
                )
    finally:
        sampler.close()
    print(f"D {d}, {'causal' if args.causal else 'non-causal'}, bf16, B*N = 16k, Hq*D = 2048")
    for (name, n), runs in results.items():
        for r in runs:
            per_ghz = r["tflops"] / (r["mhz"] / 1e3)
            per_100w = r["tflops"] / r["watts"] * 100
            print(
                f"{name:>12} N {n:5d}: {r['tflops']:6.1f} TFLOP/s at {r['mhz']:6.0f} MHz, "
                f"{r['watts']:5.0f} W, {r['temp']:.0f} C, power cap {r['power_capped']}; "
                f"{per_ghz:6.1f} TFLOP/s per GHz, {per_100w:6.1f} per 100 W",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
