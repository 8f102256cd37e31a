"""PyTorch's own SDPA as the route for problems no flashsuite kernel takes on a GPU.

On an sm80+ GPU, a problem that none of the architecture's kernels supports (a head_dim
outside their tile tables, such as 80 or 160) would otherwise run the portable "torch"
version, which is exact but blocked in plain PyTorch ops (4.7 ms for B 2, N 2k, H 16, D 80,
causal on the H200). `torch.nn.functional.scaled_dot_product_attention` picks its fastest
backend for such inputs instead (FlashAttention-2, memory-efficient or cuDNN), so auto
selection tries it after the kernels and before the portable version; `explain()` shows it as
the candidate "sdpa". It is a route, not a version: an explicit `version=` never takes it.

It keeps the `attention` contract where it applies: layout (B, N, H, D), bottom-right causal,
GQA, a row that sees no key gives 0. What it cannot do is said by `supports`: no LSE (SDPA does
not return it), no sliding window and no softcap (SDPA expresses neither without a dense
mask), no float8, and only inputs that one of SDPA's fused backends takes (otherwise SDPA would
run its math backend, which materialises the (Nq, Nk) scores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_scalar

from flashsuite.common.validation import AttnParams

NAME = "sdpa"
_HALF = (torch.float16, torch.bfloat16)


def supports(p: AttnParams, arch: int | None, return_lse: bool) -> tuple[bool, str]:
    """Whether PyTorch's SDPA takes problem `p` within the `attention` contract. Auto selection
    asks on sm80+ only (`api.auto_order`), where SDPA's fused backends cover 16-bit inputs."""
    if return_lse:
        return False, "sdpa: PyTorch's SDPA does not return the log-sum-exp (return_lse=True)"
    if p.is_fp8 or p.dtype not in (*_HALF, torch.float32):
        dt = str(p.dtype).removeprefix("torch.")
        return False, f"sdpa: dtype {dt} not in (float16, bfloat16, float32)"
    if p.softcap > 0:
        return False, "sdpa: PyTorch's SDPA has no softcap"
    if p.is_local:
        return False, "sdpa: a sliding window needs a dense mask in PyTorch's SDPA"
    if p.dtype in _HALF and p.head_dim == p.head_dim_v:
        return True, "sdpa: PyTorch's SDPA (FlashAttention-2 or cuDNN for these inputs)"
    if p.head_dim % 8 or p.head_dim_v % 8 or p.heads_q != p.heads_kv:
        return False, (
            "sdpa: only PyTorch's math backend takes these inputs (float32 or Dv != D need "
            "head dims that are multiples of 8 and no GQA for the memory-efficient one)"
        )
    return True, "sdpa: PyTorch's SDPA (memory-efficient backend for these inputs)"


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    """out (B, Nq, Hq, Dv), contiguous, differentiable through PyTorch's own autograd.

    q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv); `causal` is bottom-right aligned.
    """
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, D) views
    nq, nk = q.shape[1], k.shape[1]
    gqa = guard_scalar(q.shape[2] != k.shape[2])  # a bool (guarded when the heads are symbolic)
    if not causal or nq == nk:  # square: top-left and bottom-right causal agree
        out = F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    elif nq > nk:
        # The first Nq - Nk rows see no key (output 0); the last Nk rows are a square causal
        # problem against all keys.
        tail = F.scaled_dot_product_attention(
            qt[:, :, nq - nk :], kt, vt, is_causal=True, scale=scale, enable_gqa=gqa
        )  # (B, Hq, Nk, Dv)
        head = tail.new_zeros(tail.shape[0], tail.shape[1], nq - nk, tail.shape[3])
        out = torch.cat([head, tail], dim=2)  # (B, Hq, Nq, Dv)
    else:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=_lower_right(nq, nk, q.device), scale=scale, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous()  # (B, Nq, Hq, Dv)


def _lower_right(nq: int, nk: int, device: torch.device) -> torch.Tensor:
    """Bottom-right causal visibility for Nq < Nk: PyTorch's `causal_lower_right` bias in eager
    (SDPA runs it without a mask tensor); under torch.compile, which cannot build that tensor
    subclass, the (Nq, Nk) boolean mask it stands for."""
    if not torch.compiler.is_compiling():
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(nq, nk)
    i = torch.arange(nq, device=device).unsqueeze(1)  # (Nq, 1)
    j = torch.arange(nk, device=device).unsqueeze(0)  # (1, Nk)
    return j <= i + (nk - nq)  # (Nq, Nk): key j visible to query i
