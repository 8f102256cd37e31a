"""Rotary embedding of q and the new k for a KV-cache call in one Triton launch: what
`dispatch.flash_attn_with_kvcache` runs with rotary tables, on a GPU or under the Triton
interpreter.

`common.rotary.apply_rotary` is the reference: the tests hold this kernel to it (bit for bit
under the interpreter, which rounds each float32 product as PyTorch does; a compiled kernel may
fuse a product and a difference into one FMA, so within one rounding of bf16 there), and it is
the path taken where Triton cannot run. With PyTorch ops the rotation of q and k is about a
dozen kernel launches each per decode step (gathers of the tables, the float32 products, the
concatenation); this is one.

Program (row b, token t) of the grid (B * (Nq + Nnew), max(Hq, Hkv)) rotates q[b, t, h] when
t < Nq, else k[b, t − Nq, h], at the token's position: new key j at cache_seqlens[b] + j;
query i at cache_seqlens[b] + i when `local` (causal or windowed), else at cache_seqlens[b].
Positions are clamped into the tables' rows, so a length that the value checks refuse later
(or never, with FLASHSUITE_CHECK_METADATA=0) reads no row outside them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arch import triton_interpreter
from .rotary import apply_rotary
from .triton_launch import launch, next_power_of_2


@triton.jit
def _rotate_qk(
    Q,  # (B, Nq, Hq, D)
    K,  # (B, Nnew, Hkv, D)
    QO,  # (B, Nq, Hq, D), contiguous: rotated q
    KO,  # (B, Nnew, Hkv, D), contiguous: rotated k
    Cos,  # (seqlen_ro, rotary_dim / 2)
    Sin,  # (seqlen_ro, rotary_dim / 2)
    Lens,  # (B,) int32 when LENS_TENSOR, else unused
    len_value,  # every row's length when not LENS_TENSOR
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_cos,
    stride_sin,
    n_q,
    n_new,
    h_q,
    h_kv,
    top,  # seqlen_ro - 1: the last row of the tables
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM
    HALF: tl.constexpr,  # rotary_dim / 2
    HALF_PAD: tl.constexpr,  # next power of 2 of HALF
    INTERLEAVED: tl.constexpr,  # GPT-J pairs (2i, 2i + 1), else GPT-NeoX halves (i, i + HALF)
    LOCAL: tl.constexpr,  # queries at their own positions (causal or windowed)
    LENS_TENSOR: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    per_row = n_q + n_new
    b = pid // per_row
    t = pid - b * per_row
    is_q = t < n_q
    if is_q:
        heads = h_q
    else:
        heads = h_kv
    if h < heads:
        if LENS_TENSOR:
            start = tl.load(Lens + b)
        else:
            start = len_value
        if is_q:
            pos = start
            if LOCAL:
                pos = start + t
            src = Q + b.to(tl.int64) * stride_qb + t.to(tl.int64) * stride_qn + h * stride_qh
            dst = QO + ((b.to(tl.int64) * n_q + t) * h_q + h) * HEAD_DIM
        else:
            j = t - n_q
            pos = start + j
            src = K + b.to(tl.int64) * stride_kb + j.to(tl.int64) * stride_kn + h * stride_kh
            dst = KO + ((b.to(tl.int64) * n_new + j) * h_kv + h) * HEAD_DIM
        pos = tl.minimum(tl.maximum(pos, 0), top).to(tl.int64)
        i = tl.arange(0, HALF_PAD)
        m = i < HALF
        if INTERLEAVED:
            ia = 2 * i
            ib = 2 * i + 1
        else:
            ia = i
            ib = i + HALF
        c = tl.load(Cos + pos * stride_cos + i, mask=m).to(tl.float32)
        s = tl.load(Sin + pos * stride_sin + i, mask=m).to(tl.float32)
        a = tl.load(src + ia, mask=m).to(tl.float32)
        bb = tl.load(src + ib, mask=m).to(tl.float32)
        tl.store(dst + ia, (a * c - bb * s).to(QO.dtype.element_ty), mask=m)
        tl.store(dst + ib, (a * s + bb * c).to(QO.dtype.element_ty), mask=m)
        d = tl.arange(0, D_PAD)
        rest = (d >= 2 * HALF) & (d < HEAD_DIM)
        tl.store(dst + d, tl.load(src + d, mask=rest), mask=rest)


def rotate_qk(
    q: torch.Tensor,  # (B, Nq, Hq, D)
    k: torch.Tensor,  # (B, Nnew, Hkv, D)
    cos: torch.Tensor,  # (seqlen_ro, rotary_dim / 2)
    sin: torch.Tensor,  # (seqlen_ro, rotary_dim / 2)
    cache_seqlens: torch.Tensor | int,  # (B,) int32, or one length for every row
    local: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated at a KV-cache call's positions (module docstring): new tensors of q's
    and k's shapes and dtypes. By `_rotate_qk` where Triton can run it (CUDA tensors, or the
    interpreter), q and k share a dtype, every tensor has a unit last stride and a lengths
    tensor is int32 on q's device; else by apply_rotary on the same clamped positions (the
    lengths' own checks come after, in attention_with_kvcache)."""
    b, nq, hq, d = q.shape
    n_new, hkv = k.shape[1], k.shape[2]
    tensor_lens = torch.is_tensor(cache_seqlens)
    runs = (q.is_cuda or triton_interpreter()) and q.dtype == k.dtype
    runs = runs and all(t.stride(-1) == 1 for t in (q, k, cos, sin))
    if tensor_lens:  # the kernel reads them: never a pointer of another device or dtype
        runs = runs and cache_seqlens.dtype == torch.int32 and cache_seqlens.device == q.device
    if not runs or b * (nq + n_new) == 0 or max(hq, hkv) == 0:
        return _rotate_torch(q, k, cos, sin, cache_seqlens, local, interleaved)
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    lens = cache_seqlens.contiguous() if tensor_lens else q_out
    half = cos.shape[1]
    launch(_rotate_qk, (b * (nq + n_new), max(hq, hkv)), (
        q, k, q_out, k_out, cos, sin, lens, 0 if tensor_lens else int(cache_seqlens),
        *q.stride()[:3], *k.stride()[:3], cos.stride(0), sin.stride(0), nq, n_new, hq, hkv,
        cos.shape[0] - 1,
    ), dict(
        HEAD_DIM=d, D_PAD=next_power_of_2(d), HALF=half,
        HALF_PAD=next_power_of_2(half), INTERLEAVED=bool(interleaved),
        LOCAL=bool(local), LENS_TENSOR=tensor_lens, num_warps=1,
    ))  # fmt: skip
    return q_out, k_out


def _rotate_torch(q, k, cos, sin, cache_seqlens, local: bool, interleaved: bool):
    """The same rotation by apply_rotary (PyTorch ops, any device)."""
    b, nq, n_new = q.shape[0], q.shape[1], k.shape[1]
    lens = cache_seqlens
    if not torch.is_tensor(lens):
        lens = torch.full((b,), int(lens), dtype=torch.int64, device=q.device)
    start = lens.to(device=q.device, dtype=torch.int64)[:, None]  # (B, 1)
    steps = torch.arange(max(nq, n_new), device=q.device)
    q_pos = start + steps[:nq] if local else start.expand(b, nq)
    top = cos.shape[0] - 1
    q_pos, k_pos = q_pos.clamp(0, top), (start + steps[:n_new]).clamp(0, top)
    return (apply_rotary(q, cos, sin, q_pos, interleaved),
            apply_rotary(k, cos, sin, k_pos, interleaved))  # fmt: skip
