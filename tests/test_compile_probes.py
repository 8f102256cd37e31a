"""Every shipped Triton config compiles for sm_90a without register spills (no GPU needed).

The probes compile with the real Triton backend (ptxas from the triton wheel), so they run in
a subprocess without TRITON_INTERPRET, which conftest sets for the CPU test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/ imports from the repository root


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_fa2_table_compiles_without_spills() -> None:
    res = _run("benchmarks.fa2_tune", "--probe", "--fp32")
    lines = [line for line in res.stdout.splitlines() if " D" in line]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert len(lines) >= 48 and all(" ok " in line for line in lines), res.stdout[-3000:]


def test_fa1_table_compiles_without_spills() -> None:
    res = _run("benchmarks.fa1_probe", "--ci", "90")  # fp16 at D = 64 and where it differs
    rows = [line for line in res.stdout.splitlines() if "regs" in line]
    assert res.returncode == 0, res.stderr[-2000:]
    assert rows, res.stdout[-2000:]
    # 16-bit pointer-path entries must not spill at all. fp32 runs on FMA with 16- and 32-row
    # tiles; its causal backward is known to spill 20-24 B in three entries (compile probe):
    # pin that so it cannot grow unnoticed. The sm90 TMA entries (compiled as a launch compiles
    # them) spill by the stack frames pinned in configs.TMA_STACK_BYTES.
    from flashsuite.fa1.configs import TMA_STACK_BYTES, padded_head_dim

    tma = [row for row in rows if " tma" in row]
    assert tma, res.stdout[-2000:]
    for row in tma:
        d = int(row.split("D=")[1].split()[0])
        causal = "causal=1" in row
        stack = int(row.split("stack ")[1].split()[0])
        assert stack <= TMA_STACK_BYTES[(padded_head_dim(d), causal)], row
    spilling = [
        row
        for row in rows
        if " fp32 " not in row and " tma" not in row and "spill 0/0 B" not in row
    ]
    assert not spilling, "\n".join(spilling)
    fp32 = [row for row in rows if " fp32 " in row]
    worst = max(int(row.split("spill ")[1].split("/")[0]) for row in fp32) if fp32 else 0
    assert worst <= 32, "\n".join(fp32)
