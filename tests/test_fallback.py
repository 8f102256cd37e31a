"""The route to PyTorch's own SDPA: on an sm80+ GPU, problems that no flashsuite kernel takes
run `torch.nn.functional.scaled_dot_product_attention` (selection planned for sm90 here, so it
runs on CPU tensors), within the `attention` contract (bottom-right causal, GQA, rows that see
no key give 0); and `dispatch.sdpa`, which sends everything the kernels do not take to PyTorch's
SDPA (on a CPU: every call)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashsuite import dispatch
from flashsuite.common.arch import override_arch
from flashsuite.common.testing import Case, compare, make_grad_out, make_inputs, reference_pair
from flashsuite.dispatch import api
from tests.conftest import DEVICE

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

CASES = [
    Case(seqlen_q=48, seqlen_k=48, heads_q=4, heads_kv=4, head_dim=80, dtype=BF16),
    Case(seqlen_q=48, seqlen_k=48, heads_q=4, heads_kv=2, head_dim=80, dtype=BF16, causal=True),
    Case(seqlen_q=40, seqlen_k=24, heads_q=4, heads_kv=1, head_dim=80, dtype=F16, causal=True),
    Case(seqlen_q=24, seqlen_k=40, heads_q=4, heads_kv=2, head_dim=160, dtype=BF16, causal=True),
    Case(seqlen_q=33, seqlen_k=50, head_dim=200, dtype=F32, softmax_scale=0.2),
    Case(seqlen_q=33, seqlen_k=50, head_dim=80, head_dim_v=48, dtype=F16, causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sdpa_route_is_exact_attention(case: Case, device: str) -> None:
    """Forward and gradients against the float64 oracle (the suite's comparison rule), the
    route named by explain(), no LSE asked for; on a GPU through SDPA's CUDA backends."""
    q, k, v = make_inputs(case, device, requires_grad=True)
    do = make_grad_out(case, device)
    # PyTorch's CPU flash kernel is less exact in float32 than the float32 yardstick (its dV
    # 7x here); what is under test is the route (masks, GQA, layout), not the precision of
    # PyTorch's float32 kernels, so float32 takes SDPA's math backend.
    backend = sdpa_kernel(SDPBackend.MATH) if case.dtype == F32 else contextlib.nullcontext()
    with override_arch(90), backend:
        text = dispatch.explain(q, k, v, **case.options())
        assert text.splitlines()[0].endswith("-> sdpa"), text
        assert "runs torch.nn.functional.scaled_dot_product_attention" in text
        assert "backward: PyTorch's autograd" in text
        out = dispatch.attention(q, k, v, **case.options())
        again = dispatch.attention(q, k, v, **case.options())  # the memoised plan
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.is_contiguous() and out.shape == (*q.shape[:3], case.dv)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    pairs = reference_pair(q, k, v, grad_out=do, **case.options())
    for name, ours in zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True):
        res = compare(name, ours, *pairs[name])
        assert res.ok, res
    if case.causal and case.seqlen_q > case.seqlen_k:  # rows that see no key: exactly 0
        empty = case.seqlen_q - case.seqlen_k
        assert out[:, :empty].eq(0).all() and grads[0][:, :empty].eq(0).all()


@pytest.mark.parametrize(
    ("arch", "options", "why"),
    [
        (90, {"return_lse": True}, "does not return the log-sum-exp"),
        (90, {"softcap": 3.0}, "has no softcap"),
        (90, {"window_size": (8, 0)}, "sliding window"),
        (75, {}, None),  # before sm80 only SDPA's math backend would take bf16
        (None, {}, None),
    ],
)
def test_what_the_sdpa_route_does_not_take_runs_the_portable_version(arch, options, why):
    """Outside what PyTorch's SDPA expresses, auto falls through to the portable version, and
    return_lse=True gets its LSE."""
    q, k, v = make_inputs(Case(head_dim=80, dtype=BF16))
    with override_arch(arch):
        choice = dispatch.select(q, k, v, **options)
        result = dispatch.attention(q, k, v, **options)
    assert choice.version == "torch", str(choice)
    if why is not None:
        assert any(r.startswith("sdpa: no") and why in r for r in choice.reasons), str(choice)
    else:
        assert not any(r.startswith("sdpa") for r in choice.reasons), str(choice)
    if options.get("return_lse"):
        lse = result[1]
        assert lse.dtype == F32 and lse.shape == (1, 2, 64)


def test_inference_entry_points_never_list_the_sdpa_route() -> None:
    """Packed sequences and the KV cache have no SDPA route: it is not a candidate there."""
    q = torch.randn(12, 2, 64, dtype=F16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with override_arch(90):
        choice = dispatch.select_varlen(q, q, q, cu, cu, 7, 7)
    assert not any(r.startswith("sdpa") for r in choice.reasons), str(choice)


def test_sdpa_on_a_cpu_is_pytorchs_sdpa(monkeypatch) -> None:
    """On a device no kernel runs on, dispatch.sdpa is F.scaled_dot_product_attention itself:
    no flashsuite selection or version is involved, the result is PyTorch's bit for bit."""
    looked = []
    real = api._lookup
    monkeypatch.setattr(api, "_lookup", lambda *a: looked.append(a) or real(*a))
    monkeypatch.delenv("FLASHSUITE_VERSION", raising=False)
    monkeypatch.delenv("FLASHSUITE_ARCH", raising=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 32, generator=gen) for n in (24, 40, 40))
    for kwargs in ({}, {"is_causal": True}, {"scale": 0.3}):
        got = dispatch.sdpa(q, k, v, **kwargs)
        torch.testing.assert_close(
            got, F.scaled_dot_product_attention(q, k, v, **kwargs), rtol=0, atol=0
        )
    assert looked == []
    # Planning for a GPU: selection runs. On the device the suite's kernels run on (the Triton
    # interpreter's CPU without a GPU; with one, the GPU: Triton takes no CPU tensors there).
    with override_arch(90):
        dispatch.sdpa(*(t.to(DEVICE) for t in (q, k, v)))
    assert looked
