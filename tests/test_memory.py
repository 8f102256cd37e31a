"""Peak device memory of forward + backward grows linearly in N and stays within 1.3x of what
the problem itself holds: inputs, output, LSE, the output gradient and the input gradients."""

from __future__ import annotations

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.testing import Case, make_grad_out, make_inputs
from tests.conftest import runnable_versions

pytestmark = pytest.mark.gpu

SEQLENS = (8192, 32768, 131072)


def _peak_ratio(version: str, n: int) -> tuple[int, int]:
    case = Case(batch=1, seqlen_q=n, seqlen_k=n, heads_q=8, heads_kv=8, head_dim=128,
                dtype=torch.bfloat16, causal=True)  # fmt: skip
    q, k, v = make_inputs(case, "cuda", requires_grad=True)
    dout = make_grad_out(case, "cuda")
    try:
        dispatch.select(q, k, v, causal=True, version=version)
    except dispatch.Unsupported as exc:
        pytest.skip(str(exc))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # q, k, v, dout
    out, lse = dispatch.attention(q, k, v, causal=True, return_lse=True, version=version)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    held = sum(t.numel() * t.element_size() for t in (out, lse, dq, dk, dv))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    return peak + inputs, held + inputs


@pytest.mark.parametrize(
    "version", [v for v in runnable_versions() if v.values[0] in ("fa2", "fa3")]
)
def test_peak_memory_is_linear_in_seqlen(version: str, record_property) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows = []
    for n in SEQLENS:
        peak, needed = _peak_ratio(version, n)
        rows.append((n, peak, needed))
        torch.cuda.empty_cache()
    report = ", ".join(f"N={n}: peak {p / 2**20:.0f} MiB = {p / w:.2f}x needed" for n, p, w in rows)
    print(f"{version}: {report}")
    record_property("peak_memory", report)  # lands in --junitxml, for docs/results.md
    for _, peak, needed in rows:
        assert peak <= 1.3 * needed, report
    # Linear: 16x the tokens costs at most ~16x the bytes (nothing quadratic hides in there).
    (n0, p0, _), (n2, p2, _) = rows[0], rows[-1]
    assert p2 / p0 <= 1.1 * n2 / n0, report
