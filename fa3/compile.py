"""Compile cache for the fa3 forward: one binary per static key, any batch / seqlen / heads.

The key (`CompileKey`) holds only what changes the generated code: the input dtype (fp16,
bf16, or float8_e4m3fn: the fp8 branch of the same kernel class), head_dim, the mask and score
flags, packed sequences (varlen) on or off, and the tile config. Batch, sequence lengths, token
totals, head counts and strides are symbolic in the fake tensors the kernel is compiled from, so
new shapes (and, with varlen, new batch compositions) never recompile. The binary is built
with `--enable-tvm-ffi`: it takes torch tensors directly and launches on torch's current
stream.

Two cache levels: an in-process dict, then the on-disk cache of `disk_cache` (a new process
loads the binary a previous one built). Every launch passes every kernel parameter
positionally, as a binary loaded from disk takes them (no defaults).

The CuTe DSL (`cutlass`) and the kernel classes are imported only when a binary is compiled:
loading one from disk needs TVM-FFI alone. `CUTE_DSL_*` environment settings are read when
`cutlass.cute` is first imported; set `CUTE_DSL_ARCH=sm_90a` before the first compile on a
machine without a GPU (the `--gpu-arch` option below already targets sm_90a).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from flashsuite.fa3 import disk_cache, trace
from flashsuite.fa3.configs import (
    FP8_DTYPE,
    SMEM_CAPACITY,
    Fa3Config,
    can_implement,
    smem_bytes,
)
from flashsuite.fa3.decode_configs import decode_can_implement
from flashsuite.fa3.varlen_configs import can_implement_varlen


def cutlass_dtype(dtype: torch.dtype) -> Any:
    """The CuTe DSL element type of a torch dtype fa3 takes (imports the DSL)."""
    import cutlass

    return {
        torch.float16: cutlass.Float16,
        torch.bfloat16: cutlass.BFloat16,
        FP8_DTYPE: cutlass.Float8E4M3FN,
    }[dtype]


@dataclass(frozen=True)
class CompileKey:
    """Everything that changes the generated code of one forward kernel."""

    dtype: torch.dtype  # of q, k, v: float16, bfloat16 or float8_e4m3fn
    head_dim: int
    causal: bool
    local: bool
    softcap: bool
    cfg: Fa3Config
    arch: str = "sm_90a"
    tvm_ffi: bool = True
    # Packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D), out (total_q, Hq, D), lse
    # (Hq, total_q) and cu_seqlens_q/k (B + 1,) int32 (16-bit inputs, plain grid).
    varlen: bool = False
    # fp8 descales per block: (B, H, nblocks, block) fp32 views, the last mode of stride 0
    # (its extent the block size; interface._block_descale), rather than (B, Hkv).
    fp8_blocks: bool = False


_cache: dict[Any, Any] = {}  # static key (CompileKey, bwd_host.BwdCompileKey) -> executor
_lock = threading.Lock()


def compile_options(arch: str, tvm_ffi: bool, extra: str = "") -> str:
    """cute.compile's option string: target arch, the TVM-FFI launcher, anything extra."""
    options = f"--gpu-arch {arch}"
    if tvm_ffi:
        options += " --enable-tvm-ffi"
    return f"{options} {extra}" if extra else options


def check_storage(kernel: Any, estimate: int, what: str) -> None:
    """The DSL does not check shared-memory capacity (a launch would fail on the GPU): compare
    the real storage struct with the config table's estimate and the hardware limit."""
    real = kernel.storage.__sizeof__()
    if real > min(estimate, SMEM_CAPACITY):
        raise RuntimeError(
            f"fa3: {what} storage struct is {real} B (estimated {estimate} B, "
            f"capacity {SMEM_CAPACITY} B)"
        )


def cached(key: Any, build: Any) -> Any:
    """The executor for `key`: from this process's dict, else loaded from the on-disk cache,
    else built by `build(key)` and stored there (thread-safe; `disk_cache.load_or_build`)."""
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn = disk_cache.load_or_build(key, build)
                _cache[key] = fn
    return fn


def _fake_varlen_inputs(key: CompileKey) -> tuple:
    """Fake packed q, k, v, out, lse, three None descales and cu_seqlens_q/k: symbolic totals,
    batch and heads, 16-byte-aligned 64-bit symbolic strides (the ragged views move the base
    pointer back 2^30 rows: fa3/varlen.py)."""
    import cutlass
    import cutlass.cute as cute

    dt = cutlass_dtype(key.dtype)
    d = key.head_dim
    tq, tk, hq, hkv, b1 = (cute.sym_int() for _ in range(5))
    elems_16b = 16 // (dt.width // 8)

    def strided(shape: tuple) -> Any:  # (tokens, heads, D), last dim contiguous
        stride = (*(cute.sym_int64(divisibility=elems_16b) for _ in range(2)), 1)
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=16)

    q, k, v = strided((tq, hq, d)), strided((tk, hkv, d)), strided((tk, hkv, d))
    o = strided((tq, hq, d))  # (total_q, Hq, D), allocated by us (contiguous, or a test's view)
    lse = cute.runtime.make_fake_compact_tensor(
        cutlass.Float32, (hq, tq), stride_order=(1, 0), assumed_align=4
    )  # (Hq, total_q)
    cu_q, cu_k = (
        cute.runtime.make_fake_compact_tensor(cutlass.Int32, (b1,), assumed_align=4)
        for _ in range(2)
    )  # (B + 1,) each
    return (q, k, v, o, lse, None, None, None, cu_q, cu_k)


def _fake_inputs(key: CompileKey) -> tuple:
    """Fake q, k, v, out, lse, the three descales (None for 16-bit inputs) and the two
    cu_seqlens (None: dense), with symbolic sizes and 16-byte-aligned symbolic strides. fp8: v
    is Vᵀ (B, Hkv, D, Nk) with v_transpose="host" (Nk rounded up to 32 with permute_v_keys;
    else V as for 16 bits), out is bf16 and the
    descales are (B, Hkv) fp32. varlen: packed tensors (`_fake_varlen_inputs`)."""
    if key.varlen:
        return _fake_varlen_inputs(key)
    import cutlass
    import cutlass.cute as cute

    fp8 = key.dtype == FP8_DTYPE
    dt = cutlass_dtype(key.dtype)
    d = key.head_dim
    b, nq, nk, hq, hkv = (cute.sym_int() for _ in range(5))
    elems_16b = 16 // (dt.width // 8)  # TMA: outer strides are multiples of 16 bytes

    def strided(shape: tuple) -> Any:  # any 16-byte-aligned outer strides, last dim contiguous
        stride = (*(cute.sym_int64(divisibility=elems_16b) for _ in range(3)), 1)
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=16)

    q, k = strided((b, nq, hq, d)), strided((b, nk, hkv, d))
    vt_host = fp8 and key.cfg.v_transpose == "host"
    # Vᵀ's key extent is K's, but with permute_v_keys it runs to Nk rounded up to 32
    # (interface.transpose_v): its own symbol, or the call's shape check refuses a ragged Nk.
    nk_vt = cute.sym_int() if vt_host and key.cfg.permute_v_keys else nk
    v = strided((b, hkv, d, nk_vt) if vt_host else (b, nk, hkv, d))
    # out is allocated by us, contiguous: (B, Nq, Hq, D).
    o = cute.runtime.make_fake_compact_tensor(
        cutlass.BFloat16 if fp8 else dt, (b, nq, hq, d), stride_order=(3, 2, 1, 0), assumed_align=16
    )
    lse = cute.runtime.make_fake_compact_tensor(
        cutlass.Float32, (b, hq, nq), stride_order=(2, 1, 0), assumed_align=4
    )  # (B, Hq, Nq)
    descales: tuple = (None, None, None)
    if key.fp8_blocks:
        descales = tuple(
            cute.runtime.make_fake_tensor(
                cutlass.Float32,
                (b, cute.sym_int(), cute.sym_int(), cute.sym_int()),
                stride=(cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), 0),
                assumed_align=4,
            )  # (B, H, nblocks, block), block's stride 0; the others any (common.fp8.quantize
            # lays blocks out (B, nblocks, H); a (B, Hkv) descale as one block has stride 0)
            for _ in range(3)
        )
    elif fp8:
        descales = tuple(
            cute.runtime.make_fake_compact_tensor(
                cutlass.Float32, (b, hkv), stride_order=(1, 0), assumed_align=4
            )  # (B, Hkv)
            for _ in range(3)
        )
    if key.cfg.trace:  # (rows, fields) int64 in descale_q's slot (fa3/trace.py)
        rows = cute.runtime.make_fake_compact_tensor(
            cutlass.Int64, (cute.sym_int(), len(trace.FIELDS)), stride_order=(1, 0), assumed_align=8
        )
        descales = (rows, None, None)
    counters = None
    if key.cfg.tile_counter:  # (2,) int32 in cu_seqlens_k's slot (kernels.py, "Tile counter")
        counters = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (2,), assumed_align=4)
    return (q, k, v, o, lse, *descales, None, counters)


def compile_forward(key: CompileKey, extra_options: str = "") -> Any:
    """Build one forward binary (no cache). `extra_options` are appended to cute.compile's.

    The binary takes (q, k, v, out, lse, descale_q, descale_k, descale_v, cu_seqlens_q,
    cu_seqlens_k, scale_log2, softcap_pre, window_left, window_right, max_ctas): for fp8 v is
    Vᵀ (`interface.transpose_v`) unless cfg.v_transpose == "smem", and the descales are
    (B, Hkv) fp32 tensors (with `key.fp8_blocks` (B, H, nblocks, block) views, the last
    mode of stride 0); for 16-bit inputs they are None. The cu_seqlens are (B + 1,) int32
    with `key.varlen` (packed q, k, v, out and a (Hq, total_q) lse), None otherwise; with
    cfg.tile_counter cu_seqlens_k's slot takes the (2,) int32 tile counters (zero at the
    first launch; the kernel leaves them zero).
    """
    import cutlass
    import cutlass.cute as cute

    from flashsuite.fa3.kernels import Fa3Forward

    ok, reason = can_implement(key.cfg, key.head_dim, key.dtype)
    if not ok:
        raise ValueError(f"fa3: cannot build {key}: {reason}")
    est = smem_bytes(key.cfg, key.head_dim, key.dtype)
    if key.varlen:
        ok, reason = can_implement_varlen(key.cfg, key.dtype)
        if not ok:
            raise ValueError(f"fa3: cannot build {key}: {reason}")
    kernel = Fa3Forward(
        cutlass_dtype(key.dtype),
        key.head_dim,
        key.cfg,
        key.causal,
        key.local,
        key.softcap,
        varlen=key.varlen,
        fp8_blocks=key.fp8_blocks,
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi)
    options = compile_options(key.arch, key.tvm_ffi, extra_options)
    compiled = cute.compile(
        kernel,
        *_fake_inputs(key),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        cutlass.Int32(1),
        stream,
        options=options,
    )
    check_storage(kernel, est, f"{key.dtype} {key.cfg}")
    return compiled


def get_forward(key: CompileKey) -> Any:
    """The cached binary for `key`, compiled on first use (thread-safe)."""
    return cached(key, compile_forward)


def kernel_scalars(
    scale: float, softcap: float, window: tuple[int, int], causal: bool, nq: int, nk: int
) -> tuple[float, float, int, int]:
    """Runtime scalars of the kernel: (scale_log2, softcap_pre, window_left, window_right).

    With softcap the scores are softcap * tanh(s * scale / softcap): tanh's argument takes
    scale / softcap and the exp2 scale becomes softcap * log2(e). An unbounded window side
    becomes a bound no row reaches (nq + nk), so the kernel has one code path per side.
    """
    if softcap > 0:
        scale_log2, softcap_pre = softcap * math.log2(math.e), scale / softcap
    else:
        scale_log2, softcap_pre = scale * math.log2(math.e), 1.0
    left, right = window
    far = nq + nk + 1
    left = far if left < 0 else left
    right = 0 if causal else (far if right < 0 else right)
    return scale_log2, softcap_pre, left, right


@dataclass(frozen=True)
class DecodeKey:
    """Everything that changes the generated code of one KV-cache decode kernel
    (decode.Fa3Decode): batch, lengths, head counts, page counts, split count and strides are
    runtime values."""

    dtype: torch.dtype  # of q and the cache: float16 or bfloat16
    head_dim: int
    causal: bool
    local: bool
    softcap: bool
    paged: bool  # a block_table addresses the cache's pages
    split: bool  # writes fp32 partial O and LSE for the combine (num_splits > 1)
    cfg: Fa3Config
    # With split: the last split of each warp's rows merges the partials itself (no second
    # launch; decode.Fa3Decode.combine_if_last), else common.split_combine's Triton kernel.
    fused_combine: bool = False
    # 2: the build two CTAs of which share an SM (decode_configs.decode_config)
    ctas_per_sm: int = 1
    page_box: int = 0  # paged: keys per TMA box when a stage spans pages (0: one box a stage)
    kv_evict_first: bool = False  # K and V loads carry an L2 evict-first hint
    leftpad: bool = False  # cache_seqlens (2B,): the lengths, then each row's first key slot
    arch: str = "sm_90a"
    tvm_ffi: bool = True


def _fake_decode_inputs(key: DecodeKey) -> tuple:
    """Fake q, k_cache, v_cache, out rows, lse, block_table (None unless paged), cache_seqlens
    and, with `key.fused_combine`, the final out rows, lse and the split counters (else None):
    symbolic sizes, 16-byte-aligned 64-bit symbolic strides."""
    import cutlass
    import cutlass.cute as cute

    dt = cutlass_dtype(key.dtype)
    d = key.head_dim
    b, nq, hq, pages, page, hkv, rows, n_lse, max_pages = (cute.sym_int() for _ in range(9))
    elems_16b = 16 // (dt.width // 8)

    def strided(shape: tuple) -> Any:  # last dim contiguous, any 16-byte-aligned outer strides
        stride = (*(cute.sym_int64(divisibility=elems_16b) for _ in range(3)), 1)
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=16)

    q = strided((b, nq, hq, d))
    k, v = strided((pages, page, hkv, d)), strided((pages, page, hkv, d))
    # out (B, Nq, Hq, D) or the partials (splits, B, Nq, Hq, D) fp32, as (rows, D) rows.
    o = cute.runtime.make_fake_compact_tensor(
        cutlass.Float32 if key.split else dt, (rows, d), stride_order=(1, 0), assumed_align=16
    )
    lse = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (n_lse,), assumed_align=4)
    table = None
    if key.paged:
        table = cute.runtime.make_fake_compact_tensor(
            cutlass.Int32, (b, max_pages), stride_order=(1, 0), assumed_align=4
        )
    n_seqlens = cute.sym_int() if key.leftpad else b  # (2B,) with each row's first key slot
    seqlens = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (n_seqlens,), assumed_align=4)
    fused = (None, None, None)
    if key.fused_combine:
        rows_f, n_lse_f, n_sem = (cute.sym_int() for _ in range(3))
        fused = (
            cute.runtime.make_fake_compact_tensor(
                dt, (rows_f, d), stride_order=(1, 0), assumed_align=16
            ),
            cute.runtime.make_fake_compact_tensor(cutlass.Float32, (n_lse_f,), assumed_align=4),
            cute.runtime.make_fake_compact_tensor(cutlass.Int32, (n_sem,), assumed_align=4),
        )
    return (q, k, v, o, lse, table, seqlens, *fused)


def compile_decode(key: DecodeKey, extra_options: str = "") -> Any:
    """Build one decode binary (no cache). It takes (q, k_cache, v_cache, out_rows, lse,
    block_table, cache_seqlens, final_out, final_lse, counters, n_new, num_splits, scale_log2,
    softcap_pre, window_left, window_right): cache_seqlens is (B,) int32, or (2B,) with
    `key.leftpad` (the lengths, then each row's first key slot); out_rows is out (B·Nq·Hq, D)
    in q's dtype, or with `key.split` the fp32 partials (splits·B·Nq·Hq, D); lse is (B·Hq·Nq,), or
    (splits·B·Nq·Hq,) with `key.split`. final_out (B·Nq·Hq, D), final_lse (B·Hq·Nq,) and
    counters (B·Hkv·m_blocks·4,) int32, zero, are for `key.fused_combine` and None otherwise."""
    import cutlass
    import cutlass.cute as cute

    from flashsuite.fa3.decode import Fa3Decode

    ok, reason = decode_can_implement(key.cfg, key.head_dim, key.dtype)
    if not ok:
        raise ValueError(f"fa3: cannot build {key}: {reason}")
    kernel = Fa3Decode(
        cutlass_dtype(key.dtype), key.head_dim, key.cfg, key.causal, key.local, key.softcap,
        key.paged, key.split, key.fused_combine, key.ctas_per_sm, key.page_box,
        key.kv_evict_first, key.leftpad,
    )  # fmt: skip
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi)
    compiled = cute.compile(
        kernel,
        *_fake_decode_inputs(key),
        cutlass.Int32(0),
        cutlass.Int32(1),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        stream,
        options=compile_options(key.arch, key.tvm_ffi, extra_options),
    )
    check_storage(kernel, smem_bytes(key.cfg, key.head_dim, key.dtype), f"decode {key.cfg}")
    return compiled


def get_decode(key: DecodeKey) -> Any:
    """The cached decode binary for `key`, compiled on first use (thread-safe)."""
    return cached(key, compile_decode)
