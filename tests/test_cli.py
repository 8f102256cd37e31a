"""The main job (`flashsuite`) and the benchmark report, as a user runs them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashsuite.dispatch import cli, report

ROOT = Path(__file__).resolve().parents[1]
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed"
)


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"flashsuite {importlib.metadata.version('flashsuite')} (torch ")
    assert f"torch {importlib.metadata.version('torch')}" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU flavour of the main job")
def test_main_job_on_cpu(capsys) -> None:
    assert cli.main(["check", "--no-timing"]) == 0
    text = capsys.readouterr().out
    for section in (
        "== machine",
        "== versions",
        "== what dispatch picks on cpu",
        "== what dispatch picks on sm90",
        "== check against the oracle",
    ):
        assert section in text
    assert "torch  available" in text
    assert "FAIL" not in text and "ERROR" not in text
    assert text.rstrip().endswith("== all checks passed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_needs_a_gpu(capsys) -> None:
    assert cli.main(["bench", "--out", "unused"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_report_table_and_ratios(tmp_path) -> None:
    rows = []
    for contender, tflops in (("fa2", 400.0), ("sdpa-flash", 320.0), ("sdpa-cudnn", 500.0)):
        rows.append(
            dict(
                contender=contender,
                direction="fwd",
                batch=2,
                seqlen=8192,
                heads=16,
                head_dim=128,
                causal=False,
                dtype="bfloat16",
                ms=1.0,
                tflops=tflops,
            )
        )
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps({"meta": {"gpu": "H200", "date": "d", "commit": "c"}, "results": rows})
    )
    results, meta = report.load(path)
    text = report.render(results, meta, tmp_path / "out")
    assert "| fwd | 128 | no | 8192 | 400 | 320 | 500 | 1.25 | 0.80 |" in text
    assert (tmp_path / "out" / "bench.md").exists()
    assert (tmp_path / "out" / "bench-fwd.png").stat().st_size > 10_000  # the plot was drawn
    assert not (tmp_path / "out" / "bench-bwd.png").exists()  # no backward rows, no plot


@needs_matplotlib
def test_bench_on_the_cpu_writes_json_table_and_plots(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["bench", "--device", "cpu", "--out", str(out), "--head-dims", "32"]
    argv += ["--seqlens", "32", "64", "--tokens", "128", "--model-dim", "64"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "bench.json").read_text())
    rows = data["results"]
    # 2 N x 2 causal x 2 directions x (torch, sdpa-math)
    assert len(rows) == 16 and not [r for r in rows if r["error"]]
    assert {r["contender"] for r in rows} == {"torch", "sdpa-math"}
    assert {(r["direction"], r["seqlen"]) for r in rows} == {
        (d, n) for d in ("fwd", "bwd") for n in (32, 64)
    }
    for r in rows:
        assert r["ms"] > 0 and r["tflops"] > 0
        assert r["batch"] * r["seqlen"] == 128 and r["heads"] * r["head_dim"] == 64
    assert data["meta"]["gpu"].startswith("cpu")
    assert "| bwd | 32 | yes | 64 |" in (out / "bench.md").read_text()
    for direction in ("fwd", "bwd"):
        assert (out / f"bench-{direction}.png").stat().st_size > 10_000
    assert f"plots: {out / 'bench-fwd.png'}, {out / 'bench-bwd.png'}" in text


def test_bench_rejects_a_sweep_that_does_not_divide(capsys) -> None:
    argv = ["bench", "--device", "cpu", "--out", "unused", "--seqlens", "48", "--tokens", "100"]
    assert cli.main(argv) == 2
    assert "tokens: expected a multiple of every entry of [48], got 100" in capsys.readouterr().out


def _pytest_benchmark(tmp_path, *args) -> subprocess.CompletedProcess:
    """tests/benchmarks in its CPU smoke mode, in a fresh interpreter (its own pytest session)."""
    env = dict(os.environ, FLASHSUITE_BENCH_SMOKE="1")
    cmd = [sys.executable, "-m", "pytest", "tests/benchmarks/test_bench.py", "-q"]
    # --noconftest: the suite's conftest imports every version (the Triton / CuTe DSL start-up),
    # which the smoke mode does not use.
    cmd += [
        "-p",
        "no:cacheprovider",
        "--noconftest",
        "--benchmark-only",
        "--benchmark-columns=median",
    ]
    cmd += ["--benchmark-storage", f"file://{tmp_path / 'store'}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_pytest_benchmark_groups_by_case_and_compares_across_runs(tmp_path) -> None:
    first = _pytest_benchmark(
        tmp_path, "--benchmark-json", str(tmp_path / "b.json"), "--benchmark-autosave"
    )
    assert first.returncode == 0, first.stdout + first.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    groups: dict[str, list] = {}
    for b in data["benchmarks"]:
        groups.setdefault(b["group"], []).append(b)
    assert len(groups) == 4  # 2 shapes x 2 directions, each a table of its own
    for name, members in groups.items():
        direction, case_id = name.split(" ", 1)
        assert sorted(b["extra_info"]["contender"] for b in members) == ["sdpa-math", "torch"]
        for b in members:
            info = b["extra_info"]
            assert b["name"].endswith(f"-{case_id}-{direction}]") and info["direction"] == direction
            # One timer: the TFLOP/s are pytest-benchmark's own median, not a second timing.
            assert info["ms"] == pytest.approx(b["stats"]["median"] * 1e3)
            assert info["tflops"] == pytest.approx(info["flops"] / info["ms"] / 1e9)
    assert first.stdout.count("benchmark 'fwd b") == 2
    results, _ = report.load(tmp_path / "b.json")
    assert len(results) == 8
    second = _pytest_benchmark(tmp_path, "--benchmark-compare")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Comparing against benchmarks from" in second.stdout + second.stderr
    assert second.stdout.count("(NOW)") == 8 and second.stdout.count("(0001_") == 8


def test_fa4_is_a_peer_only_where_it_imports() -> None:
    """FA4 (flash-attn-4) is timed beside SDPA when importable and is never required: without
    it the default peers are SDPA's, and asking for it says why it cannot run."""
    import pytest

    from flashsuite.common.testing import Case
    from flashsuite.dispatch import bench

    fn, why = bench.fa4_function()
    peers = bench.available_peers("cuda")
    assert peers[:3] == ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient"]
    assert bench.available_peers("cpu") == ["sdpa-math"]
    window = Case(batch=1, seqlen_q=8, seqlen_k=8, heads_q=1, heads_kv=1, head_dim=16,
                  window_size=(4, 0))  # fmt: skip
    with pytest.raises(ValueError, match=r"peer sdpa-cudnn: SDPA takes no window_size"):
        bench.make_callable("sdpa-cudnn", window, None, None, None)
    if fn is not None:
        assert peers[-1] == "fa4"
        return
    assert "fa4" not in peers and why
    case = Case(batch=1, seqlen_q=8, seqlen_k=8, heads_q=1, heads_kv=1, head_dim=16)
    with pytest.raises(RuntimeError, match=r"peer fa4: flash_attn\.cute .* cannot be imported"):
        bench.make_callable("fa4", case, None, None, None)
