"""The copy of a (B, N, H, D) tensor into the keys-major layout (keys contiguous) in one Triton
launch: fp8 V into the Vᵀ fa3's forward reads (`fa3.interface.transpose_v`), and
`common.fp8.keys_major`. On a GPU or under the Triton interpreter.

PyTorch's `out.copy_(x)` between these layouts is the reference (the tests hold this kernel
to it bit for bit) and the path taken where Triton cannot run. On an H100 that copy moves
0.29-0.31 TB/s for byte elements (215-229 us for the 64 MiB read and written at B·N = 16k,
Hkv·D = 2048); this kernel loads a tile of BLOCK_N keys by BLOCK_D channels along the channels
and stores its transpose along the keys: 29-32 us there, 2.1-2.3 TB/s (docs/fp8.md, "The Vᵀ
copy"; benchmarks/keys_major_copy_bench.py).

Program (key block, batch · head, channel block) of the grid loads x[b, n0:n0 + BLOCK_N, h,
d0:d0 + BLOCK_D] (rows along the channels) and stores its transpose to out[b, h, d0:, n0:]
(rows along the keys); keys past N and channels past D are masked, so nothing is read or
written outside either tensor. `transpose_keys_permuted` runs the same program with the keys
permuted within 32-key blocks (fa3's permute_v_keys Vᵀ), writing zeros for the keys of the
last block past N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arch import triton_interpreter
from .triton_launch import launch

BLOCK_N = 128  # keys per program
BLOCK_D = 64  # channels per program


@triton.jit
def _keys_major_copy(
    X,  # (B, N, H, D), unit last stride
    Y,  # (B, H, D, N) view, unit last stride (keys contiguous)
    stride_xb,
    stride_xn,
    stride_xh,
    stride_yb,
    stride_yh,
    stride_yd,
    n_keys,
    n_out,  # Y's keys: n_keys, or n_keys rounded up to 32 with PERMUTE (zeros past n_keys)
    heads,
    head_dim,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PERMUTE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (n[:, None] < n_keys) & (d[None, :] < head_dim)
    src = X + b * stride_xb + h * stride_xh + n[:, None].to(tl.int64) * stride_xn + d[None, :]
    tile = tl.load(src, mask=mask, other=0)
    col = n
    if PERMUTE:
        # key 32 blk + 16 h + 8 a + 2 t + c goes to column 32 blk + 16 h + 4 t + 2 a + c
        r = n % 32
        col = n - r + (r // 16) * 16 + ((r // 2) % 4) * 4 + ((r // 8) % 2) * 2 + r % 2
    dst = Y + b * stride_yb + h * stride_yh + d[:, None].to(tl.int64) * stride_yd + col[None, :]
    keep = (col[None, :] < n_out) & (d[:, None] < head_dim)  # the zeros past n_keys too
    tl.store(dst, tl.trans(tile), mask=keep)


def keys_major_copy(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy x (B, N, H, D) into out, a (B, N, H, D) tensor of the same shape and dtype laid out
    keys-major (out.stride(1) == 1, e.g. `common.fp8.keys_major_empty`); returns out.

    By `_keys_major_copy` where Triton can run it (CUDA tensors, or the interpreter), x's last
    stride is 1 and out's key stride is 1; else by `out.copy_(x)`. float8 tensors are copied
    as their bytes."""
    if x.shape != out.shape or x.dtype != out.dtype or x.dim() != 4:
        raise ValueError(
            f"out: expected a 4-d tensor of x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    b, n, h, d = x.shape
    if 0 in (b, n, h, d):
        return out
    runnable = (x.is_cuda and out.is_cuda) or (triton_interpreter() and not out.is_cuda)
    if not runnable or (d > 1 and x.stride(3) != 1) or (n > 1 and out.stride(1) != 1):
        out.copy_(x)
        return out
    src, dst = x, out
    if x.element_size() == 1:  # float8: Triton copies the bytes
        src, dst = x.view(torch.uint8), out.view(torch.uint8)
    _launch(src, dst.permute(0, 2, 3, 1), n, n, False)
    return out


def transpose_keys_permuted(x: torch.Tensor) -> torch.Tensor:
    """x (B, N, H, D) with a unit last stride -> (B, H, D, N32), N32 = N rounded up to 32, the
    keys contiguous and permuted within each 32-key block: column 32 blk + 16 h + 4 t + 2 a + c
    holds key 32 blk + 16 h + 8 a + 2 t + c (fa3's `fp8_ops.slot_key` order, its
    Fa3Config.permute_v_keys Vᵀ), zeros past N. One `_keys_major_copy` launch where Triton can
    run it; PyTorch's strided copy through that index view otherwise. float8 as bytes."""
    b, n, h, d = x.shape
    n32 = -(-n // 32) * 32
    out = torch.empty((b, h, d, n32), dtype=x.dtype, device=x.device)
    runnable = x.is_cuda or triton_interpreter()
    if 0 in (b, n, h, d) or not runnable or (d > 1 and x.stride(3) != 1):
        src = x.view(torch.uint8) if x.element_size() == 1 else x
        if n32 != n:
            src = torch.nn.functional.pad(src, (0, 0, 0, 0, 0, n32 - n))  # zero keys past N
        keys = src.reshape(b, n32 // 32, 2, 2, 4, 2, h, d)  # (B, blk, h, a, t, c, H, D)
        dst = out.view(torch.uint8) if x.element_size() == 1 else out
        dst.view(b, h, d, n32 // 32, 2, 4, 2, 2).copy_(keys.permute(0, 6, 7, 1, 2, 4, 3, 5))
        return out
    src, dst = x, out
    if x.element_size() == 1:
        src, dst = x.view(torch.uint8), out.view(torch.uint8)
    _launch(src, dst, n, n32, True)
    return out


def _launch(src: torch.Tensor, yt: torch.Tensor, n: int, n_out: int, permute: bool) -> None:
    """`_keys_major_copy` from src (B, N, H, D) into yt (B, H, D, n_out), keys contiguous."""
    b, _, h, d = src.shape
    grid = (triton.cdiv(n_out, BLOCK_N), b * h, triton.cdiv(d, BLOCK_D))
    launch(_keys_major_copy, grid, (
        src, yt, src.stride(0), src.stride(1), src.stride(2), yt.stride(0), yt.stride(1),
        yt.stride(2), n, n_out, h, d,
    ), dict(BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PERMUTE=permute, num_warps=4))  # fmt: skip
