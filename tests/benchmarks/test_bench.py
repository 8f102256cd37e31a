"""The benchmark comparison (pytest-benchmark): every available version next to PyTorch SDPA's
flash / cuDNN / efficient backends over the standard sweep of docs/design.md, forward and
backward.

One group per shape and direction (`benchmark.group`), so each table lists every version and
peer on that shape side by side, with pytest-benchmark's ratio column against the fastest.
pytest-benchmark is the only timer: each round is one call followed by a device
synchronisation (the call is `dispatch.bench.prepare`'s, as `flashsuite bench` times it with
CUDA events); `extra_info` carries the shape and the TFLOP/s of the median round.

Not run by default (`--benchmark-skip` in pyproject); on a GPU host:

    pytest tests/benchmarks --benchmark-only --benchmark-json bench.json
    pytest tests/benchmarks --benchmark-only -k "d128 and causal"      # a part of the sweep
    python -m flashsuite.dispatch.report bench.json --out docs/results  # table + plots

Across commits: `--benchmark-autosave` stores each run under .benchmarks/; on a later commit
`--benchmark-compare` (the latest stored run, or `--benchmark-compare=NNNN`) adds its rows to
every group, and `--benchmark-compare-fail=median:5%` turns a slowdown into a failure.

`FLASHSUITE_BENCH_SMOKE=1` runs the same tests on a CPU over two tiny shapes (`torch` against
SDPA's math backend), to check the harness itself (tests/test_cli.py does, in CI); those
timings say nothing about the kernels.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from flashsuite.dispatch.bench import (
    available_peers,
    case_flops,
    describe,
    prepare,
    standard_sweep,
)
from flashsuite.dispatch.registry import available_versions

if os.environ.get("FLASHSUITE_BENCH_SMOKE") == "1":
    DEVICE = "cpu"
    CONTENDERS = ["torch", "sdpa-math"]
    SWEEP = standard_sweep(
        head_dims=(32,), seqlens=(32, 64), causals=(True,), dtype=torch.float32,
        tokens=128, model_dim=64,
    )  # fmt: skip
    ROUNDS, WARMUP = 3, 1
else:
    pytestmark = pytest.mark.gpu
    DEVICE = "cuda"
    CONTENDERS = [*available_versions(kernels_only=True), *available_peers()]
    SWEEP = standard_sweep()
    ROUNDS, WARMUP = 20, 3


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", SWEEP, ids=[c.id for c in SWEEP])
@pytest.mark.parametrize("contender", CONTENDERS)
def test_attention_speed(benchmark, contender: str, case, direction: str) -> None:
    benchmark.group = f"{direction} {case.id}"
    try:
        call = prepare(contender, case, direction, DEVICE)
        call()  # a contender that cannot take the shape says so here, before any timing
        _sync()
    except Exception as exc:  # an unsupported shape, a backend missing on this build, OOM
        pytest.skip(f"{contender}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")

    def step() -> None:
        call()
        _sync()

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=WARMUP)
    ms = benchmark.stats.stats.median * 1e3
    flops = case_flops(case, direction)
    benchmark.extra_info.update(
        describe(contender, case, direction), flops=flops, ms=ms, tflops=flops / ms / 1e9
    )
    assert math.isfinite(ms) and ms > 0
