"""The fa3 dense backward's preprocess and dQ postprocess as CuTe DSL kernels, compiled and
cached like the other fa3 binaries (`compile.cached`: in memory, then on disk), so that a dense
backward launches no Triton kernel: a fresh process pays neither Triton's per-process cache
key nor its compiler's imports.

`Fa3BwdPreprocess` computes, per row of O and dO (B, Nq, Hq, Dv): delta = rowsum(dO * O) and
lse2 = LSE * log2(e) in float32, into (B, Hq, Nq_pad) rows padded to whole row blocks, with
lse2 = +inf where LSE = -inf (a row that saw no key) and on the padding rows, and delta = 0 on
the padding rows (the main kernel then reads P = exp2(S - lse2) = 0 there without masks). With
`zero_d` > 0 the same launch zeroes the (B, Hq, Nq_pad, zero_d) float32 dQ accumulator. The
arithmetic is common/bwd_preprocess.py's `_bwd_preprocess` (lse2 bit for bit; delta sums in
another order).

`Fa3DqPostprocess` turns the tile-ordered float32 dQ accumulator of dq_mode "warp" / "red"
(TILE_M x D blocks whose element (r, c) sits at row_off[r] + col_off[c],
bwd_configs.dq_tile_modes) into dQ (B, Nq, Hq, D) in the input dtype, times an optional scale,
never writing a padding row: common/bwd_postprocess.py's dense `_dq_postprocess`, bit for bit.

Both are memory-bound: 16-byte global loads and stores (ld/st.global.v4), 64-bit addresses
(the strides are 64-bit symbols), one binary per static key for every B / Nq / Hq / strides.
`preprocess` and `dq_from_tiles` are the host entry points, with bwd_host's signatures.

The kernels' decorators are `_dsl.jit` / `_dsl.kernel`: cute.jit / cute.kernel, applied when
the first kernel is compiled, so that importing this module (the host path of a binary loaded
from disk) does not import the CuTe DSL. No annotations on kernel code: the DSL reads them as
objects, and this module's are strings.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from flashsuite.fa3.bwd_configs import BWD_HEAD_DIMS, dq_tile_modes
from flashsuite.fa3.compile import cached, compile_options, cutlass_dtype

LOG2E = math.log2(math.e)
# Nq_pad of `preprocess` is a multiple of lcm(tile_m, PAD_ROWS): the padding of
# common/bwd_preprocess.py (its BLOCK_M), so both preprocesses give the same shapes.
PAD_ROWS = 64
PRE_BLOCK_M = 64  # rows per preprocess CTA
DTYPES = (torch.float16, torch.bfloat16)
POST_TILE_MS = (64, 80, 128)  # the backward configs' tile_m (bwd_configs)

# The postprocess's shared-memory swizzle per accumulator layout (tile_m, D, num_wgs, dq_split):
# XOR terms (bits, base, shift), each flipping float-index bits [base, base + bits) by bits
# [shift, shift + bits). The block sits in shared memory in accumulator order, and a thread
# gathers 8 adjacent columns of one row through the offset tables: unswizzled, the 32 lanes'
# column offsets differ only in bits above the bank bits (a column's 512- or 4096-float
# stride), so every gather is a 16- to 32-way bank conflict (8-way on the 80-row layout) and
# the launch spends longer in bank conflicts than in DRAM. The terms below, found by
# `python -m benchmarks.dq_swizzle_search` (a model of the kernel's accesses), bring each
# layout to 4 wavefronts per warp load (1 at 80 rows). base >= 2 keeps every 16-byte group of
# 4 floats whole (cp.async writes them), and sources lie above every target, so the map is a
# permutation of the block. Layouts not listed take no swizzle.
DQ_SWIZZLE: dict[tuple[int, int, int, str], tuple[tuple[int, int, int], ...]] = {
    (64, 64, 2, "d"): ((2, 2, 9),),
    (64, 96, 2, "d"): ((3, 2, 9),),
    (64, 128, 2, "d"): ((2, 2, 9),),
    (64, 192, 2, "d"): ((3, 2, 9),),
    (64, 256, 2, "d"): ((3, 2, 9),),
    (80, 128, 2, "dt"): ((1, 2, 10), (2, 3, 7)),
    (128, 64, 2, "m"): ((2, 2, 9),),
}


def dq_swizzle(tile_m: int, head_dim: int, num_wgs: int, split: str) -> tuple:
    """The postprocess's swizzle terms for one accumulator layout (`DQ_SWIZZLE`; () if none)."""
    return DQ_SWIZZLE.get((tile_m, head_dim, num_wgs, split), ())


def swizzle_index(a: Any, terms: tuple) -> Any:
    """Float index `a` of a block under swizzle `terms` (int or DSL Int32; see DQ_SWIZZLE)."""
    for bits, base, shift in terms:
        a = a ^ ((a >> (shift - base)) & (((1 << bits) - 1) << base))
    return a


# The DSL names the kernel code uses, bound by `_import_dsl` when the first kernel is traced.
cute: Any = None
cutlass: Any = None
Float32: Any = None
Int32: Any = None
SmemAllocator: Any = None


def _import_dsl() -> None:
    """Import the CuTe DSL, bind the module names the kernel code reads and apply the kernel
    classes' deferred decorators (before any kernel is traced)."""
    global cute, cutlass, Float32, Int32, SmemAllocator
    if cute is None:
        import cutlass as dsl
        import cutlass.cute as dsl_cute
        from cutlass.memory import SmemAllocator as allocator

        cutlass, Float32, Int32, SmemAllocator = dsl, dsl.Float32, dsl.Int32, allocator
        cute = dsl_cute
        for cls in (Fa3BwdPreprocess, Fa3DqPostprocess):
            for name, fn in list(vars(cls).items()):
                kind = getattr(fn, "_dsl_kind", None)
                if kind is not None:
                    setattr(cls, name, getattr(cute, kind)(fn))


class _dsl:  # a decorator namespace, spelled like `cute`
    """`@_dsl.jit` and `@_dsl.kernel` mark a kernel class's methods for cute.jit and
    cute.kernel, which `_import_dsl` applies (the DSL's preprocessor finds the decorator in
    the source, as it would `@cute.jit`)."""

    @staticmethod
    def jit(fn: Any) -> Any:
        fn._dsl_kind = "jit"
        return fn

    @staticmethod
    def kernel(fn: Any) -> Any:
        fn._dsl_kind = "kernel"
        return fn


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
class Fa3BwdPreprocess:
    """delta, lse2 (and the zeroed dQ accumulator) of PRE_BLOCK_M rows of one (batch, head)
    per CTA. A row's Dv elements are read by ROW_THREADS adjacent lanes in 16-byte chunks
    (lane l of the row takes chunks l, l + ROW_THREADS, ...: a warp's loads of one row are
    contiguous), the products summed per lane, then over the lanes by a butterfly shuffle.
    Every load of the CTA is issued before the first sum (rows past Nq read row Nq - 1, their
    delta then set to 0), so the loads have no branches between them."""

    def __init__(self, dtype: Any, head_dim_v: int, zero_d: int = 0, pdl: bool = False) -> None:
        self.dtype = dtype
        self.DV = head_dim_v
        self.ZERO_D = zero_d
        self.PDL = pdl  # programmatic dependent launch (BwdConfig.pdl)
        self.VEC = 128 // dtype.width  # elements per 16-byte load
        chunks = head_dim_v // self.VEC
        self.ROW_THREADS = math.gcd(chunks, 8)  # lanes per row: 8, or 4 at Dv = 96
        self.CHUNKS_PER_THREAD = chunks // self.ROW_THREADS
        # 256 threads above Dv = 128: at most 16 16-byte loads (64 registers) per thread.
        self.THREADS = 256 if head_dim_v > 128 else 128
        self.ROWS_PER_PASS = self.THREADS // self.ROW_THREADS
        self.PASSES = PRE_BLOCK_M // self.ROWS_PER_PASS
        assert head_dim_v % self.VEC == 0 and PRE_BLOCK_M % self.ROWS_PER_PASS == 0
        assert zero_d % 4 == 0 and (PRE_BLOCK_M * zero_d // 4) % self.THREADS == 0

    @_dsl.jit
    def __call__(self, mO, mdO, mLSE, mDelta, mLse2, mAcc, stream):
        """mO, mdO (B, Nq, Hq, Dv); mLSE (B, Hq, Nq) fp32; mDelta, mLse2 (B, Hq, Nq_pad) fp32;
        mAcc (B, Hq, Nq_pad, ZERO_D) fp32, or None without zeroing. Needs Nq >= 1."""
        b, _, hq, _ = mO.shape
        nq_pad = mDelta.shape[2]
        grid = [(nq_pad + PRE_BLOCK_M - 1) // PRE_BLOCK_M, hq, b]
        self.kernel(mO, mdO, mLSE, mDelta, mLse2, mAcc).launch(
            grid=grid, block=[self.THREADS, 1, 1], stream=stream, use_pdl=self.PDL
        )

    @_dsl.kernel
    def kernel(self, mO, mdO, mLSE, mDelta, mLse2, mAcc):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, h, b = cute.arch.block_idx()
        if cutlass.const_expr(self.PDL):
            # O, dO and LSE come from earlier launches: wait for them, and only then let the
            # main kernel launch (it loads K and V before its own wait).
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        nq = mO.shape[1]
        nq_pad = mDelta.shape[2]
        lane = tidx % self.ROW_THREADS  # lane within the row's group
        m0 = m_block * PRE_BLOCK_M + tidx // self.ROW_THREADS
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        frags = []  # [pass][chunk] (rO, rdO), each (VEC,)
        for p in cutlass.range_constexpr(self.PASSES):
            row = cutlass.min(m0 + p * self.ROWS_PER_PASS, nq - 1)  # in bounds: rows past Nq
            gO = mO[b, row, h, None]  # (Dv,)
            gdO = mdO[b, row, h, None]  # (Dv,)
            per_pass = []
            for k in cutlass.range_constexpr(self.CHUNKS_PER_THREAD):
                chunk = lane + k * self.ROW_THREADS
                rO = cute.make_rmem_tensor((self.VEC,), self.dtype)
                rdO = cute.make_rmem_tensor((self.VEC,), self.dtype)
                cute.copy(atom, cute.local_tile(gO, (self.VEC,), (chunk,)), rO)
                cute.copy(atom, cute.local_tile(gdO, (self.VEC,), (chunk,)), rdO)
                per_pass.append((rO, rdO))
            frags.append(per_pass)
        for p in cutlass.range_constexpr(self.PASSES):
            row = m0 + p * self.ROWS_PER_PASS
            acc = Float32(0.0)
            for k in cutlass.range_constexpr(self.CHUNKS_PER_THREAD):
                o = frags[p][k][0].load().to(Float32)  # (VEC,)
                do = frags[p][k][1].load().to(Float32)  # (VEC,)
                for i in cutlass.range_constexpr(self.VEC):
                    acc = acc + o[i] * do[i]
            delta = cute.arch.warp_reduction_sum(acc, threads_in_group=self.ROW_THREADS)
            if (lane == 0) & (row < nq_pad):
                lse = mLSE[b, h, cutlass.min(row, nq - 1)]
                real = row < nq
                seen = real & (lse != Float32(-math.inf))
                mDelta[b, h, row] = delta if real else Float32(0.0)
                mLse2[b, h, row] = lse * Float32(LOG2E) if seen else Float32(math.inf)
        if cutlass.const_expr(self.ZERO_D > 0):
            self.zero_rows(mAcc, tidx, m_block, b, h, nq_pad)

    @_dsl.jit
    def zero_rows(self, mAcc, tidx, m_block, b, h, nq_pad):
        """mAcc[b, h, rows of this CTA, :] = 0 by 16-byte stores: the block's rows are
        PRE_BLOCK_M * ZERO_D contiguous floats, a thread's stores THREADS * 16 bytes apart."""
        quads = self.ZERO_D // 4  # 16-byte stores per row
        gAcc = cute.local_tile(
            mAcc[b, h, None, None], (PRE_BLOCK_M, self.ZERO_D), (m_block, 0)
        )  # (PRE_BLOCK_M, ZERO_D)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        zeros = cute.make_rmem_tensor((4,), Float32)
        zeros.fill(0.0)
        for i in cutlass.range_constexpr(PRE_BLOCK_M * quads // self.THREADS):
            idx = tidx + i * self.THREADS
            r = idx // quads
            if m_block * PRE_BLOCK_M + r < nq_pad:
                cute.copy(atom, zeros, cute.local_tile(gAcc[r, None], (4,), (idx - r * quads,)))


class Fa3DqPostprocess:
    """dQ of one TILE_M x D block of the tile-ordered accumulator per CTA. The block, TILE_M * D
    contiguous floats, is copied to shared memory by 16-byte cp.async (all in flight at once,
    no registers), then each thread gathers 8 adjacent columns of a row through the offset
    tables (its 8 column offsets loaded once, by two 16-byte loads), converts them and writes
    them with one 16-byte store: ROWS_PER_PASS rows of D / 8 threads each per pass. Rows past
    Nq are not written. The block lies in shared memory under the layout's `swizzle` terms
    (DQ_SWIZZLE), applied to the copy's destinations and to the gathers alike."""

    def __init__(
        self,
        dtype: Any,
        head_dim: int,
        tile_m: int,
        has_scale: bool,
        swizzle: tuple = (),
        pdl: bool = False,
    ) -> None:
        self.dtype = dtype
        self.PDL = pdl  # programmatic dependent launch (BwdConfig.pdl)
        self.SWIZZLE = swizzle
        self.HEAD_DIM = head_dim
        self.TILE_M = tile_m
        self.HAS_SCALE = has_scale
        self.VEC = 128 // dtype.width  # columns per 16-byte store of dQ
        self.CHUNKS = head_dim // self.VEC  # threads per row
        # 128-256 threads: 16 rows per pass at D <= 96 (128 / 192 threads), else 8.
        self.ROWS_PER_PASS = 16 if head_dim <= 96 else 8
        self.THREADS = self.ROWS_PER_PASS * self.CHUNKS
        self.PASSES = tile_m // self.ROWS_PER_PASS
        self.LOADS = tile_m * head_dim // 4 // self.THREADS  # 16-byte loads per thread
        assert tile_m % self.ROWS_PER_PASS == 0 and head_dim % self.VEC == 0
        assert (tile_m * head_dim // 4) % self.THREADS == 0

    @_dsl.jit
    def __call__(self, mAcc, mRowOff, mColOff, mdQ, scale, stream):
        """mAcc (B, Hq, Nq_pad, D) fp32 with Nq_pad a multiple of TILE_M; mRowOff (TILE_M,),
        mColOff (D,) int32; mdQ (B, Nq, Hq, D); scale fp32 (unused unless HAS_SCALE)."""
        b, hq, nq_pad, _ = mAcc.shape
        self.kernel(mAcc, mRowOff, mColOff, mdQ, scale).launch(
            grid=[nq_pad // self.TILE_M, hq, b],
            block=[self.THREADS, 1, 1],
            stream=stream,
            use_pdl=self.PDL,
        )

    @_dsl.kernel
    def kernel(self, mAcc, mRowOff, mColOff, mdQ, scale):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, h, b = cute.arch.block_idx()
        if cutlass.const_expr(self.PDL):  # the main kernel's dQ adds complete first
            cute.arch.griddepcontrol_wait()
        nq = mdQ.shape[1]
        block = self.TILE_M * self.HEAD_DIM
        sAcc = SmemAllocator().allocate_tensor(
            Float32, cute.make_layout(block), byte_alignment=16
        )  # (TILE_M * D,)
        gBlk = cute.local_tile(
            mAcc[b, h, None, None], (self.TILE_M, self.HEAD_DIM), (m_block, 0)
        )  # (TILE_M, D)
        gAcc = cute.make_tensor(gBlk.iterator, cute.make_layout(block))  # (TILE_M * D,)
        g2s = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
            Float32,
            num_bits_per_copy=128,
        )
        i32x4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
        out16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        # The whole block in flight at once, without registers: cp.async.cg, 16 bytes each.
        for i in cutlass.range_constexpr(self.LOADS):
            idx = tidx + i * self.THREADS
            dst = swizzle_index(idx * 4, self.SWIZZLE) >> 2  # its 16-byte group, swizzled
            cute.copy(g2s, cute.local_tile(gAcc, (4,), (idx,)), cute.local_tile(sAcc, (4,), (dst,)))
        cute.arch.cp_async_commit_group()

        chunk = tidx % self.CHUNKS
        rp = tidx // self.CHUNKS
        rCol = cute.make_rmem_tensor((self.VEC,), Int32)  # (VEC,) offsets of my columns
        for half in cutlass.range_constexpr(self.VEC // 4):
            src = cute.local_tile(mColOff, (4,), (chunk * (self.VEC // 4) + half,))
            cute.copy(i32x4, src, cute.local_tile(rCol, (4,), (half,)))
        rRow = cute.make_rmem_tensor((self.PASSES,), Int32)  # offsets of my rows
        for p in cutlass.range_constexpr(self.PASSES):
            rRow[p] = mRowOff[p * self.ROWS_PER_PASS + rp]
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        for p in cutlass.range_constexpr(self.PASSES):
            row = m_block * self.TILE_M + p * self.ROWS_PER_PASS + rp
            if row < nq:
                vals = cute.make_rmem_tensor((self.VEC,), Float32)
                for k in cutlass.range_constexpr(self.VEC):
                    x = sAcc[swizzle_index(rRow[p] + rCol[k], self.SWIZZLE)]
                    if cutlass.const_expr(self.HAS_SCALE):
                        x = x * scale
                    vals[k] = x
                rdQ = cute.make_rmem_tensor((self.VEC,), self.dtype)
                rdQ.store(vals.load().to(self.dtype))
                gdQ = mdQ[b, row, h, None]  # (D,)
                cute.copy(out16, rdQ, cute.local_tile(gdQ, (self.VEC,), (chunk,)))


# ----------------------------------------------------------------------------------------------
# compile keys and caches
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreprocessKey:
    """Everything that changes the generated code of one preprocess binary."""

    dtype: torch.dtype  # of out and dout: float16 or bfloat16
    head_dim_v: int
    zero_d: int = 0  # D of the dQ accumulator zeroed in the same launch; 0: none
    pdl: bool = False  # launched as a programmatic dependent (BwdConfig.pdl)
    arch: str = "sm_90a"
    tvm_ffi: bool = True


@dataclass(frozen=True)
class PostprocessKey:
    """Everything that changes the generated code of one dQ postprocess binary."""

    dtype: torch.dtype  # of dQ: float16 or bfloat16
    head_dim: int
    tile_m: int
    has_scale: bool
    swizzle: tuple = ()  # DQ_SWIZZLE terms of the accumulator layout
    pdl: bool = False  # launched as a programmatic dependent (BwdConfig.pdl)
    arch: str = "sm_90a"
    tvm_ffi: bool = True


def _stride64(n: int, divisibility: int = 1) -> tuple:
    """n symbolic 64-bit strides (offsets past 2^31 elements stay exact)."""
    import cutlass.cute as cute

    return tuple(cute.sym_int64(divisibility=divisibility) for _ in range(n))


def compile_preprocess(key: PreprocessKey, extra_options: str = "") -> Any:
    """Build one preprocess binary (no cache). It takes (out, dout, lse, delta, lse2, dq_acc):
    out, dout (B, Nq, Hq, Dv) with unit last stride and 16-byte-aligned rows (any outer
    strides), lse (B, Hq, Nq) fp32 (any strides), delta, lse2 (B, Hq, Nq_pad) fp32 with unit
    last stride, dq_acc (B, Hq, Nq_pad, zero_d) fp32 with rows of zero_d contiguous floats
    (None when key.zero_d is 0)."""
    _import_dsl()
    dt = cutlass_dtype(key.dtype)
    b, nq, hq, nq_pad = (cute.sym_int() for _ in range(4))
    elems_16b = 16 // (dt.width // 8)
    make = cute.runtime.make_fake_tensor
    o, do = (
        make(
            dt, (b, nq, hq, key.head_dim_v), stride=(*_stride64(3, elems_16b), 1), assumed_align=16
        )
        for _ in range(2)
    )
    lse = make(Float32, (b, hq, nq), stride=_stride64(3), assumed_align=4)
    delta, lse2 = (
        make(Float32, (b, hq, nq_pad), stride=(*_stride64(2), 1), assumed_align=4) for _ in range(2)
    )
    acc = None
    if key.zero_d:
        acc = make(
            Float32,
            (b, hq, nq_pad, key.zero_d),
            stride=(*_stride64(2, 4), key.zero_d, 1),
            assumed_align=16,
        )
    kernel = Fa3BwdPreprocess(dt, key.head_dim_v, key.zero_d, key.pdl)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi)
    return cute.compile(
        kernel, o, do, lse, delta, lse2, acc, stream,
        options=compile_options(key.arch, key.tvm_ffi, extra_options),
    )  # fmt: skip


def compile_postprocess(key: PostprocessKey, extra_options: str = "") -> Any:
    """Build one dQ postprocess binary (no cache). It takes (dq_acc, row_off, col_off, dq,
    scale): dq_acc (B, Hq, Nq_pad, D) fp32 whose (batch, head) slabs have contiguous rows and a
    16-byte-aligned start, Nq_pad a multiple of tile_m; row_off (tile_m,), col_off (D,) int32,
    col_off 16-byte aligned; dq (B, Nq, Hq, D) with unit last stride and 16-byte-aligned rows;
    scale a float (read only when key.has_scale)."""
    _import_dsl()
    dt = cutlass_dtype(key.dtype)
    d = key.head_dim
    b, hq, nq, nq_pad = (cute.sym_int() for _ in range(4))
    elems_16b = 16 // (dt.width // 8)
    make = cute.runtime.make_fake_tensor
    acc = make(Float32, (b, hq, nq_pad, d), stride=(*_stride64(2, 4), d, 1), assumed_align=16)
    row_off = cute.runtime.make_fake_compact_tensor(Int32, (key.tile_m,), assumed_align=4)
    col_off = cute.runtime.make_fake_compact_tensor(Int32, (d,), assumed_align=16)
    dq = make(dt, (b, nq, hq, d), stride=(*_stride64(3, elems_16b), 1), assumed_align=16)
    kernel = Fa3DqPostprocess(dt, d, key.tile_m, key.has_scale, key.swizzle, key.pdl)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi)
    return cute.compile(
        kernel, acc, row_off, col_off, dq, Float32(1.0), stream,
        options=compile_options(key.arch, key.tvm_ffi, extra_options),
    )  # fmt: skip


def get_preprocess(key: PreprocessKey) -> Any:
    """The cached preprocess binary for `key`, compiled on first use (thread-safe)."""
    return cached(key, compile_preprocess)


def get_postprocess(key: PostprocessKey) -> Any:
    """The cached dQ postprocess binary for `key`, compiled on first use (thread-safe)."""
    return cached(key, compile_postprocess)


# ----------------------------------------------------------------------------------------------
# host entry points
# ----------------------------------------------------------------------------------------------
def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_rows16(what: str, t: torch.Tensor) -> None:
    """t has a unit last stride and every row starts 16 bytes aligned (16-byte accesses)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{what} expected a unit last stride, got strides {t.stride()}")
    elems = 16 // t.element_size()
    if t.data_ptr() % 16 or any(s % elems for s in t.stride()[:-1]):
        raise ValueError(
            f"{what} expected 16-byte-aligned rows (data pointer and outer strides multiples of "
            f"16 bytes), got data_ptr % 16 = {t.data_ptr() % 16}, strides {t.stride()}"
        )


def preprocess(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tile_m: int,
    dq_d: int = 0,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lse_log2, dsum, dq_acc) for fa3's dense backward, by one CuTe DSL launch: lse_log2 and
    dsum (B, Hq, Nq_pad) float32 contiguous with Nq_pad the first multiple of lcm(tile_m, 64)
    >= Nq; with dq_d > 0 also the zeroed float32 dQ accumulator (B, Hq, Nq_pad, dq_d) (else
    None).

    lse_log2 = lse * log2(e), +inf for rows that see no key and on the padding rows; dsum =
    rowsum(dout * out) in float32, 0 on the padding rows. dout, out (B, Nq, Hq, Dv) float16 /
    bfloat16 with unit last stride and 16-byte-aligned rows; lse (B, Hq, Nq) float32, natural
    log, any strides. `pdl`: launched as a programmatic dependent (BwdConfig.pdl). A ValueError
    names the argument that does not fit."""
    if out.dim() != 4:
        raise ValueError(f"preprocess: out expected (B, Nq, Hq, Dv), got shape {tuple(out.shape)}")
    b, nq, hq, dv = out.shape
    if out.dtype not in DTYPES:
        raise ValueError(f"preprocess: out expected float16 or bfloat16, got {_name(out.dtype)}")
    if dout.dtype != out.dtype or dout.shape != out.shape:
        raise ValueError(
            f"preprocess: dout expected {_name(out.dtype)} {tuple(out.shape)} (as out), got "
            f"{_name(dout.dtype)} {tuple(dout.shape)}"
        )
    if dv not in BWD_HEAD_DIMS:
        raise ValueError(f"preprocess: out's head dim expected one of {BWD_HEAD_DIMS}, got {dv}")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (b, hq, nq):
        raise ValueError(
            f"preprocess: lse expected float32 {(b, hq, nq)}, got {_name(lse.dtype)} "
            f"{tuple(lse.shape)}"
        )
    if dq_d and dq_d not in BWD_HEAD_DIMS:
        raise ValueError(f"preprocess: dq_d expected 0 or one of {BWD_HEAD_DIMS}, got {dq_d}")
    if tile_m <= 0:
        raise ValueError(f"preprocess: tile_m expected > 0, got {tile_m}")
    if len({out.device, dout.device, lse.device}) != 1:
        raise ValueError(
            f"preprocess: out, dout, lse expected on one device, got {out.device}, "
            f"{dout.device}, {lse.device}"
        )
    _check_rows16("preprocess: out", out)
    _check_rows16("preprocess: dout", dout)
    step = math.lcm(tile_m, PAD_ROWS)
    nq_pad = -(-nq // step) * step
    dev = out.device
    lse_log2 = torch.empty(b, hq, nq_pad, dtype=torch.float32, device=dev)
    dsum = torch.empty(b, hq, nq_pad, dtype=torch.float32, device=dev)
    dq_acc = None
    if dq_d:
        dq_acc = torch.empty(b, hq, nq_pad, dq_d, dtype=torch.float32, device=dev)
    if b * hq * nq == 0:
        return lse_log2, dsum, dq_acc
    fn = get_preprocess(PreprocessKey(out.dtype, dv, dq_d, pdl))
    fn(out, dout, lse, dsum, lse_log2, dq_acc)
    return lse_log2, dsum, dq_acc


@functools.cache
def dq_offsets(
    tile_m: int, head_dim: int, num_wgs: int, split: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_off (TILE_M,), col_off (D,)) int32 contiguous on `device`: where element (r, c) of
    a TILE_M x D block of the tile-ordered accumulator sits (row_off[r] + col_off[c]), from
    dq_tile_modes' (shape, stride) by CuTe's colexicographic decomposition of r and c."""
    (rows, cols), (row_strides, col_strides) = dq_tile_modes(tile_m, head_dim, num_wgs, split)

    def offsets(shape: tuple, stride: tuple, n: int) -> torch.Tensor:
        idx, off = torch.arange(n), torch.zeros(n, dtype=torch.int32)
        for size, st in zip(shape, stride, strict=True):
            off += (idx % size).to(torch.int32) * st
            idx = idx // size
        return off.to(device)

    return offsets(rows, row_strides, tile_m), offsets(cols, col_strides, head_dim)


def dq_from_tiles(
    dq_acc: torch.Tensor,
    nq: int,
    tile_m: int,
    num_wgs: int,
    dtype: torch.dtype,
    split: str = "d",
    scale: float | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """bwd_host.dq_from_tiles for dense problems, by one CuTe DSL launch: dQ in `dtype` from
    the accumulator of dq_mode "warp" or "red", whose TILE_M x D blocks hold dQ in
    bwd_configs.dq_tile_modes order (`split`: the config's dq_split), times `scale` in fp32
    when given: dq_acc (B, Hq, Nq_pad, D) float32 contiguous, Nq_pad a multiple of tile_m ->
    (B, Nq, Hq, D), written into `out` when given (unit last stride, 16-byte-aligned rows) and
    returned; the Nq real rows only; `pdl`: launched as a programmatic dependent
    (BwdConfig.pdl). (Packed sequences take bwd_host's Triton path.)"""
    if dq_acc.dtype != torch.float32 or dq_acc.dim() != 4:
        raise ValueError(
            f"dq_from_tiles: dq_acc expected float32 (B, Hq, Nq_pad, D), got "
            f"{_name(dq_acc.dtype)} {tuple(dq_acc.shape)}"
        )
    b, hq, nq_pad, d = dq_acc.shape
    if d not in BWD_HEAD_DIMS:
        raise ValueError(f"dq_from_tiles: dq_acc's D expected one of {BWD_HEAD_DIMS}, got {d}")
    if tile_m not in POST_TILE_MS:
        raise ValueError(f"dq_from_tiles: tile_m expected one of {POST_TILE_MS}, got {tile_m}")
    if not dq_acc.is_contiguous() or nq_pad % tile_m or dq_acc.data_ptr() % 16:
        raise ValueError(
            f"dq_from_tiles: dq_acc expected contiguous, 16-byte aligned, Nq_pad a multiple of "
            f"{tile_m}, got shape {tuple(dq_acc.shape)} strides {dq_acc.stride()} data_ptr % 16 "
            f"= {dq_acc.data_ptr() % 16}"
        )
    if not 0 <= nq <= nq_pad:
        raise ValueError(f"dq_from_tiles: nq expected in [0, {nq_pad}], got {nq}")
    if dtype not in DTYPES:
        raise ValueError(f"dq_from_tiles: dtype expected float16 or bfloat16, got {_name(dtype)}")
    if out is None:
        out = torch.empty(b, nq, hq, d, dtype=dtype, device=dq_acc.device)
    elif out.dtype != dtype or tuple(out.shape) != (b, nq, hq, d):
        raise ValueError(
            f"dq_from_tiles: out expected {_name(dtype)} {(b, nq, hq, d)}, got "
            f"{_name(out.dtype)} {tuple(out.shape)}"
        )
    elif out.device != dq_acc.device:
        raise ValueError(f"dq_from_tiles: out expected on {dq_acc.device}, got {out.device}")
    _check_rows16("dq_from_tiles: out", out)
    if out.numel() == 0:
        return out
    row_off, col_off = dq_offsets(tile_m, d, num_wgs, split, dq_acc.device)
    swizzle = dq_swizzle(tile_m, d, num_wgs, split)
    fn = get_postprocess(PostprocessKey(dtype, d, tile_m, scale is not None, swizzle, pdl))
    fn(dq_acc, row_off, col_off, out, 1.0 if scale is None else float(scale))
    return out
