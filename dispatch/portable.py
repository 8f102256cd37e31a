"""The portable version "torch": exact attention in blocked PyTorch ops, on any device.

Same contract as the kernels (docs/versions.md): the forward keeps only out and LSE, the
backward recomputes P chunk by chunk from q, k and the LSE. Queries are processed in chunks
of C rows, so the largest temporary is (B, Hkv, G, C, Nk) instead of (B, Hq, Nq, Nk): memory
grows as O(N·C), not O(N²). GQA/MQA broadcasts K/V over the group (no repeated copies).
It is what auto picks on CPU and wherever no kernel fits, and it supports every option.
"""

from __future__ import annotations

import torch

from flashsuite.common.fp8 import dequantised
from flashsuite.common.validation import AttnParams

NAME = "torch"
HAS_BACKWARD = True

# Elements of the per-chunk score block (B, Hkv, G, C, Nk) to aim for: 16M fp32 = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


def available() -> tuple[bool, str]:
    return True, "plain PyTorch, runs anywhere"


def supports(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    if p.is_fp8:
        return True, "float8 inputs are dequantised to float32"
    return True, "every option, any device (blocked PyTorch, slow but exact)"


def _chunk_rows(p: AttnParams) -> int:
    per_row = max(1, p.batch * p.heads_q * max(p.seqlen_k, 1))
    return max(1, min(max(p.seqlen_q, 1), _CHUNK_ELEMENTS // per_row))


def _compute_dtype(p: AttnParams) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _heads_first(t: torch.Tensor, p: AttnParams, grouped: bool, dtype: torch.dtype):
    """(B, N, H, D) -> (B, Hkv, G, N, D) for queries, (B, Hkv, 1, N, D) for keys/values."""
    t = t.to(dtype).transpose(1, 2)  # (B, H, N, D)
    if grouped:
        return t.reshape(p.batch, p.heads_kv, p.group_size, t.shape[2], t.shape[3])
    return t.unsqueeze(2)


def _visible(p: AttnParams, rows: slice, device) -> torch.Tensor | None:
    """Bool (C, Nk) visibility of keys for query rows `rows`, or None when all are visible."""
    if p.window_left < 0 and p.window_right < 0:
        return None
    i = torch.arange(rows.start, rows.stop, device=device).unsqueeze(1)  # (C, 1)
    j = torch.arange(p.seqlen_k, device=device).unsqueeze(0)  # (1, Nk)
    diag = i + p.shift  # (C, 1)
    visible = torch.ones(i.shape[0], p.seqlen_k, dtype=torch.bool, device=device)  # (C, Nk)
    if p.window_right >= 0:
        visible &= j <= diag + p.window_right
    if p.window_left >= 0:
        visible &= j >= diag - p.window_left
    return visible


def _scores(qc, kh, p: AttnParams, visible):
    """Scaled, capped, masked scores (B, Hkv, G, C, Nk) and tanh for the softcap derivative."""
    s = (qc @ kh.transpose(-1, -2)) * p.scale  # (B, Hkv, G, C, Nk)
    tanh = None
    if p.softcap > 0:
        tanh = torch.tanh(s / p.softcap)  # (B, Hkv, G, C, Nk)
        s = p.softcap * tanh
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s, tanh


def _dequantised(q, k, v, p: AttnParams, descale_q, descale_k, descale_v):
    g = p.group_size
    return dequantised(q, descale_q, g), dequantised(k, descale_k), dequantised(v, descale_v)


def forward(q, k, v, p: AttnParams, descale_q=None, descale_k=None, descale_v=None):
    """out (B, Nq, Hq, Dv) in p.out_dtype, lse (B, Hq, Nq) float32 natural log."""
    if p.is_fp8:
        q, k, v = _dequantised(q, k, v, p, descale_q, descale_k, descale_v)
    dt = _compute_dtype(p)
    kh = _heads_first(k, p, False, dt)  # (B, Hkv, 1, Nk, D)
    vh = _heads_first(v, p, False, dt)  # (B, Hkv, 1, Nk, Dv)
    out = torch.empty(
        p.batch, p.seqlen_q, p.heads_q, p.head_dim_v, dtype=p.out_dtype, device=q.device
    )
    lse = torch.empty(p.batch, p.heads_q, p.seqlen_q, dtype=torch.float32, device=q.device)
    c = _chunk_rows(p)
    for start in range(0, p.seqlen_q, c):
        rows = slice(start, min(start + c, p.seqlen_q))
        qc = _heads_first(q[:, rows], p, True, dt)  # (B, Hkv, G, C, D)
        s, _ = _scores(qc, kh, p, _visible(p, rows, q.device))  # (B, Hkv, G, C, Nk)
        m = (
            s.amax(dim=-1, keepdim=True)
            if p.seqlen_k
            else s.new_full((*s.shape[:-1], 1), -torch.inf)
        )
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # (B, Hkv, G, C, 1)
        e = torch.exp(s - m)  # (B, Hkv, G, C, Nk), 0 where masked
        den = e.sum(dim=-1, keepdim=True)  # (B, Hkv, G, C, 1)
        o = (e @ vh) / torch.where(den == 0, torch.ones_like(den), den)  # (B, Hkv, G, C, Dv)
        chunk_lse = torch.where(den == 0, -torch.inf, m + torch.log(den)).squeeze(-1)  # (B,Hkv,G,C)
        out[:, rows] = o.reshape(p.batch, p.heads_q, -1, p.head_dim_v).transpose(1, 2).to(out.dtype)
        lse[:, :, rows] = chunk_lse.reshape(p.batch, p.heads_q, -1).float()
    return out, lse


def backward(dout, q, k, v, out, lse, p: AttnParams, dlse=None):
    """dq, dk, dv like q, k, v; P is recomputed per query chunk from q, k and the LSE. `dlse`
    (B, Hq, Nq), the gradient reaching the LSE (None: 0), enters as D = rowsum(dO ∘ O) - dlse."""
    dt = _compute_dtype(p)
    kh = _heads_first(k, p, False, dt)  # (B, Hkv, 1, Nk, D)
    vh = _heads_first(v, p, False, dt)  # (B, Hkv, 1, Nk, Dv)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, Nq, Hq, D)
    dk = torch.zeros(kh.shape, dtype=dt, device=q.device)  # (B, Hkv, 1, Nk, D)
    dv = torch.zeros(vh.shape, dtype=dt, device=q.device)  # (B, Hkv, 1, Nk, Dv)
    # Rows that see no key have lse = -inf; +inf makes their P exactly 0 (no -inf - -inf).
    lse_safe = torch.where(torch.isinf(lse), torch.inf, lse).to(dt)  # (B, Hq, Nq)
    c = _chunk_rows(p)
    for start in range(0, p.seqlen_q, c):
        rows = slice(start, min(start + c, p.seqlen_q))
        qc = _heads_first(q[:, rows], p, True, dt)  # (B, Hkv, G, C, D)
        doc = _heads_first(dout[:, rows], p, True, dt)  # (B, Hkv, G, C, Dv)
        oc = _heads_first(out[:, rows], p, True, dt)  # (B, Hkv, G, C, Dv)
        lc = lse_safe[:, :, rows].reshape(p.batch, p.heads_kv, p.group_size, -1, 1)  # (..., C, 1)
        s, tanh = _scores(qc, kh, p, _visible(p, rows, q.device))  # (B, Hkv, G, C, Nk)
        prob = torch.exp(s - lc)  # (B, Hkv, G, C, Nk)
        dv += (prob.transpose(-1, -2) @ doc).sum(dim=2, keepdim=True)  # (B, Hkv, 1, Nk, Dv)
        dp = doc @ vh.transpose(-1, -2)  # (B, Hkv, G, C, Nk)
        delta = (doc * oc).sum(dim=-1, keepdim=True)  # (B, Hkv, G, C, 1) = rowsum(dO ∘ O)
        if dlse is not None:  # d lse_i / d s_ij = P_ij
            delta = delta - dlse[:, :, rows].to(dt).reshape(delta.shape)
        ds = prob * (dp - delta)  # (B, Hkv, G, C, Nk): d loss / d s (capped, scaled)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)  # through softcap·tanh(x / softcap)
        ds = ds * p.scale  # through the scale: now d loss / d (q·kᵀ)
        dqc = ds @ kh  # (B, Hkv, G, C, D)
        dk += (ds.transpose(-1, -2) @ qc).sum(dim=2, keepdim=True)  # (B, Hkv, 1, Nk, D)
        dq[:, rows] = dqc.reshape(p.batch, p.heads_q, -1, p.head_dim).transpose(1, 2).to(dq.dtype)
    dk = dk.squeeze(2).transpose(1, 2).to(k.dtype)  # (B, Nk, Hkv, D)
    dv = dv.squeeze(2).transpose(1, 2).to(v.dtype)  # (B, Nk, Hkv, Dv)
    return dq, dk, dv


# Packed sequences and KV-cache attention: the same kernel per sequence (docs/inference.md).
from flashsuite.dispatch.portable_inference import (  # noqa: E402
    kvcache_forward,
    supports_kvcache,
    supports_varlen,
    varlen_backward,
    varlen_forward,
)

__all__ = [
    "HAS_BACKWARD",
    "NAME",
    "available",
    "backward",
    "forward",
    "kvcache_forward",
    "supports",
    "supports_kvcache",
    "supports_varlen",
    "varlen_backward",
    "varlen_forward",
]
