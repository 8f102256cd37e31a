"""The shared suite: the same test bodies for every version available on this machine.

A version joins by registering with the dispatcher (dispatch/registry.py); nothing here is
version-specific. A case a version does not support is skipped with the version's own reason
(test_support_matrix makes sure each version still claims what it must).
"""

from __future__ import annotations

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.testing import (
    Case,
    compare,
    make_grad_out,
    make_inputs,
    reference_pair,
)
from tests.conftest import HAS_CUDA, runnable_versions

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# Small enough for the Triton interpreter (~5 ms per 64x64x64 block step on the CPU).
CASES = [
    Case(batch=2, seqlen_q=128, seqlen_k=128, heads_q=2, heads_kv=2, head_dim=64),
    Case(batch=2, seqlen_q=128, seqlen_k=128, heads_q=2, heads_kv=2, head_dim=64, causal=True),
    Case(seqlen_q=96, seqlen_k=96, head_dim=32, dtype=BF16, causal=True),
    Case(seqlen_q=64, seqlen_k=80, head_dim=128, dtype=F32),
    Case(seqlen_q=80, seqlen_k=64, head_dim=96, dtype=F16, causal=True),
    Case(seqlen_q=40, seqlen_k=48, heads_q=1, heads_kv=1, head_dim=256, dtype=BF16),
    Case(seqlen_q=1, seqlen_k=1, head_dim=64),
    Case(seqlen_q=1, seqlen_k=113, head_dim=64, causal=True),
    Case(seqlen_q=17, seqlen_k=17, head_dim=64, causal=True),
    Case(seqlen_q=113, seqlen_k=113, head_dim=64, dtype=BF16),
    Case(seqlen_q=100, seqlen_k=77, head_dim=64, causal=True),  # Nq > Nk: 23 empty rows
    Case(seqlen_q=77, seqlen_k=100, head_dim=64, causal=True),
    Case(batch=1, seqlen_q=1023, seqlen_k=1023, heads_q=1, heads_kv=1, head_dim=32, causal=True),
    Case(seqlen_q=64, seqlen_k=64, heads_q=4, heads_kv=2, head_dim=64),  # GQA
    Case(seqlen_q=65, seqlen_k=70, heads_q=4, heads_kv=1, head_dim=64, causal=True),  # MQA
    Case(seqlen_q=128, seqlen_k=128, head_dim=64, window_size=(16, 8)),
    Case(seqlen_q=96, seqlen_k=128, head_dim=64, window_size=(32, 0)),
    Case(seqlen_q=64, seqlen_k=64, head_dim=64, softcap=30.0),
    Case(seqlen_q=64, seqlen_k=64, head_dim=64, softcap=5.0, causal=True, dtype=BF16),
    Case(seqlen_q=64, seqlen_k=72, head_dim=64, head_dim_v=32),
    Case(seqlen_q=64, seqlen_k=64, head_dim=64, softmax_scale=0.5),
    Case(seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=64, non_contiguous=True),
]

# Realistic sizes, on a GPU only.
GPU_CASES = [
    Case(
        batch=2,
        seqlen_q=4096,
        seqlen_k=4096,
        heads_q=8,
        heads_kv=8,
        head_dim=d,
        dtype=dt,
        causal=c,
        tags=("gpu",),
    )
    for d in (64, 128, 256)
    for dt in (F16, BF16)
    for c in (False, True)
] + [
    Case(
        batch=1,
        seqlen_q=16384,
        seqlen_k=16384,
        heads_q=2,
        heads_kv=1,
        head_dim=128,
        dtype=BF16,
        causal=True,
        tags=("gpu",),
    ),
    Case(
        batch=1,
        seqlen_q=3001,
        seqlen_k=5003,
        heads_q=6,
        heads_kv=2,
        head_dim=96,
        dtype=BF16,
        causal=True,
        tags=("gpu",),
    ),
    Case(
        batch=1,
        seqlen_q=2048,
        seqlen_k=2048,
        heads_q=4,
        heads_kv=4,
        head_dim=192,
        dtype=F16,
        window_size=(256, 64),
        tags=("gpu",),
    ),
]

ALL_CASES = [pytest.param(c, id=c.id) for c in CASES] + [
    pytest.param(c, id=c.id, marks=pytest.mark.gpu) for c in GPU_CASES
]
VERSIONS = runnable_versions()


def _require(version: str, case: Case, q, k, v) -> None:
    try:
        dispatch.select(q, k, v, version=version, **case.options())
    except dispatch.Unsupported as exc:
        pytest.skip(str(exc))


def _assert_ok(comparisons) -> None:
    bad = [str(c) for c in comparisons if not c.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_forward_and_lse(version: str, case: Case, device: str) -> None:
    q, k, v = make_inputs(case, device)
    _require(version, case, q, k, v)
    out, lse = dispatch.attention(q, k, v, **case.options(), return_lse=True, version=version)
    assert out.shape == (case.batch, case.seqlen_q, case.heads_q, case.dv)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    assert lse.shape == (case.batch, case.heads_q, case.seqlen_q)
    ref = reference_pair(q, k, v, **case.options())
    _assert_ok([compare("out", out, *ref["out"]), compare("lse", lse, *ref["lse"], dtype=F32)])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_backward(version: str, case: Case, device: str) -> None:
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    dout = make_grad_out(case, device)
    out = dispatch.attention(q, k, v, **case.options(), version=version)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_pair(q, k, v, grad_out=dout, **case.options())
    _assert_ok(
        [compare("out", out, *ref["out"])]
        + [
            compare(name, got, *ref[name], factor=3.0)
            for name, got in (("dq", dq), ("dk", dk), ("dv", dv))
        ]
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_recompute_contract_saves_only_linear_memory(version: str, device: str) -> None:
    """What the forward saves for backward is q, k, v, out, lse: O(N), nothing Nq x Nk."""
    case = Case(seqlen_q=256, seqlen_k=192, heads_q=2, heads_kv=1, head_dim=32, causal=True)
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = dispatch.attention(q, k, v, causal=True, return_lse=True, version=version)
    assert saved, "nothing saved for backward: is the op differentiable?"
    budget = sum(t.numel() * t.element_size() for t in (q, k, v, out, lse))
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    largest = max(t.numel() for t in saved)
    assert largest < case.seqlen_q * case.seqlen_k, f"an N x N tensor was saved ({largest})"
    assert saved_bytes <= budget, f"saved {saved_bytes} B > q, k, v, out, lse = {budget} B"
    out.sum().backward()  # the saved tensors are enough to differentiate


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=lambda d: str(d).removeprefix("torch."))
def test_fully_masked_rows(version: str, dtype: torch.dtype, device: str) -> None:
    """Rows that see no key: output exactly 0, LSE -inf, gradients finite (and 0 for q)."""
    case = Case(seqlen_q=90, seqlen_k=40, head_dim=64, dtype=dtype, causal=True)
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    out, lse = dispatch.attention(q, k, v, causal=True, return_lse=True, version=version)
    empty = case.seqlen_q - case.seqlen_k  # rows 0..49 see nothing (bottom-right alignment)
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))


@pytest.mark.parametrize("version", VERSIONS)
def test_window_of_one_key(version: str, device: str) -> None:
    """window (0, 0) with Nq > Nk: rows 0..47 see no key, rows 48..63 exactly one (i - 48)."""
    case = Case(seqlen_q=64, seqlen_k=16, head_dim=64, window_size=(0, 0))
    q, k, v = make_inputs(case, device)
    _require(version, case, q, k, v)
    out, lse = dispatch.attention(q, k, v, window_size=(0, 0), return_lse=True, version=version)
    ref = reference_pair(q, k, v, window_size=(0, 0))
    _assert_ok([compare("out", out, *ref["out"]), compare("lse", lse, *ref["lse"], dtype=F32)])


def test_support_matrix_core_cases() -> None:
    """Each version still claims the core of its support matrix (skips must not hide bugs)."""
    from flashsuite.common import arch as arch_mod
    from flashsuite.common.validation import check_inputs

    expect = {
        "torch": [(None, F32, 64, False), (None, BF16, 200, True)],
        "fa2": [(90, BF16, d, c) for d in (32, 64, 96, 128, 192, 256) for c in (False, True)]
        + [(80, F16, 128, True)],
        "fa1": [(75, F16, d, c) for d in (32, 64, 96, 128) for c in (False, True)],
        "fa3": [(90, BF16, d, c) for d in (64, 128, 256) for c in (False, True)]
        + [(90, F16, 128, True)],
    }
    from flashsuite.dispatch import registry

    for version, rows in expect.items():
        if not registry.available(version)[0]:
            continue
        mod = registry.module(version)
        for arch, dtype, d, causal in rows:
            q = torch.empty(1, 128, 2, d, dtype=dtype)
            p = check_inputs(q, q, q, causal=causal)
            with arch_mod.override_arch(arch):
                ok, reason = mod.supports(p, arch)
            assert ok, f"{version} should support {p.describe()} on sm{arch}: {reason}"


@pytest.mark.skipif(HAS_CUDA, reason="float64 gradcheck on the CPU")
def test_gradcheck_float64_torch_version() -> None:
    torch.manual_seed(0)
    for causal, window, softcap in ((True, (-1, -1), 0.0), (False, (3, 2), 2.0)):
        q = torch.randn(1, 9, 2, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, 11, 1, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, 11, 1, 4, dtype=torch.float64, requires_grad=True)

        def fn(q, k, v, causal=causal, window=window, softcap=softcap):
            return dispatch.attention(
                q, k, v, causal=causal, window_size=window, softcap=softcap, version="torch"
            )

        assert torch.autograd.gradcheck(fn, (q, k, v), atol=1e-6, rtol=1e-5)


def test_torch_compile_fullgraph_and_export() -> None:
    case = Case(
        seqlen_q=48, seqlen_k=40, heads_q=4, heads_kv=2, head_dim=16, dtype=F32, causal=True
    )
    q, k, v = make_inputs(case, "cpu", requires_grad=True)

    def loss(q, k, v):
        return dispatch.attention(q, k, v, causal=True, version="torch").square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    got = compiled(q, k, v)
    grads = torch.autograd.grad(got, (q, k, v))
    want = loss(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return dispatch.attention(q, k, v, causal=True, version="torch")

    exported = torch.export.export(Attn(), (q.detach(), k.detach(), v.detach()))
    assert "flashsuite.torch_fwd" in exported.graph_module.code
    torch.testing.assert_close(exported.module()(q, k, v), Attn()(q, k, v))


@pytest.mark.parametrize("version", VERSIONS)
def test_backward_is_deterministic(version: str, device: str) -> None:
    """Two backward passes on the same inputs give bitwise-identical gradients (every shipped
    backward is deterministic by default: no atomics in the reduction order)."""
    case = Case(seqlen_q=130, seqlen_k=150, heads_q=4, heads_kv=2, head_dim=64, causal=True)
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    dout = make_grad_out(case, device)
    grads = []
    for _ in range(2):
        out = dispatch.attention(q, k, v, causal=True, version=version)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for name, a, b in zip(("dq", "dk", "dv"), *grads, strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs"
