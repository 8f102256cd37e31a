"""The main job (`flashsuite`) and the benchmark report, as a user runs them."""

from __future__ import annotations

import json

import pytest
import torch

from flashsuite.dispatch import cli, report


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
    assert (tmp_path / "out" / "bench.png").stat().st_size > 10_000  # the plot was drawn
