"""Nsight Compute plumbing shared by the GPU scripts (scripts/hbm_traffic.py, ncu_profile.py).

A script re-runs itself under `ncu` (`command`): each case is one call inside the NVTX range
"measure", after a warm-up call outside it (compiles, plan builds and autotuning are not
profiled), and a marker kernel launched first inside the range tells the cases apart in ncu's
CSV (`cases`). The card's clocks are left alone (`--clock-control none`).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable

import torch

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel


def command(ncu: str, *options: str) -> list[str]:
    """ncu's command line up to the profiled program: only the "measure" range, CSV output."""
    return [
        ncu,
        "--clock-control",
        "none",
        "--nvtx",
        "--nvtx-include",
        "measure",  # a start/end range (a push/pop one would be named "measure/")
        "--csv",
        *options,
    ]


def measure_once(run: Callable[[], object]) -> None:
    """In the profiled process: warm `run` up, then the marker and one call inside "measure"."""
    run()
    torch.cuda.synchronize()
    # A start/end range, not push/pop: push/pop ranges belong to the thread that opened them,
    # and a backward's kernels are launched from autograd's device thread.
    rid = torch.cuda.nvtx.range_start("measure")
    torch.cuda._sleep(1)
    run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_end(rid)


def cases(stdout: str) -> list[list[dict]]:
    """ncu's CSV -> per case (in launch order, split at each marker kernel), its kernels as
    {"name": ..., "metrics": {metric name: (value text, unit)}}. Kernels before the first
    marker are dropped."""
    rows = [line for line in stdout.splitlines() if line.startswith('"')]
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        kern = kernels.setdefault(row["ID"], {"name": row["Kernel Name"], "metrics": {}})
        kern["metrics"][row["Metric Name"]] = (row["Metric Value"], row["Metric Unit"].strip())
    out: list[list[dict]] = []
    for kern in kernels.values():  # dicts keep ncu's launch order
        if MARKER in kern["name"]:
            out.append([])
        elif out:
            out[-1].append(kern)
    return out


def value(metric: tuple[str, str], scales: dict[str, float]) -> float:
    """A metric's number ("1,234.5" with its unit) in the unit `scales` maps to 1."""
    text, unit = metric
    return float(text.replace(",", "")) * scales.get(unit.lower(), 1.0)
