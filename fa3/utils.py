"""Small device-side helpers every fa3 kernel uses: warp roles, named barriers, the 16-bit
pack of two fp32 values, and the two wgmma issues of attention (S = Q·Kᵀ, O += P·V)."""

# No `from __future__ import annotations`: the CuTe DSL reads annotations as objects.
import enum
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

LN2 = math.log(2.0)


def ptx(result_type, operands: list, text: str, constraints: str, side_effects: bool = True):
    """Inline PTX `text` (AT&T operand syntax) as an LLVM inline_asm op. With `side_effects`
    (memory operations, barriers) LLVM neither drops nor reorders it against other such ops."""
    return llvm.inline_asm(
        result_type,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def cvt_pack_16x2(a: Float32, b: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one register of two 16-bit values (a in the low half): cvt.rn.{bf16,f16}x2.

    Written out because `TensorSSA.to()` only packs pairs for some fragment sizes; unpacked
    16-bit halves get merged with `mov` right before each RS wgmma, and ptxas then inserts a
    warpgroup.arrive per wgmma (remark C7519), which breaks the wgmma pipeline.
    """
    kind = "bf16x2" if bf16 else "f16x2"
    return Int32(
        ptx(
            T.i32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $2, $1;",  # d = {hi: $2 (b), lo: $1 (a)}
            "=r,f,f",
            side_effects=False,
        )
    )


@dsl_user_op
def bulk_reduce_add_f32(
    gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, nbytes: int, *, loc=None, ip=None
) -> None:
    """gmem[0:nbytes] += smem[0:nbytes] (fp32) by the TMA unit, in this thread's bulk group:
    cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32. Both addresses 16-byte
    aligned, nbytes a multiple of 16; commit and wait with cute.arch.cp_async_bulk_*_group."""
    ptx(
        None,
        [
            gmem_ptr.llvm_ptr,
            smem_ptr.toint(loc=loc, ip=ip).ir_value(),
            Int32(nbytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
    )


@dsl_user_op
def ld_acquire_gpu_s32(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """An int32 from global memory with acquire semantics at GPU scope (ld.acquire.gpu): the
    reads and writes after it see everything the thread that released the value had done."""
    return Int32(
        ptx(
            T.i32(),
            [ptr.llvm_ptr],
            "ld.acquire.gpu.global.b32 $0, [$1];",
            "=r,l",
        )
    )


@dsl_user_op
def atom_add_gpu_s32(
    ptr: cute.Pointer, value: Int32, sem: str = "relaxed", *, loc=None, ip=None
) -> Int32:
    """The old value of a global int32 to which `value` is added atomically at GPU scope;
    `sem` "relaxed" (only the counter itself is ordered) or "acq_rel" (the thread's earlier
    memory operations happen before it for whoever acquires it, and it sees theirs)."""
    return Int32(
        ptx(
            T.i32(),
            [ptr.llvm_ptr, Int32(value).ir_value(loc=loc, ip=ip)],
            f"atom.{sem}.gpu.global.add.s32 $0, [$1], $2;",
            "=r,l,r",
        )
    )


@dsl_user_op
def st_relaxed_gpu_s32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    """A global int32 store at GPU scope (st.relaxed.gpu)."""
    ptx(
        None,
        [ptr.llvm_ptr, Int32(value).ir_value(loc=loc, ip=ip)],
        "st.relaxed.gpu.global.b32 [$0], $1;",
        "l,r",
    )


@dsl_user_op
def nanosleep_zero(*, loc=None, ip=None) -> None:
    """nanosleep.u32 0: no effect, but a side effect ptxas keeps (the body of
    Fa3Config.pin_pv_wait's branch)."""
    ptx(None, [], "nanosleep.u32 0;", "")


@dsl_user_op
def red_release_gpu_add_s32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    """global int32 += value with release semantics at GPU scope (red.release.gpu): what this
    thread (and, after a barrier, its CTA) wrote before is visible to an acquiring reader."""
    ptx(
        None,
        [ptr.llvm_ptr, Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
    )


@dsl_user_op
def ld_cg_f32(ptr: cute.Pointer, *, loc=None, ip=None) -> Float32:
    """A float32 from global memory through L2 only (ld.global.cg): what another CTA wrote and
    released, never a line this SM's L1 kept from before it was written."""
    return Float32(
        ptx(
            T.f32(),
            [ptr.llvm_ptr],
            "ld.global.cg.f32 $0, [$1];",
            "=f,l",
        )
    )


@dsl_user_op
def ld_cg_v4_f32(ptr: cute.Pointer, *, loc=None, ip=None) -> tuple:
    """Four float32 at a 16-byte-aligned global address through L2 only (ld.global.cg.v4)."""
    res = ptx(
        llvm.StructType.get_literal([T.f32()] * 4),
        [ptr.llvm_ptr],
        "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=f,=f,=f,=f,l",
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def atom_add_acq_rel_gpu_s32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> Int32:
    """old = global int32; global int32 += value, acquire and release at GPU scope
    (atom.acq_rel.gpu): the writes this thread (after a fence, its warp) made before are visible
    to whoever reads the new count, and this thread sees everything released before the old."""
    return Int32(
        ptx(
            T.i32(),
            [ptr.llvm_ptr, Int32(value).ir_value(loc=loc, ip=ip)],
            "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;",
            "=r,l,r",
        )
    )


@dsl_user_op
def barrier_popc(barrier_id: int, threads: int, pred, *, loc=None, ip=None) -> Int32:
    """Named barrier `barrier_id` over `threads` threads that also counts how many of them
    passed a true `pred` (bar.red.popc): a CTA-wide vote without shared memory."""
    return Int32(
        ptx(
            T.i32(),
            [
                Int32(pred).ir_value(loc=loc, ip=ip),
                Int32(barrier_id).ir_value(loc=loc, ip=ip),
                Int32(threads).ir_value(loc=loc, ip=ip),
            ],
            "{\n.reg .pred p;\nsetp.ne.u32 p, $1, 0;\nbar.red.popc.u32 $0, $2, $3, p;\n}",
            "=r,r,r,r",
        )
    )


@cute.jit
def turn_wait(sem: cute.Pointer, turn: Int32, tid: Int32, barrier_id: int, threads: int):
    """Wait until the global int32 counter `sem` reads `turn`: thread 0 of `threads` spins on
    an acquiring load, then named barrier `barrier_id` releases all of them. With `turn_pass`
    it orders the CTAs that share a counter (docs/design.md, "Deterministic dQ")."""
    if tid == 0:
        seen = ld_acquire_gpu_s32(sem)
        while seen != turn:
            seen = ld_acquire_gpu_s32(sem)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)


@cute.jit
def turn_pass(sem: cute.Pointer, tid: Int32, barrier_id: int, threads: int):
    """Hand the counter to the next turn: once all `threads` have passed named barrier
    `barrier_id` (their writes issued), thread 0 increments it with a releasing reduction, so
    the next waiter's acquiring load sees those writes."""
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    if tid == 0:
        red_release_gpu_add_s32(sem, Int32(1))


class WarpRole(enum.IntEnum):
    """Warpgroup index -> role (NUM_THREADS = (1 + NUM_CONSUMER_WGS) x 128 threads)."""

    PRODUCER = 0
    CONSUMER0 = 1
    CONSUMER1 = 2
    CONSUMER2 = 3  # only with num_consumer_wgs == 3


class Barrier(enum.IntEnum):
    """Named barrier ids; 0 is __syncthreads."""

    EPILOGUE = 1  # all consumer threads, around the O smem tile
    # Consumer WG c's turn on the tensor cores is barrier PINGPONG_WG0 + c (256 threads: WG c
    # syncs, its predecessor in the ring c-1 -> c arrives).
    PINGPONG_WG0 = 2
    PINGPONG_WG1 = 3
    PINGPONG_WG2 = 4  # only with three consumer WGs
    # overlap_tiles with a separate sO: consumer WG c's own epilogue (128 threads).
    EPILOGUE_WG0 = 5
    EPILOGUE_WG1 = 6
    EPILOGUE_WG2 = 7


@cute.jit
def q_to_regs(mma_qk: cute.TiledMma, sQ: cute.Tensor, thread: Int32, dtype) -> cute.Tensor:
    """Thread `thread`'s A fragment of Q·Kᵀ (RS wgmma) loaded from sQ by ldmatrix: Q in
    registers for the whole tile (Fa3Config.q_in_regs)."""
    thr = mma_qk.get_slice(thread)
    tSrQ = thr.make_fragment_A(thr.partition_shape_A(cute.select(sQ.shape, mode=[0, 1])))
    s2r = cute.make_tiled_copy_A(
        cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), dtype), mma_qk
    )
    thr_s2r = s2r.get_slice(thread)
    cute.copy(s2r, thr_s2r.partition_S(sQ), thr_s2r.retile(tSrQ))
    return tSrQ


@cute.jit
def gemm_qk(
    mma_qk: cute.TiledMma,
    acc_S,
    tSrQ,
    tSrK,
    stage: Int32,
    stage_desc: cutlass.Constexpr[bool] = False,
):
    """Issue S = Q·Kᵀ (SS wgmma) into acc_S and commit; the caller waits. `stage_desc`: K's
    descriptors sliced by stage first (Fa3Config.stage_desc)."""
    warpgroup.fence()
    # A fresh atom per issue: mutating the shared TiledMma's ACCUMULATE flag inside the
    # dynamic K/V loop leaks an SSA value out of its region.
    atom = cute.make_mma_atom(mma_qk.op)
    atom.set(warpgroup.Field.ACCUMULATE, False)  # S = Q·Kᵀ overwrites
    if const_expr(stage_desc):
        tSrK = tSrK[None, None, None, stage]
    for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
        if const_expr(stage_desc):
            cute.gemm(atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
        else:
            cute.gemm(atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def gemm_pv(
    mma_pv: cute.TiledMma,
    acc_O,
    tOrP,
    tOrVt,
    stage: Int32,
    accumulate=None,
    stage_desc: cutlass.Constexpr[bool] = False,
):
    """Issue O += P·V (RS wgmma, P from registers) and commit; the caller waits.

    `accumulate`: None (acc_O starts at 0 and is rescaled in place) or a runtime Boolean,
    False for the tile's first P·V, which then overwrites acc_O (Fa3Config.o_zero_init).
    `stage_desc`: Vᵀ's descriptors sliced by stage first, as gemm_qk's K."""
    warpgroup.fence()
    atom = cute.make_mma_atom(mma_pv.op)
    atom.set(warpgroup.Field.ACCUMULATE, True if accumulate is None else accumulate)
    if const_expr(stage_desc):
        tOrVt = tOrVt[None, None, None, stage]
    for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
        if const_expr(stage_desc):
            cute.gemm(atom, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)
        else:
            cute.gemm(atom, acc_O, tOrP[None, None, k], tOrVt[None, None, k, stage], acc_O)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
