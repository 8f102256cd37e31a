"""CPU microbenchmark of fa3's per-call Python path (no GPU needed).

    python -m benchmarks.fa3_overhead

Times each host-side stage of `interface.forward` on CPU tensors of a tiny problem: input
validation (common, the caller's), the output allocations, `_tma_ready`, the launch-plan
lookup (config, CompileKey, scalars: memoised) and the whole `forward` with the TVM-FFI call
replaced by a no-op. What is left of a tiny GPU call's wall time (ablate's overhead stage)
beyond this total is the TVM-FFI launch and torch's CUDA allocations.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flashsuite.common.validation import check_inputs
from flashsuite.fa3 import compile as fa3_compile
from flashsuite.fa3 import interface


def _us(fn: Callable[[], object], n: int = 20_000) -> float:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def measure() -> dict[str, float]:
    """Microseconds per call of each stage, on this machine's CPU."""
    q = torch.randn(1, 128, 1, 64, dtype=torch.bfloat16)  # (B, N, H, D)
    k, v = q.clone(), q.clone()
    p = check_inputs(q, k, v)
    # No GPU here: the binary is a no-op and the SM count a constant.
    fa3_compile.get_forward = lambda key: lambda *args: None
    torch.cuda.get_device_properties = lambda dev: type("P", (), {"multi_processor_count": 132})
    return {
        "check_inputs": _us(lambda: check_inputs(q, k, v)),
        "alloc_out_lse": _us(
            lambda: (
                torch.empty((1, 128, 1, 64), dtype=torch.bfloat16),
                torch.empty((1, 1, 128), dtype=torch.float32),
            )
        ),
        "tma_ready_x3": _us(
            lambda: (interface._tma_ready(q), interface._tma_ready(k), interface._tma_ready(v))
        ),
        "launch_plan": _us(lambda: interface._launch_plan(p, None, q.device)),
        "forward_without_launch": _us(lambda: interface.forward(q, k, v, p)),
    }


def main() -> int:
    for name, us in measure().items():
        print(f"{name:24s} {us:7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
