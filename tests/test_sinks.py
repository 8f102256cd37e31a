"""Attention sinks (`sinks=` of attention, attention_varlen, attention_with_kvcache): a logit per
query head joins every row's softmax and its column is dropped. Against a float64 softmax with
that column written out: out, the LSE (which then includes the sink) and the gradients in q,
k, v and the sinks, on every version that runs here; the errors name `sinks`."""

from __future__ import annotations

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.reference import visibility_mask
from flashsuite.common.testing import compare
from tests.conftest import HAS_CUDA, runnable_versions

DEV = "cuda" if HAS_CUDA else "cpu"
VERSIONS = [p for p in runnable_versions() if p.values[0] in ("fa2", "fa3", "torch")]


def _sink_softmax(q, k, v, sinks, causal, dtype):
    """out (B, Nq, Hq, Dv) and lse (B, Hq, Nq) of softmax([scores, s_h]) with the sink column
    dropped, in `dtype` (None: q's)."""
    dt = dtype or q.dtype
    g = q.shape[2] // k.shape[2]
    qh = q.to(dt).transpose(1, 2)  # (B, Hq, Nq, D)
    kh, vh = (t.to(dt).transpose(1, 2).repeat_interleave(g, 1) for t in (k, v))
    s = qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, Hq, Nq, Nk)
    visible = visibility_mask(q.shape[1], k.shape[1], causal=causal, device=q.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    sink = sinks.to(dt)[None, :, None, None].expand(*s.shape[:3], 1)
    full = torch.cat([s, sink], dim=-1)  # (B, Hq, Nq, Nk + 1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    lse = torch.logsumexp(full, dim=-1)  # (B, Hq, Nq)
    return (p @ vh).transpose(1, 2), lse.float() if dtype is None else lse


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("causal", "hkv"), [(False, 2), (True, 2), (True, 4)])
def test_dense_and_packed_sinks_match_the_softmax_with_their_column(version, causal, hkv) -> None:
    """GQA and MHA, causal and not: dense out, LSE and gradients (q, k, v, sinks); the same
    rows packed as two sequences, out and LSE, and their gradients (the packed LSE's gradient
    reaches the sinks and q, k, v); out alone with return_lse=False."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    b, nq, nk, hq, d = 2, 24, 40, 4, 32
    q = torch.randn(b, nq, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
    k, v = (torch.randn(b, nk, hkv, d, generator=gen, device=DEV).to(torch.bfloat16) for _ in "kv")
    sinks = 2 * torch.randn(hq, generator=gen, device=DEV)
    g = torch.randn(b, nq, hq, d, generator=gen, device=DEV)
    h = torch.randn(b, hq, nq, generator=gen, device=DEV)

    def grads(fn):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        out, lse = fn(*ins)
        loss = (out.float() * g).sum() + (lse.float() * h).sum()
        return (out.detach(), lse.detach(), *torch.autograd.grad(loss, ins))

    try:
        ours = grads(lambda q, k, v, s: dispatch.attention(
            q, k, v, causal=causal, sinks=s, return_lse=True, version=version))  # fmt: skip
    except dispatch.Unsupported as exc:
        pytest.skip(str(exc))
    ref = grads(lambda *a: _sink_softmax(*a, causal, torch.float64))
    pt = grads(lambda *a: _sink_softmax(*a, causal, None))
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, a, r, p in zip(names, ours, ref, pt, strict=True):
        c = compare(name, a, r, p)
        assert c.ok, str(c)

    alone = dispatch.attention(q, k, v, causal=causal, sinks=sinks, version=version)
    assert torch.equal(alone, ours[0])

    # Packed: the same rows as two sequences through attention_varlen.
    cu_q = torch.tensor([0, nq, 2 * nq], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, nk, 2 * nk], dtype=torch.int32, device=DEV)

    def packed(q, k, v, s):
        out, lse = dispatch.attention_varlen(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, nq, nk,
            causal=causal, sinks=s, return_lse=True, version=version,
        )  # fmt: skip
        return out.unflatten(0, (b, nq)), lse.unflatten(1, (b, nq)).transpose(0, 1)

    try:
        got = grads(packed)
    except dispatch.Unsupported as exc:
        pytest.skip(str(exc))
    for name, a, r, p in zip(names, got, ref, pt, strict=True):
        c = compare(name, a, r, p)
        assert c.ok, str(c)


@pytest.mark.parametrize("version", [p for p in VERSIONS if p.values[0] in ("fa2", "torch")])
def test_kvcache_sinks(version) -> None:
    """A decode step on a cache with sinks is the dense call's rows with sinks."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(2, 1, 8, 32, generator=gen, device=DEV).to(torch.bfloat16)
    kc, vc = (torch.randn(2, 64, 2, 32, generator=gen, device=DEV).to(torch.bfloat16) for _ in "kv")
    sinks = torch.randn(8, generator=gen, device=DEV)
    lens = torch.tensor([10, 64], dtype=torch.int32, device=DEV)
    out, lse = dispatch.attention_with_kvcache(
        q, kc, vc, cache_seqlens=lens, sinks=sinks, return_lse=True, version=version
    )
    for row, n in enumerate(lens.tolist()):
        args = (q[row : row + 1], kc[row : row + 1, :n], vc[row : row + 1, :n], sinks, False)
        r, p = _sink_softmax(*args, torch.float64), _sink_softmax(*args, None)
        for name, i in (("out", 0), ("lse", 1)):
            got = (out, lse)[i][row : row + 1]
            c = compare(name, got, r[i], p[i])
            assert c.ok, str(c)


def test_bad_sinks_name_the_argument() -> None:
    q = torch.zeros(1, 4, 2, 16)
    for bad, got in ((torch.zeros(3), r"float32 of shape \(3,\)"), ([0.0, 0.0], "list"),
                     (torch.zeros(2, dtype=torch.int32), r"int32 of shape \(2,\)")):  # fmt: skip
        with pytest.raises(ValueError, match=r"sinks: expected a floating tensor of shape \(2,\) "
                           + r".* on cpu, got " + got):  # fmt: skip
            dispatch.attention(q, q, q, sinks=bad, version="torch")
