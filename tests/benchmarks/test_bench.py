"""The benchmark comparison (pytest-benchmark): every available version next to PyTorch SDPA's
flash / cuDNN / efficient backends over the standard sweep of docs/design.md, forward and
backward.

Not run by default (`--benchmark-skip` in pyproject); on a GPU host:

    pytest tests/benchmarks --benchmark-only --benchmark-json bench.json
    python -m flashsuite.dispatch.report bench.json --out docs/results

The numbers that matter are CUDA-event medians from `triton.testing.do_bench` (in
`extra_info`: ms, TFLOP/s and the ratio to each peer timed in the same run);
pytest-benchmark's own columns time the same call with a device synchronisation.
"""

from __future__ import annotations

import pytest
import torch

from flashsuite.common.testing import make_inputs
from flashsuite.dispatch.bench import PEERS, make_callable, measure, standard_sweep
from flashsuite.dispatch.registry import available_versions

pytestmark = pytest.mark.gpu

CONTENDERS = [*available_versions(kernels_only=True), *PEERS]
SWEEP = standard_sweep()
_peer_results: dict[tuple, float] = {}


def _peer_tflops(peer: str, case, direction: str) -> float:
    key = (peer, case, direction)
    if key not in _peer_results:
        _peer_results[key] = measure(peer, case, direction).tflops
    return _peer_results[key]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", SWEEP, ids=[c.id for c in SWEEP])
@pytest.mark.parametrize("contender", CONTENDERS)
def test_attention_speed(benchmark, contender: str, case, direction: str) -> None:
    result = measure(contender, case, direction)
    if result.error:
        pytest.skip(f"{contender}: {result.error}")
    info = result.as_dict()
    for peer in PEERS:
        peer_tflops = result.tflops if peer == contender else _peer_tflops(peer, case, direction)
        info[f"ratio_to_{peer}"] = (
            result.tflops / peer_tflops if peer_tflops == peer_tflops else None
        )
    benchmark.extra_info.update(info)

    q, k, v = make_inputs(case, "cuda", requires_grad=direction == "bwd")
    run, leaves = make_callable(contender, case, q, k, v)
    if direction == "fwd":

        def step():
            with torch.no_grad():
                run()
            torch.cuda.synchronize()
    else:
        out = run()
        dout = torch.randn_like(out)

        def step():
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
            torch.cuda.synchronize()

    benchmark.pedantic(step, rounds=10, warmup_rounds=2)
