"""Rotary position embedding (RoPE) of q and k at given token positions, as flash-attn's
`flash_attn_with_kvcache` applies it before attending (`dispatch.flash_attn`).

cos and sin are tables (seqlen_ro, rotary_dim / 2): row p holds the angles' cosines and sines
of position p. The first rotary_dim dims of each head rotate, the rest pass through. In the
interleaved (GPT-J) form dims 2i and 2i + 1 form a pair; otherwise (GPT-NeoX) dims i and
i + rotary_dim / 2. The maths runs in float32 and rounds once to x's dtype, as a fused kernel
would; plain PyTorch ops, so any device.
"""

from __future__ import annotations

import torch


def apply_rotary(
    x: torch.Tensor,  # (B, N, H, D)
    cos: torch.Tensor,  # (seqlen_ro, rotary_dim / 2)
    sin: torch.Tensor,  # (seqlen_ro, rotary_dim / 2)
    positions: torch.Tensor,  # (B, N) int64, each in [0, seqlen_ro)
    interleaved: bool,
) -> torch.Tensor:
    """x with its first rotary_dim dims rotated by the angles of `positions`: each pair
    (a, b) becomes (a·cos − b·sin, a·sin + b·cos). A new tensor (B, N, H, D) of x's dtype."""
    rd = 2 * cos.shape[1]
    c = cos[positions].float()[:, :, None]  # (B, N, 1, rd / 2)
    s = sin[positions].float()[:, :, None]
    xr = x[..., :rd].float()
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)
