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


def _sample_column(header: list[str]) -> int | None:
    """The column of all warp-state samples in a source-page header (ncu names it "Warp Stall
    Sampling (All Samples)"; older versions "Sampling Data (All)")."""
    for i, name in enumerate(header):
        low = name.lower()
        if "sampl" in low and "all" in low and "not" not in low:
            return i
    return None


def source_blocks(text: str) -> list[dict]:
    """ncu's `--page source --csv --print-source sass` output -> one block per kernel:
    {"title": the kernel's name (a `"Kernel Name","..."` CSV line, or the non-CSV lines
    before the block), "rows": [(address, sass text, samples, stalls)]}, stalls the samples
    by reason ({"barrier": n, ...} from the "stall_*" columns other than the not-issued ones;
    empty where the page has none). A block starts at each CSV header with an address, a
    source and a sample column."""
    blocks: list[dict] = []
    title: list[str] = []
    cur = None
    for line in text.splitlines():
        if not line.startswith('"'):
            if line.strip():
                title.append(line.strip())
            continue
        (fields,) = list(csv.reader([line]))
        if fields[0] == "Kernel Name" and len(fields) > 1:
            title = [fields[1]]
            continue
        low = [f.lower() for f in fields]
        is_header = any("address" in f for f in low) and any(f == "source" for f in low)
        if is_header:
            col = _sample_column(fields)
            addr = next(i for i, f in enumerate(low) if "address" in f)
            cur = {"title": " | ".join(title[-3:]), "rows": [], "cols": (addr, low.index("source"))}
            cur["sample_col"] = col
            cur["stall_cols"] = {
                f.removeprefix("stall_"): i
                for i, f in enumerate(low)
                if f.startswith("stall_") and "not issued" not in f
            }
            blocks.append(cur)
            title = []
            continue
        if cur is None or cur["sample_col"] is None:
            continue
        a, src = cur["cols"]
        try:
            samples = float(fields[cur["sample_col"]].replace(",", "") or 0)
        except (IndexError, ValueError):
            continue
        stalls = {}
        for reason, i in cur["stall_cols"].items():
            try:
                stalls[reason] = float(fields[i].replace(",", "") or 0)
            except (IndexError, ValueError):
                continue
        cur["rows"].append((fields[a], fields[src].strip(), samples, stalls))
    return blocks


def _opcode(sass: str) -> str:
    """The opcode of a SASS line without predicate and modifiers' operands (HGMMA.64x128x16...
    -> HGMMA, @!P0 BRA -> BRA)."""
    parts = sass.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else "?"


def source_summary(text: str, kernels: int = 4, top: int = 30) -> str:
    """The `kernels` blocks with the most samples: per opcode, per stall reason (where the page
    has the reasons) and the `top` instructions, each with its share of the kernel's samples
    and its two largest reasons."""
    blocks = sorted(source_blocks(text), key=lambda b: -sum(r[2] for r in b["rows"]))
    if not blocks:
        return "no source page with warp-state samples found\n"
    lines = []
    for b in blocks[:kernels]:
        total = sum(r[2] for r in b["rows"]) or 1.0
        lines.append(f"== {b['title'][:160]}: {len(b['rows'])} instructions, {total:.0f} samples")
        per_op: dict[str, float] = {}
        per_reason: dict[str, float] = {}
        for _, sass, n, stalls in b["rows"]:
            per_op[_opcode(sass)] = per_op.get(_opcode(sass), 0.0) + n
            for reason, k in stalls.items():
                per_reason[reason] = per_reason.get(reason, 0.0) + k
        ops = sorted(per_op.items(), key=lambda kv: -kv[1])[:15]
        lines.append("  by opcode: " + ", ".join(f"{op} {n / total:.1%}" for op, n in ops))
        reasons = sorted(((r, k) for r, k in per_reason.items() if k), key=lambda kv: -kv[1])
        if reasons:
            shares = ", ".join(f"{r} {k / total:.1%}" for r, k in reasons[:10])
            lines.append("  by stall: " + shares)
        for addr, sass, n, stalls in sorted(b["rows"], key=lambda r: -r[2])[:top]:
            why = sorted(((r, k) for r, k in stalls.items() if k), key=lambda kv: -kv[1])[:2]
            why_text = f"  [{', '.join(f'{r} {k:.0f}' for r, k in why)}]" if why else ""
            lines.append(f"  {addr:>8} {n / total:6.1%}  {sass[:90]}{why_text}")
    return "\n".join(lines) + "\n"
