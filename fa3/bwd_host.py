"""Host side of the fa3 backward: compile cache, pre/postprocess and the launch.

`BwdCompileKey` holds only what changes the generated code (dtype, head_dim, causal, local,
softcap, varlen, tile config, arch); batch, sequence lengths, head counts and strides are
symbolic in the fake tensors the kernel is compiled from, so new shapes never recompile. The
binary is built with `--enable-tvm-ffi` and takes torch tensors on torch's current stream.

Pre- and postprocess are memory-bound kernels: the preprocess writes D = rowsum(dO * O) and
LSE * log2(e) in float32, padded to whole row blocks (+inf LSE and 0 on padding rows: the kernel
reads them as P = 0), and zeroes the tile-ordered float32 dQ accumulator in the same launch (the
"atomic" route's is zeroed by torch); the postprocess turns the tile-ordered accumulator of
dq_mode "warp" or "red" into dQ in the input dtype in one pass, writing the real rows only (the
softmax scale is folded into dS inside the kernel, or with BwdConfig.scale_out applied there).
Dense problems on a GPU take the CuTe DSL pair of fa3/bwd_prepost.py (`CUTE_PREPOST`), cached
like the main kernel, so a dense backward launches no Triton kernel (a fresh process's first
backward pays neither Triton's per-process cache key nor its compiler's imports); packed
sequences take the Triton pair shared through common/ (bwd_preprocess.py, bwd_postprocess.py),
imported when first used.

Packed sequences (`run_varlen_backward`, fa3/bwd_varlen.py): LSE, D and the tile-ordered dQ
accumulator in the padded row layout of common/bwd_preprocess.py (`varlen_bwd_preprocess`);
the postprocess writes each sequence's rows back to their packed place.

The binary is cached like the forward's (`compile.cached`: in memory, then on disk) and called
with every parameter positionally, as a binary loaded from disk takes them. The CuTe DSL is
imported only to compile; `CUTE_DSL_*` environment settings are read when `cutlass.cute` is
first imported (set `CUTE_DSL_ARCH=sm_90a` before the first compile on a machine without a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from flashsuite.fa3 import bwd_prepost
from flashsuite.fa3.bwd_configs import BwdConfig, bwd_smem_bytes, dq_tiled
from flashsuite.fa3.compile import (
    cached,
    check_storage,
    compile_options,
    cutlass_dtype,
    kernel_scalars,
)

LOG2E = math.log2(math.e)
# The dense backward's pre- and postprocess on a GPU: the CuTe DSL kernels of bwd_prepost (True)
# or the shared Triton ones (False).
CUTE_PREPOST = True


@dataclass(frozen=True)
class BwdCompileKey:
    """Everything that changes the generated code of one backward kernel."""

    dtype: torch.dtype
    head_dim: int
    causal: bool
    cfg: BwdConfig
    local: bool = False  # sliding window (runtime window_left / window_right)
    softcap: bool = False  # scores softcap * tanh(s * scale / softcap); needs overlap False
    arch: str = "sm_90a"
    # Packed sequences: q, dout (total_q, Hq, D), k, v, dk, dv (total_k, Hkv, D), cu_seqlens_q/k
    # (B + 1,) int32, lse_log2 / dsum (Hq, rows_pad), the tiled dQ accumulator (Hq, rows_pad, D)
    # ("atomic": (total_q, Hq, D)).
    varlen: bool = False
    tvm_ffi: bool = True


def _fake_inputs(key: BwdCompileKey) -> tuple:
    """Fake q, k, v, dout, lse_log2, dsum, dq_acc, dk, dv with symbolic sizes and strides, and
    the dQ turn counters (B, Hq, row blocks) int32 when the config is deterministic (else None:
    the default build's kernel has no such parameter)."""
    import cutlass
    import cutlass.cute as cute

    dt = cutlass_dtype(key.dtype)
    d = key.head_dim
    b, nq, nk, hq, hkv, nq_pad = (cute.sym_int() for _ in range(6))
    elems_16b = 16 // (dt.width // 8)  # TMA: outer strides are multiples of 16 bytes

    def strided(n: Any, h: Any) -> Any:
        stride = (*(cute.sym_int64(divisibility=elems_16b) for _ in range(3)), 1)
        return cute.runtime.make_fake_tensor(dt, (b, n, h, d), stride=stride, assumed_align=16)

    def compact(dtype: Any, n: Any, h: Any) -> Any:
        return cute.runtime.make_fake_compact_tensor(
            dtype, (b, n, h, d), stride_order=(3, 2, 1, 0), assumed_align=16
        )

    def stats() -> Any:  # (B, Hq, Nq_pad) fp32, rows padded to whole row blocks
        stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1)
        return cute.runtime.make_fake_tensor(
            cutlass.Float32, (b, hq, nq_pad), stride=stride, assumed_align=16
        )

    q, k, v, do = strided(nq, hq), strided(nk, hkv), strided(nk, hkv), strided(nq, hq)
    dq_acc = compact(cutlass.Float32, nq, hq)
    if dq_tiled(key.cfg):  # (B, Hq, Nq_pad, D): whole row blocks in tile order
        dq_acc = cute.runtime.make_fake_compact_tensor(
            cutlass.Float32, (b, hq, nq_pad, d), stride_order=(3, 2, 1, 0), assumed_align=16
        )
    dk, dv = compact(dt, nk, hkv), compact(dt, nk, hkv)
    sem = None
    if key.cfg.deterministic:
        sem = cute.runtime.make_fake_compact_tensor(
            cutlass.Int32, (b, hq, cute.sym_int()), stride_order=(2, 1, 0), assumed_align=4
        )
    return q, k, v, do, stats(), stats(), dq_acc, dk, dv, sem


def _fake_varlen_inputs(key: BwdCompileKey) -> tuple:
    """Fake packed q, k, v, dout, lse_log2, dsum, dq_acc, dk, dv, the dQ turn counters (Hq,
    rows_pad / TILE_M) int32 when the config is deterministic (else None), and cu_seqlens_q/k:
    symbolic totals, batch and heads, 16-byte-aligned 64-bit strides (the ragged views move the
    base pointer back 2^30 rows; the accumulator and dK / dV offsets may pass 2^31 elements)."""
    import cutlass
    import cutlass.cute as cute

    dt = cutlass_dtype(key.dtype)
    d = key.head_dim
    tq, tk, hq, hkv, rows_pad, b1 = (cute.sym_int() for _ in range(6))
    elems_16b = 16 // (dt.width // 8)

    def rows(dtype: Any, n: Any, h: Any, align: int) -> Any:  # (tokens, heads, D), D contiguous
        stride = (*(cute.sym_int64(divisibility=align) for _ in range(2)), 1)
        return cute.runtime.make_fake_tensor(dtype, (n, h, d), stride=stride, assumed_align=16)

    def stats() -> Any:  # (Hq, rows_pad) fp32
        stride = (cute.sym_int64(divisibility=4), 1)
        return cute.runtime.make_fake_tensor(
            cutlass.Float32, (hq, rows_pad), stride=stride, assumed_align=16
        )

    q, k, v, do = (rows(dt, n, h, elems_16b) for n, h in ((tq, hq), (tk, hkv), (tk, hkv), (tq, hq)))
    dq_acc = rows(cutlass.Float32, tq, hq, 4)  # "atomic": (total_q, Hq, D)
    if dq_tiled(key.cfg):  # (Hq, rows_pad, D): whole row blocks in tile order
        dq_acc = rows(cutlass.Float32, hq, rows_pad, 4)
    dk, dv = rows(dt, tk, hkv, elems_16b), rows(dt, tk, hkv, elems_16b)
    cu_q, cu_k = (
        cute.runtime.make_fake_compact_tensor(cutlass.Int32, (b1,), assumed_align=4)
        for _ in range(2)
    )  # (B + 1,) each
    sem = None  # deterministic: turn counters (Hq, rows_pad / TILE_M), one per padded row block
    if key.cfg.deterministic:
        sem = cute.runtime.make_fake_compact_tensor(
            cutlass.Int32, (hq, cute.sym_int()), stride_order=(1, 0), assumed_align=4
        )
    return q, k, v, do, stats(), stats(), dq_acc, dk, dv, sem, cu_q, cu_k


def compile_backward(key: BwdCompileKey, extra_options: str = "") -> Any:
    """Build one backward binary (no cache). `extra_options` are appended to cute.compile's."""
    import cutlass
    import cutlass.cute as cute

    from flashsuite.fa3.bwd_kernel import Fa3Backward

    kernel = Fa3Backward(
        cutlass_dtype(key.dtype),
        key.head_dim,
        key.cfg,
        key.causal,
        key.softcap,
        key.local,
        varlen=key.varlen,
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi)
    if key.varlen:
        *tensors, sem, cu_q, cu_k = _fake_varlen_inputs(key)
    else:
        *tensors, sem = _fake_inputs(key)
    # Trailing optional parameters: the turn counters, softcap_pre (softcap builds), then
    # window_left and window_right (local builds), then cu_seqlens_q / _k (varlen builds).
    extra = () if sem is None else (sem,)
    if key.softcap or key.local or key.varlen:
        extra = (sem, cutlass.Float32(1.0) if key.softcap else None)
    if key.local or key.varlen:
        window = (cutlass.Int32(0), cutlass.Int32(0)) if key.local else (None, None)
        extra = (*extra, *window)
    if key.varlen:
        extra = (*extra, cu_q, cu_k)
    compiled = cute.compile(
        kernel,
        *tensors,
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        stream,
        *extra,
        options=compile_options(key.arch, key.tvm_ffi, extra_options),
    )
    check_storage(kernel, bwd_smem_bytes(key.cfg, key.head_dim), f"backward {key.cfg}")
    return compiled


def get_backward(key: BwdCompileKey) -> Any:
    """The cached binary for `key`, compiled on first use (thread-safe)."""
    return cached(key, compile_backward)


def preprocess(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, tile_m: int, dq_d: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lse_log2, dsum, dq_acc): lse_log2 and dsum (B, Hq, Nq_pad) float32 with Nq_pad a
    multiple of `tile_m`, by the shared Triton preprocess (common/bwd_preprocess.py); with
    dq_d > 0 also the zeroed float32 dQ accumulator in row blocks, (B, Hq, Nq_pad, dq_d),
    zeroed by the same launch (else None).

    lse_log2 = lse * log2(e), +inf for rows that see no key and for the padding rows (the kernel
    reads any infinite LSE as P = 0); dsum = rowsum(dout * out), 0 on padding rows. dout, out
    (B, Nq, Hq, D) with unit last stride; lse (B, Hq, Nq) float32, natural log.
    """
    from flashsuite.common.bwd_preprocess import BLOCK_M, bwd_preprocess

    b, nq, hq, _ = out.shape
    step = math.lcm(tile_m, BLOCK_M)
    nq_pad = -(-nq // step) * step
    dq_acc = None
    if dq_d:
        dq_acc = torch.empty(b, hq, nq_pad, dq_d, dtype=torch.float32, device=out.device)
    dsum, lse_log2 = bwd_preprocess(out, dout, lse, nq_pad, dq_acc)
    return lse_log2, dsum, dq_acc


def check_key(key: BwdCompileKey, softcap: float, window: tuple[int, int]) -> None:
    """A launch's softcap and window against what `key` was built for (before any work)."""
    if key.softcap != (softcap > 0):
        raise ValueError(f"fa3 backward: softcap {softcap} with a key built for {key.softcap}")
    if not key.local and tuple(window) != (-1, -1):
        raise ValueError(f"fa3 backward: window {tuple(window)} with a key built without one")


def launch_args(
    key: BwdCompileKey,
    tensors: tuple,
    scale: float,
    softcap: float,
    window: tuple[int, int],
    nq: int,
    nk: int,
    sem: torch.Tensor | None = None,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple:
    """Every parameter of a backward binary in its order (compile_backward's signature: the
    trailing optional ones are parameters of every build, passed as None where unused):
    `tensors` = (q, k, v, dout, lse_log2, dsum, dq_acc, dk, dv), scale_log2, scale, the dQ turn
    counters, softcap_pre, window_left, window_right, cu_seqlens_q, cu_seqlens_k. An unbounded
    window side becomes a bound no row reaches (nq + nk + 1: the totals of packed sequences);
    causal is right = 0. `check_key` has vetted softcap and window against the key."""
    scale_log2, softcap_pre = scale * LOG2E, None
    if key.softcap:  # tanh takes scale / softcap; exp2's scale becomes softcap * log2(e)
        scale_log2, softcap_pre = softcap * LOG2E, scale / softcap
    win = (None, None)
    if key.local:
        _, _, left, right = kernel_scalars(scale, 0.0, window, key.causal, nq, nk)
        win = (left, right)
    return (*tensors, scale_log2, scale, sem, softcap_pre, *win, *(cu_seqlens or (None, None)))


def turn_counters(
    key: BwdCompileKey,
    stats_shape: tuple,
    nq: int,
    nk: int,
    window: tuple[int, int],
    device: torch.device | str,
) -> torch.Tensor:
    """The deterministic build's dQ turn counters, (B, Hq, row blocks) int32 for stats of
    `stats_shape` (B, Hq, Nq_pad): each row block's counter starts at the first column block
    that visits it, whose add therefore goes first (docs/design.md, "Deterministic dQ").
    That is column block 0 without a left window edge (causal or not, a row block's column
    blocks run from 0); with one, row block m's first row sees keys from m * tile_m + (Nk -
    Nq) - left on, so its column blocks start at max(that, 0) // tile_n (the kernel's
    `row_blocks` ranges agree: tests/test_fa3_bwd_compile.py). A row block that no column
    block visits keeps an unread counter."""
    b, hq, nq_pad = stats_shape
    n_m = nq_pad // key.cfg.tile_m
    if not key.local:
        return torch.zeros(b, hq, n_m, dtype=torch.int32, device=device)
    _, _, left, _ = kernel_scalars(1.0, 0.0, window, key.causal, nq, nk)
    rows = torch.arange(n_m, dtype=torch.int64, device=device) * key.cfg.tile_m
    first = _first_column_block(rows, nk - nq, left, key.cfg.tile_n)
    return first.to(torch.int32).expand(b, hq, n_m).contiguous()


def _first_column_block(first_row, shift, left: int, tile_n: int):
    """The column block holding the first key a row block's first row `first_row` sees under
    a left window edge `left` (shift = Nk - Nq, per row block or one for all): max(first_row +
    shift - left, 0) // tile_n, elementwise on int64 tensors."""
    return (first_row + shift - left).clamp_min(0) // tile_n


def varlen_turn_counters(
    key: BwdCompileKey,
    heads_q: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    window: tuple[int, int],
    total_q: int,
    total_k: int,
) -> torch.Tensor:
    """`turn_counters` for packed sequences: (Hq, rows_pad / tile_m) int32, one counter per
    padded row block (bwd_varlen.py's layout: sequence b's row block m is block Q_b + m, Q_b =
    (cu_seqlens_q[b] + b tile_m) // tile_m), each at the first column block of its sequence
    that visits it, from the sequence's own lengths, computed on the device (no copy to the
    host). A block of padding keeps a counter no column block reads."""
    from flashsuite.common.bwd_preprocess import varlen_pad_rows

    tm, tn = key.cfg.tile_m, key.cfg.tile_n
    batch = cu_seqlens_q.shape[0] - 1
    n_blocks = varlen_pad_rows(total_q, batch, tm) // tm
    dev = cu_seqlens_q.device
    if not key.local:
        return torch.zeros(heads_q, n_blocks, dtype=torch.int32, device=dev)
    _, _, left, _ = kernel_scalars(1.0, 0.0, window, key.causal, total_q, total_k)
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    first_block = (cu_q[:-1] + torch.arange(batch, device=dev) * tm) // tm  # Q_b, increasing
    blocks = torch.arange(n_blocks, device=dev)
    seq = (torch.searchsorted(first_block, blocks, right=True) - 1).clamp_min(0)
    m = blocks - first_block[seq]
    shift = (cu_k[1:] - cu_k[:-1] - cu_q[1:] + cu_q[:-1])[seq]  # Nk_b - Nq_b
    first = _first_column_block(m * tm, shift, left, tn)
    return first.to(torch.int32).expand(heads_q, n_blocks).contiguous()


def run_backward(
    key: BwdCompileKey,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: tuple[int, int] = (-1, -1),
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (the input dtype, contiguous) for TMA-ready q, k, v, dout (B, N, H, D).
    `softcap` > 0 needs a key built with softcap=True, a `window` (left, right; -1 unbounded)
    other than (-1, -1) one built with local=True. `dlse` (B, Hq, Nq) float32, the gradient
    reaching the LSE, is taken off the preprocess's dsum (D = rowsum(dO ∘ O) - dlse)."""
    if key.varlen:
        raise ValueError("fa3 backward: a varlen key takes run_varlen_backward")
    check_key(key, softcap, window)
    _, nq, _, d = q.shape
    tiled = dq_tiled(key.cfg)  # row blocks in dq_tile_layout order, zeroed by the preprocess
    # The CuTe DSL pair runs on the GPU; CPU tensors (tests, through Triton's interpreter) take
    # the Triton pair.
    cute_pair = CUTE_PREPOST and q.is_cuda
    pre = bwd_prepost.preprocess if cute_pair else preprocess
    post = bwd_prepost.dq_from_tiles if cute_pair else dq_from_tiles
    pdl = {"pdl": True} if cute_pair and key.cfg.pdl else {}  # the Triton pair has no PDL
    lse_log2, dsum, dq_acc = pre(dout, out, lse, key.cfg.tile_m, d if tiled else 0, **pdl)
    if dlse is not None:  # d lse_i / d s_ij = P_ij
        dsum[:, :, :nq] -= dlse
    if not tiled:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, Nq, Hq, D)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # (B, Nk, Hkv, D)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # (B, Nk, Hkv, D)
    fn = get_backward(key)
    sem = None  # the trailing optional parameters, passed (as None where unused) every time
    if key.cfg.deterministic:  # one dQ turn counter per (batch, head, row block)
        sem = turn_counters(key, lse_log2.shape, nq, k.shape[1], window, q.device)
    tensors = (q, k, v, dout, lse_log2, dsum, dq_acc, dk, dv)
    fn(*launch_args(key, tensors, scale, softcap, window, nq, k.shape[1], sem))
    cfg = key.cfg
    dq_scale = scale if cfg.scale_out else None  # dS carried no scale: dQ takes it here
    if dq_tiled(cfg):
        dq = post(dq_acc, nq, cfg.tile_m, cfg.num_mma_wgs, q.dtype, cfg.dq_split, dq_scale, **pdl)
        return dq, dk, dv
    if dq_scale is None:
        return dq_acc.to(q.dtype), dk, dv
    return torch.mul(dq_acc, dq_scale, out=torch.empty_like(dq_acc, dtype=q.dtype)), dk, dv


# (row_off, col_off) of the tile-ordered accumulator's blocks, shared with the CuTe DSL pair.
_dq_offsets = bwd_prepost.dq_offsets


def dq_from_tiles(
    dq_acc: torch.Tensor,
    nq: int,
    tile_m: int,
    num_wgs: int,
    dtype: torch.dtype,
    split: str = "d",
    scale: float | None = None,
    out: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
) -> torch.Tensor:
    """dQ in `dtype` from the accumulator of dq_mode "warp" or "red", whose TILE_M x D blocks
    hold dQ in bwd_configs.dq_tile_modes order (`split`: the config's dq_split), times `scale`
    in fp32 when given (the `scale_out` configs): one pass of common.bwd_postprocess's kernel, which
    writes the Nq real rows only. Dense: dq_acc (B, Hq, Nq_pad, D) -> (B, Nq, Hq, D). Packed
    sequences (`cu_seqlens_q`): dq_acc (Hq, rows_pad, D) in the padded row layout -> `out`
    (total_q, Hq, D), which they need (`nq` is then total_q). `out`, when given, is written
    and returned (unit last stride)."""
    d = dq_acc.shape[-1]
    if out is None:
        if cu_seqlens_q is not None:
            raise ValueError("dq_from_tiles: packed sequences write into `out`; got out=None")
        b, hq = dq_acc.shape[:2]
        out = torch.empty(b, nq, hq, d, dtype=dtype, device=dq_acc.device)
    from flashsuite.common.bwd_postprocess import dq_postprocess

    row_off, col_off = _dq_offsets(tile_m, d, num_wgs, split, dq_acc.device)
    return dq_postprocess(dq_acc, row_off, col_off, out, scale, cu_seqlens_q)


def run_varlen_backward(
    key: BwdCompileKey,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    window: tuple[int, int] = (-1, -1),
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (the input dtype, contiguous) of packed sequences: TMA-ready q, dout
    (total_q, Hq, D), k, v (total_k, Hkv, D), out (total_q, Hq, D) with unit last stride, lse
    (Hq, total_q) float32 (natural log), cu_seqlens_q / _k (B + 1,) int32 contiguous, both
    totals > 0; a key built with varlen=True (softcap / window as `run_backward`). `grads`:
    contiguous dq, dk, dv to write into (views into larger buffers, in tests that watch the
    memory around them) instead of new tensors. `dlse` (Hq, total_q) float32, the gradient
    reaching the LSE, is taken off dsum in the padded row layout."""
    if not key.varlen:
        raise ValueError("fa3 backward: run_varlen_backward needs a key built with varlen=True")
    check_key(key, softcap, window)
    from flashsuite.common.bwd_preprocess import varlen_bwd_preprocess, varlen_pad_rows

    total_q, hq, d = q.shape
    tile_m = key.cfg.tile_m
    tiled = dq_tiled(key.cfg)  # (Hq, rows_pad, D) in dq_tile_layout order, zeroed by the preprocess
    if tiled:
        rows_pad = varlen_pad_rows(total_q, cu_seqlens_q.shape[0] - 1, tile_m)
        dq_acc = torch.empty(hq, rows_pad, d, dtype=torch.float32, device=q.device)
    else:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (total_q, Hq, D)
    dsum, lse_log2 = varlen_bwd_preprocess(
        out, dout, lse, cu_seqlens_q, tile_m, dq_acc if tiled else None
    )  # (Hq, rows_pad)
    if dlse is not None:  # D = rowsum(dO ∘ O) - dlse: d lse_i / d s_ij = P_ij
        from flashsuite.common.bwd_preprocess import varlen_pad_index

        dsum[:, varlen_pad_index(cu_seqlens_q, total_q, tile_m)] -= dlse
    if grads is None:
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq, dk, dv = grads  # (total_q, Hq, D), (total_k, Hkv, D) x 2
    fn = get_backward(key)
    tensors = (q, k, v, dout, lse_log2, dsum, dq_acc, dk, dv)
    cu = (cu_seqlens_q, cu_seqlens_k)
    sem = None
    if key.cfg.deterministic:  # one dQ turn counter per (head, padded row block)
        sem = varlen_turn_counters(key, hq, cu_seqlens_q, cu_seqlens_k, window, total_q, k.shape[0])
    fn(*launch_args(key, tensors, scale, softcap, window, total_q, k.shape[0], sem, cu))
    cfg = key.cfg
    dq_scale = scale if cfg.scale_out else None  # dS carried no scale: dQ takes it here
    if not tiled:
        dq.copy_(dq_acc if dq_scale is None else dq_acc * dq_scale)
        return dq, dk, dv
    dq_from_tiles(dq_acc, total_q, tile_m, cfg.num_mma_wgs, q.dtype, cfg.dq_split, dq_scale,
                  out=dq, cu_seqlens_q=cu_seqlens_q)  # fmt: skip
    return dq, dk, dv
