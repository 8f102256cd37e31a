"""The oracle: exact attention in plain PyTorch, materialising the full score matrix.

This is the specification every version is tested against. It is written for reading, not
speed: every line carries the shape of what it makes. It supports every option of the API
(bottom-right causal, sliding window, softcap, GQA/MQA, Dv != D, custom scale, LSE, fully
masked rows) and computes in float32 by default or float64 for gradcheck. Kernels never
import it; tests and benchmarks do.

Shapes: B batch, Nq/Nk query/key length, Hq/Hkv query/key-value heads, G = Hq // Hkv,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import math

import torch


def visibility_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool (Nq, Nk): True where query i may attend key j (bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)  # (Nq, 1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)  # (1, Nk)
    diag = i + (seqlen_k - seqlen_q)  # (Nq, 1): the key aligned with query i
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)  # (Nq, Nk)
    if right >= 0:
        visible &= j <= diag + right  # (Nq, Nk)
    if left >= 0:
        visible &= j >= diag - left  # (Nq, Nk)
    return visible


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out (B, Nq, Hq, Dv) in `compute_dtype`, lse (B, Hq, Nq) natural log, float32
    (float64 when `compute_dtype` is float64).

    `compute_dtype=None` computes in the inputs' own dtype: that is "PyTorch's own error", the
    yardstick the tests measure kernels against. Rows that see no key give out 0, LSE -inf.
    Differentiable: autograd through it is the gradient oracle.
    """
    _, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dtype = compute_dtype if compute_dtype is not None else q.dtype
    if q.dtype == torch.float8_e4m3fn:  # FP8: dequantise per (batch, kv head) or per block
        from flashsuite.common.fp8 import dequantised

        q = dequantised(q, descale_q, g)  # (B, Nq, Hq, D)
        k = dequantised(k, descale_k)  # (B, Nk, Hkv, D)
        v = dequantised(v, descale_v)  # (B, Nk, Hkv, Dv)
        if compute_dtype is None:
            dtype = torch.float32
    qh = q.to(dtype).transpose(1, 2)  # (B, Hq, Nq, D)
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(g, dim=1)  # (B, Hq, Nk, D)
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(g, dim=1)  # (B, Hq, Nk, Dv)
    s = (qh @ kh.transpose(-1, -2)) * scale  # (B, Hq, Nq, Nk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)  # (B, Hq, Nq, Nk)
    visible = visibility_mask(nq, nk, causal=causal, window_size=window_size, device=q.device)
    s = s.masked_fill(~visible, float("-inf"))  # (B, Hq, Nq, Nk)
    # (B, Hq, Nq), -inf where the row sees nothing; float64 when computing in float64
    lse = torch.logsumexp(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1)
    m = s.amax(dim=-1, keepdim=True)  # (B, Hq, Nq, 1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # (B, Hq, Nq, 1): no -inf - -inf
    p = torch.exp(s - m)  # (B, Hq, Nq, Nk), 0 where masked
    denom = p.sum(dim=-1, keepdim=True)  # (B, Hq, Nq, 1)
    p = p / torch.where(denom == 0, torch.ones_like(denom), denom)  # (B, Hq, Nq, Nk)
    out = p @ vh  # (B, Hq, Nq, Dv)
    return out.transpose(1, 2), lse  # (B, Nq, Hq, Dv), (B, Hq, Nq)
