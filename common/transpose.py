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
    col = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # Y's columns, stored along the keys
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    n = col
    if PERMUTE:
        # column 32 blk + 16 h + 4 t + 2 a + c holds key 32 blk + 16 h + 8 a + 2 t + c: the
        # program gathers its key rows (each D contiguous bytes) and stores whole columns
        r = col % 32
        n = col - r + (r // 16) * 16 + ((r // 2) % 2) * 8 + ((r // 4) % 4) * 2 + r % 2
    mask = (n[:, None] < n_keys) & (d[None, :] < head_dim)
    src = X + b * stride_xb + h * stride_xh + n[:, None].to(tl.int64) * stride_xn + d[None, :]
    tile = tl.load(src, mask=mask, other=0)
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
    if not _triton_runs(x, out) or (n > 1 and out.stride(1) != 1):
        out.copy_(x)
        return out
    _launch(_bytes(x), _bytes(out).permute(0, 2, 3, 1), n, n, False)
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
    if 0 in (b, n, h, d) or not _triton_runs(x, out):
        src = _bytes(x)
        if n32 != n:
            src = torch.nn.functional.pad(src, (0, 0, 0, 0, 0, n32 - n))  # zero keys past N
        keys = src.reshape(b, n32 // 32, 2, 2, 4, 2, h, d)  # (B, blk, h, a, t, c, H, D)
        _bytes(out).view(b, h, d, n32 // 32, 2, 4, 2, 2).copy_(keys.permute(0, 6, 7, 1, 2, 4, 3, 5))
        return out
    _launch(_bytes(x), _bytes(out), n, n32, True)
    return out


def _triton_runs(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `_keys_major_copy` can copy x into out: both on a GPU, or both on the CPU under
    the interpreter, and x's head dim contiguous."""
    on_gpu = x.is_cuda and out.is_cuda
    on_cpu = triton_interpreter() and not (x.is_cuda or out.is_cuda)
    return (on_gpu or on_cpu) and (x.size(3) <= 1 or x.stride(3) == 1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 as its bytes (what Triton copies); other dtypes as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _launch(src: torch.Tensor, yt: torch.Tensor, n: int, n_out: int, permute: bool) -> None:
    """`_keys_major_copy` from src (B, N, H, D) into yt (B, H, D, n_out), keys contiguous."""
    b, _, h, d = src.shape
    grid = (-(-n_out // BLOCK_N), b * h, -(-d // BLOCK_D))  # ceil division on host ints
    launch(_keys_major_copy, grid, (
        src, yt, src.stride(0), src.stride(1), src.stride(2), yt.stride(0), yt.stride(1),
        yt.stride(2), n, n_out, h, d,
    ), dict(BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PERMUTE=permute, num_warps=4))  # fmt: skip
