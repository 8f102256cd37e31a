"""Dense problems of few query rows on fa2's split-KV decode kernel (fa2.interface.decode_route):
the policy, that dispatch.attention reaches the decode kernel with k and v as
full cache rows, and out, the LSE and the gradients (fa2's backward on the routed out and LSE)
against the float64 oracle. CPU under the Triton interpreter; the larger cases on a GPU."""

from __future__ import annotations

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.validation import check_inputs
from tests.conftest import HAS_CUDA, runnable_versions
from tests.test_inference import _oracle

pytest.importorskip("triton")

from flashsuite.common.testing import compare
from flashsuite.fa2 import interface

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DEV = "cuda" if HAS_CUDA else "cpu"
FA2 = [p for p in runnable_versions() if p.values[0] == "fa2"]


def _params(b, nq, nk, hq, hkv, d, dtype=BF16, dv=None, **options):
    q = torch.empty(b, nq, hq, d, dtype=dtype, device="meta")
    k = torch.empty(b, nk, hkv, d, dtype=dtype, device="meta")
    v = torch.empty(b, nk, hkv, dv or d, dtype=dtype, device="meta")
    return check_inputs(q, k, v, **options)


@pytest.mark.parametrize(
    ("shape", "options", "routed"),
    [
        ((8, 1, 4096, 32, 8, 128), {}, True),  # a decode step: 4 packed rows
        ((2, 16, 4096, 32, 8, 128), dict(causal=True), True),  # 64 rows
        ((2, 17, 4096, 32, 8, 128), dict(causal=True), False),  # 68 rows
        ((2, 9, 4096, 64, 8, 128), {}, False),  # 72 rows
        ((1, 1, 4096, 32, 32, 128), {}, True),  # MHA: 32 (batch, head) tiles
        ((2, 16, 300, 16, 16, 64), dict(window_size=(50, 0), softcap=5.0), True),  # MHA, 32
        ((4, 1, 4096, 16, 16, 128), {}, False),  # MHA: 64 tiles fill the forward's grid
        ((1, 1, 7, 8, 1, 256), {}, True),  # fewer keys than a block
        ((1, 1, 4096, 8, 8, 128, F32), {}, False),  # float32 keeps the forward kernel
        ((1, 1, 4096, 8, 8, 128, BF16, 64), {}, False),  # Dv != D
        ((1, 1, 0, 8, 8, 128), {}, False),  # no keys: the forward's own path
    ],
)  # fmt: skip
def test_decode_route_policy(shape, options, routed, monkeypatch) -> None:
    """Dense fp16 / bf16 problems of at most 16 queries whose packed rows fit one 64-row tile,
    with GQA or with fewer than 64 (batch, head) tiles, are the KV-cache problem of k, v as
    full rows (no new tokens, contiguous, the heuristic's splits); the rest, and everything
    with DECODE_ROUTE_MAX_ROWS = 0, keep the forward kernel."""
    p = _params(*shape, **options)
    kp = interface.decode_route(p)
    assert (kp is not None) == routed
    if routed:
        assert (kp.attn, kp.seqlen_new, kp.page_size, kp.num_splits) == (p, 0, 0, 0)
        monkeypatch.setattr(interface, "DECODE_ROUTE_MAX_ROWS", 0)
        assert interface.decode_route(p) is None


# (B, Nq, Nk, Hq, Hkv, D, dtype, layout, options). "bhnd": q, k, v as (B, N, H, D) views of
# (B, H, N, D) tensors (SDPA's layout).
CPU_CASES = [
    (2, 1, 300, 8, 2, 64, BF16, "bnhd", {}),
    (2, 4, 200, 8, 2, 64, BF16, "bhnd", dict(causal=True)),
    (2, 16, 150, 4, 4, 64, F16, "bnhd", dict(window_size=(50, 0), softcap=5.0)),  # MHA
    (2, 5, 3, 8, 8, 64, F16, "bnhd", dict(causal=True)),  # the first 2 rows see no key
    (1, 3, 100, 8, 1, 128, BF16, "bnhd", dict(causal=True)),
]
GPU_CASES = [
    (8, 1, 4096, 32, 8, 128, BF16, "bnhd", {}),
    (1, 1, 40000, 32, 8, 128, BF16, "bnhd", {}),  # split over the SMs
    (4, 16, 3000, 32, 8, 128, BF16, "bnhd", dict(causal=True)),  # 64 packed rows
    (2, 4, 700, 16, 16, 256, BF16, "bnhd", dict(window_size=(100, 0), softcap=10.0)),
    (3, 1, 5000, 32, 4, 128, BF16, "bhnd", {}),
]


def _case_id(c) -> str:
    b, nq, nk, hq, hkv, d, dt, layout, opts = c
    return f"b{b}-nq{nq}-nk{nk}-h{hq}x{hkv}-D{d}-{str(dt)[6:]}-{layout}-{'-'.join(opts) or 'plain'}"


def _inputs(case, gen):
    b, nq, nk, hq, hkv, d, dtype, layout, _ = case

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)

    if layout == "bhnd":
        return rand(b, hq, nq, d).transpose(1, 2), *(
            rand(b, hkv, nk, d).transpose(1, 2) for _ in "kv"
        )
    return rand(b, nq, hq, d), *(rand(b, nk, hkv, d) for _ in "kv")


def _check(case, monkeypatch) -> None:
    *_, options = case
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = _inputs(case, gen)
    calls = []
    real = interface.kvcache_forward

    def spy(q_, kc, vc, kn, vn, lens, table, kp, **kw):
        calls.append((kn, vn, table, lens.dtype, lens.tolist()))
        return real(q_, kc, vc, kn, vn, lens, table, kp, **kw)

    monkeypatch.setattr(interface, "kvcache_forward", spy)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = dispatch.attention(qs, ks, vs, return_lse=True, version="fa2", **options)
    do = torch.randn(out.shape, generator=gen, device=DEV).to(out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), do)
    assert calls == [(None, None, None, torch.int32, [k.shape[1]] * q.shape[0])]
    ref = _oracle(q, k, v, do, **options)
    ours = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    for name, t in ours.items():
        dt = F32 if name == "lse" else q.dtype
        c = compare(name, t, ref["ref"][name], ref["pt"][name],
                    factor=3.0 if name.startswith("d") else 2.0, dtype=dt)  # fmt: skip
        assert c.ok, str(c)
    with torch.no_grad():  # dispatch's bound plan without a gradient: the same kernel and bits
        assert torch.equal(dispatch.attention(q, k, v, version="fa2", **options), out.detach())
    assert len(calls) == 2


@pytest.mark.parametrize("version", FA2)
@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_dense_problems_on_the_decode_kernel(version, case, monkeypatch) -> None:
    """Dense problems the route takes, through dispatch.attention with a gradient: the decode
    kernel ran once with k, v as the cache and every row's length Nk (int32), no new tokens,
    no block table; out, the LSE and fa2's gradients match the float64 oracle (a row that sees
    no key: out 0, LSE -inf); the call without a gradient gives the same bits."""
    _check(case, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("version", FA2)
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_dense_problems_on_the_decode_kernel(version, case, monkeypatch) -> None:
    """The same at serving sizes on a GPU (splits, D 256, SDPA's layout)."""
    _check(case, monkeypatch)


@pytest.mark.parametrize("version", FA2)
def test_route_off_and_without_the_lse(version, monkeypatch) -> None:
    """The bound forward of a routed problem returns (out, None) when dispatch asks for no LSE,
    with the decode kernel's out; with DECODE_ROUTE_MAX_ROWS = 0 the forward kernel runs the
    same problem (no decode call) and agrees within rounding; explain() names the route."""
    case = (2, 1, 70, 8, 2, 64, BF16, "bnhd", {})
    q, k, v = _inputs(case, torch.Generator(device=DEV).manual_seed(1))
    p = check_inputs(q, k, v)
    routed, lse = interface.bind_forward(p)(q, k, v)
    bare, none = interface.bind_forward(p, need_lse=False)(q, k, v)
    assert none is None and lse.shape == (2, 8, 1) and torch.equal(bare, routed)
    assert "split-KV decode" in dispatch.explain(q, k, v, version="fa2")
    monkeypatch.setattr(interface, "DECODE_ROUTE_MAX_ROWS", 0)
    monkeypatch.setattr(interface, "kvcache_forward", None)  # a decode call would fail
    dense, dense_lse = interface.forward(q, k, v, p)
    torch.testing.assert_close(dense, routed, atol=2e-2, rtol=0)
    torch.testing.assert_close(dense_lse, lse, atol=1e-5, rtol=0)
    assert "split-KV decode" not in dispatch.explain(q, k, v, version="fa2")
