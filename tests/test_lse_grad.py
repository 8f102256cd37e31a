"""The LSE returned by `attention(..., return_lse=True)` and `attention_varlen` carries a
gradient: a loss on out and the LSE differentiates like the float64 oracle's (every version
that runs here, dense and packed, the op path under torch.compile too), a loss on the LSE
alone works, and the comparison could not pass with the LSE's gradient dropped.

The backward takes it as D = rowsum(dO * O) - dlse (d lse_i / d s_ij = P_ij): ring attention
and attention sinks (out * sigmoid(lse - sink), transformers' gpt-oss) differentiate through
it."""

from __future__ import annotations

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.reference import attention_reference
from flashsuite.common.testing import compare
from flashsuite.dispatch import api
from tests.conftest import HAS_CUDA, runnable_versions

BF16, F16, I32 = torch.bfloat16, torch.float16, torch.int32
DEV = "cuda" if HAS_CUDA else "cpu"
VERSIONS = runnable_versions()

# (B, Nq, Nk, Hq, Hkv, D, dtype, options): every row sees at least one key.
CASES = [
    (2, 33, 40, 4, 2, 64, BF16, {}),
    (1, 48, 48, 2, 2, 64, F16, dict(causal=True)),
    (2, 20, 37, 4, 1, 64, BF16, dict(window_size=(5, 3), softcap=4.0)),
]


def _case_id(c) -> str:
    return f"nq{c[1]}-nk{c[2]}-h{c[3]}x{c[4]}-{str(c[6])[6:]}-{'-'.join(c[7]) or 'plain'}"


def _inputs(case, gen):
    b, nq, nk, hq, hkv, d, dtype, _ = case
    q, k, v = (
        torch.randn(*s, generator=gen, device=DEV).to(dtype)
        for s in ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d))
    )
    g = torch.randn(b, nq, hq, d, generator=gen, device=DEV)  # d loss / d out
    h = torch.randn(b, hq, nq, generator=gen, device=DEV)  # d loss / d lse
    return q, k, v, g, h


def _grads(fn, q, k, v, g, h, use_out=True):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(qs, ks, vs)
    loss = (lse.float() * h).sum()
    if use_out:
        loss = loss + (out.float() * g).sum()
    # The LSE alone does not depend on v: its gradient is then 0.
    return torch.autograd.grad(loss, (qs, ks, vs), allow_unused=True, materialize_grads=True)


def _oracle(options, dtype):
    def fn(q, k, v):
        return attention_reference(q, k, v, compute_dtype=dtype, **options)

    return fn


def _check(ours, ref, pt) -> None:
    for name, a, r, p in zip(("dq", "dk", "dv"), ours, ref, pt, strict=True):
        c = compare(name, a, r, p)
        assert c.ok, str(c)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gradient_through_out_and_lse(version, case) -> None:
    """loss = <out, g> + <lse, h>: dq, dk, dv against the float64 oracle (yardstick: the same
    maths in the input dtype), and with the loss on the LSE alone (out unused)."""
    *_, options = case
    q, k, v, g, h = _inputs(case, torch.Generator(device=DEV).manual_seed(0))

    def ours(q, k, v):
        return dispatch.attention(q, k, v, version=version, return_lse=True, **options)

    try:
        ours(q, k, v)
    except dispatch.Unsupported as exc:
        pytest.skip(str(exc))
    for use_out in (True, False):
        got = _grads(ours, q, k, v, g, h, use_out)
        ref = _grads(_oracle(options, torch.float64), q, k, v, g, h, use_out)
        pt = _grads(_oracle(options, None), q, k, v, g, h, use_out)
        _check(got, ref, pt)


def test_dropping_the_lse_gradient_fails_the_comparison() -> None:
    """The check above is not blind to dlse: the oracle's gradients with the LSE term dropped
    are far outside its bound."""
    case = CASES[0]
    q, k, v, g, h = _inputs(case, torch.Generator(device=DEV).manual_seed(0))
    ref = _grads(_oracle({}, torch.float64), q, k, v, g, h)
    pt = _grads(_oracle({}, None), q, k, v, g, h)
    without = _grads(_oracle({}, torch.float64), q, k, v, g, 0 * h)
    assert not any(
        compare(n, a.to(q.dtype), r, p).ok
        for n, a, r, p in zip(("dq", "dk"), without, ref, pt, strict=False)
    )


def test_lse_gradient_under_torch_compile() -> None:
    """The op path (torch.compile, fullgraph) differentiates through the LSE as the eager one."""
    case = CASES[1]
    q, k, v, g, h = _inputs(case, torch.Generator(device=DEV).manual_seed(1))

    def fn(q, k, v):
        return dispatch.attention(q, k, v, return_lse=True, causal=True, version="torch")

    eager = _grads(fn, q, k, v, g, h)
    compiled = _grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, g, h)
    for a, b_ in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b_)


def _varlen_oracle(cu, options, dtype):
    """Per-sequence oracle of packed (total, H, D) inputs: out (total_q, Hq, Dv) and lse
    (Hq, total_q), differentiable."""
    bounds = cu.tolist()

    def fn(q, k, v):
        outs, lses = [], []
        for b in range(len(bounds) - 1):
            rows = slice(bounds[b], bounds[b + 1])
            o, lse = attention_reference(q[None, rows], k[None, rows], v[None, rows],
                                         compute_dtype=dtype, **options)  # fmt: skip
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    return fn


@pytest.mark.parametrize(
    "version", [p for p in runnable_versions() if p.values[0] in ("fa2", "fa3", "torch")]
)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gradient_through_out_and_lse(version, causal) -> None:
    """attention_varlen's lse (Hq, total_q) carries its gradient into each sequence's backward
    (sequences of 5, 17 and 30 tokens, the packed layouts' padding rows between them)."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    lens = [5, 17, 30]
    cu = torch.tensor([0, 5, 22, 52], dtype=I32, device=DEV)
    total, hq, d = sum(lens), 4, 64
    q, k, v = (torch.randn(total, hq, d, generator=gen, device=DEV).to(BF16) for _ in "qkv")
    g = torch.randn(total, hq, d, generator=gen, device=DEV)
    h = torch.randn(hq, total, generator=gen, device=DEV)
    options = dict(causal=causal)

    def ours(q, k, v):
        return dispatch.attention_varlen(
            q, k, v, cu, cu, max(lens), max(lens), return_lse=True, version=version, **options
        )

    try:
        ours(q, k, v)
    except dispatch.Unsupported as exc:
        pytest.skip(str(exc))
    got = _grads(ours, q, k, v, g, h)
    ref = _grads(_varlen_oracle(cu, options, torch.float64), q, k, v, g, h)
    pt = _grads(_varlen_oracle(cu, options, None), q, k, v, g, h)
    _check(got, ref, pt)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2, 1000, 1200, 8, 2, 128, BF16, dict(causal=True)),
                                  (1, 700, 700, 4, 4, 64, F16, dict(window_size=(100, 0)))],
                         ids=_case_id)  # fmt: skip
def test_gpu_gradient_through_out_and_lse(case) -> None:
    """At sizes of several tiles, on the GPU's auto version (fa3's own backward on sm90)."""
    *_, options = case
    q, k, v, g, h = _inputs(case, torch.Generator(device=DEV).manual_seed(3))

    def ours(q, k, v):
        return dispatch.attention(q, k, v, return_lse=True, **options)

    got = _grads(ours, q, k, v, g, h)
    ref = _grads(_oracle(options, torch.float64), q, k, v, g, h)
    pt = _grads(_oracle(options, None), q, k, v, g, h)
    _check(got, ref, pt)


@pytest.mark.parametrize("version", [p for p in VERSIONS if p.values[0] in ("fa2", "torch")])
def test_explicit_backward_takes_dlse(version) -> None:
    """dispatch.attention_backward(..., dlse=h) gives autograd's gradients of <out, g> +
    <lse, h> bit for bit; a dlse of the wrong shape is a clear error."""
    case = CASES[1]
    q, k, v, g, h = _inputs(case, torch.Generator(device=DEV).manual_seed(4))

    def fn(q, k, v):
        return dispatch.attention(q, k, v, return_lse=True, causal=True, version=version)

    want = _grads(fn, q, k, v, g, h)
    out, lse = fn(q, k, v)
    got = api.attention_backward(
        g.to(out.dtype), q, k, v, out, lse, causal=True, version=version, dlse=h
    )
    for a, b_ in zip(got, want, strict=True):
        assert torch.equal(a, b_)
    with pytest.raises(ValueError, match=r"dlse: expected a tensor of shape \(B, Hq, Nq\)"):
        api.attention_backward(g.to(out.dtype), q, k, v, out, lse, causal=True, dlse=h[0])


@pytest.mark.parametrize("version", [p for p in VERSIONS if p.values[0] in ("fa2", "torch")])
def test_varlen_explicit_backward_op_path_and_lse_alone(version) -> None:
    """attention_varlen_backward(..., dlse=h) gives autograd's bits of <out, g> + <lse, h>;
    a loss on the packed LSE alone (out unused) differentiates through the eager path and the
    op path (torch.compile) alike; fa3's packed backward op (its own or its partner's, chosen
    per call) takes dlse too."""
    from flashsuite.dispatch import inference

    gen = torch.Generator(device=DEV).manual_seed(5)
    cu = torch.tensor([0, 9, 9, 40], dtype=I32, device=DEV)  # an empty sequence between
    q, k, v = (torch.randn(40, 4, 32, generator=gen, device=DEV).to(BF16) for _ in "qkv")
    g = torch.randn(40, 4, 32, generator=gen, device=DEV)
    h = torch.randn(4, 40, generator=gen, device=DEV)

    def fn(q, k, v):
        return dispatch.attention_varlen(
            q, k, v, cu, cu, 31, 31, causal=True, return_lse=True, version=version
        )

    want = _grads(fn, q, k, v, g, h)
    out, lse = fn(q, k, v)
    args = (g.to(out.dtype), q, k, v, out, lse, cu, cu, 31, 31)
    got = inference.attention_varlen_backward(*args, causal=True, version=version, dlse=h)
    for a, b_ in zip(got, want, strict=True):
        assert torch.equal(a, b_)
    with pytest.raises(ValueError, match=r"dlse: expected a tensor of shape \(Hq, total_q\)"):
        inference.attention_varlen_backward(*args, causal=True, version=version, dlse=h.t())
    alone = _grads(fn, q, k, v, g, h, use_out=False)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, b_ in zip(_grads(compiled, q, k, v, g, h, use_out=False), alone, strict=True):
        torch.testing.assert_close(a, b_)
    if version == "fa2":  # fa3's op on this machine chooses fa2's backward (its partner)
        fa3_bwd = inference._op("varlen", "fa3").bwd
        scalars = (31, 31, True, 32**-0.5, -1, 0, 0.0)
        got = fa3_bwd(g.to(out.dtype), q, k, v, out, lse, cu, cu, *scalars, h)
        for a, b_ in zip(got, want, strict=True):
            assert torch.equal(a, b_)


@pytest.mark.parametrize("version", [p for p in VERSIONS if p.values[0] in ("fa1", "fa2", "torch")])
def test_rows_without_keys_take_no_lse_gradient(version) -> None:
    """Causal with Nq > Nk: the first rows see no key (out 0, LSE -inf). A loss on out and on
    the finite LSEs (the others weighted 0) gives the oracle's gradients, finite everywhere:
    those rows' P is 0, so their dlse reaches nothing."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    q = torch.randn(1, 20, 2, 32, generator=gen, device=DEV).to(BF16)
    k, v = (torch.randn(1, 12, 2, 32, generator=gen, device=DEV).to(BF16) for _ in "kv")
    g = torch.randn(1, 20, 2, 32, generator=gen, device=DEV)
    h = torch.randn(1, 2, 20, generator=gen, device=DEV)
    h[:, :, :8] = 0  # rows 0..7 see no key

    def loss_of(fn):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*ins)
        assert torch.isneginf(lse[:, :, :8]).all() and not out[:, :8].any()
        finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        loss = (out.float() * g).sum() + (finite.float() * h).sum()
        return torch.autograd.grad(loss, ins)

    def ours(q, k, v):
        return dispatch.attention(q, k, v, causal=True, return_lse=True, version=version)

    try:
        got = loss_of(ours)
    except dispatch.Unsupported as exc:
        pytest.skip(str(exc))
    assert all(torch.isfinite(t).all() for t in got)
    ref = loss_of(_oracle(dict(causal=True), torch.float64))
    pt = loss_of(_oracle(dict(causal=True), None))
    _check(got, ref, pt)
