"""Tile sizes of the FA1 kernels, as data: one readable function per kernel.

Notation of the paper (Alg. 1): B_c = BLOCK_N rows of K/V per outer step, B_r = BLOCK_M rows of
Q per inner step. The FA1 loop order reads and writes the fp32 running output once per (j, i)
step, so its HBM traffic is about (Nk / BLOCK_N) * Nq * Dv * 8 bytes per (batch, head)
(common/traffic.py): a larger BLOCK_N is the main lever, bounded by what K_j, V_j (held for
the whole inner loop) and the S tile cost in registers and shared memory.

Register and spill counts are from a compile probe (triton 3.6.0 compiling for sm_90a and
sm_75 on a CPU machine, ptxas -v). The pointer-path branches are "no spill, fits shared
memory", not "fastest"; the sm90 TMA branch quotes the H200 timings that chose it. The pointer
path uses num_stages = 1: the O_i / dQ_i read-modify-write of every inner step leaves little to
prefetch, and stage 2 added spills (28-200 B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashsuite.common.validation import AttnParams

#: Head dims the kernels take; non-powers of two are padded to the next power (masked).
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Fa1Config:
    """One launch configuration (the same shape serves the forward and the backward)."""

    block_m: int  # B_r: Q rows per inner step
    block_n: int  # B_c: K/V rows per outer step, held on chip for the whole inner loop
    num_warps: int
    num_stages: int
    # Forward only, sm90 + fp16/bf16: Q, K, V, O_i loads and the Out store through TMA
    # descriptors (kernels.py, USE_DESC); the launcher falls back to pointers where a stride or
    # base is not 16-byte aligned.
    use_tma: bool = False
    # With use_tma: K_j, V_j load as two halves of block_n / 2 rows and each (j, i) step runs
    # S, P on one half after the other (kernels.py SPLIT_KV): B_c = block_n for the O_i round
    # trips, block_n / 2 for registers.
    split_kv: bool = False


def padded_head_dim(head_dim: int) -> int:
    """The constexpr tile width for a head dim: next power of two, at least 16 (tl.dot's K)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _smem_kb(arch: int) -> int:
    """Shared memory per block (KB) an arch can give one program."""
    if arch in (80, 87):
        return 163  # A100 / Orin
    if arch >= 90:
        return 227  # H100 / H200
    if arch >= 80:
        return 99  # sm86 / sm89 (consumer Ampere, Ada)
    return 64  # Turing


def fwd_config(
    head_dim: int, dtype: torch.dtype, arch: int | None, causal: bool = False, tma: bool = True
) -> Fa1Config:
    """Forward tiles for a head dim, input dtype, arch (None = the interpreter) and mask.

    `tma=False`: the pointer-path entry (the launcher's fallback where a tensor is not
    16-byte aligned for a TMA descriptor).
    """
    d = padded_head_dim(head_dim)
    if tma and arch is not None and arch >= 90 and dtype != torch.float32 and d <= 128:
        # sm90: TMA descriptors, 64-row wgmma tiles per warpgroup, K_j / V_j as two 128-row
        # halves (B_c = 256: one O_i round trip per 256 keys, S and P 128 wide).
        # benchmarks/fa1_tune.py --tma on the H200 (2026-11-29, commit 8799983, bf16,
        # B·N = 16k, Hq·D = 2048, non-causal, TFLOP/s at N = 2k / 16k, materialising attention
        # in the same run 73 / 89 at D = 64, 152 / 175 at D = 128; the pointer path's 32 x 256
        # tiles 82 / 80, 112 / 131):
        #   D = 64:  64 x 256 w4 s2 204 / 202; 64 x 128 w4 s3 156 / 160 (no split);
        #            128 x 256 w8 s2 157 / 168.
        #   D = 128: 128 x 256 w8 s1 219 / 236 (104 B of spill stack, TMA_STACK_BYTES); 64 x 256
        #            w4 s1 170 / 197 (48 B); 64 x 128 w4 s1 158 / 161 and s3 147 / 165 (none).
        #            Two stages do not fit next to a 256-row K/V block (Q + O_i + the O_i store
        #            tile: 96 KB per stage at 128 rows); one stage still overlaps the loads of
        #            one warpgroup with the other's work.
        if d <= 64:
            return Fa1Config(64, 256, num_warps=4, num_stages=2, use_tma=True, split_kv=True)
        return Fa1Config(128, 256, num_warps=8, num_stages=1, use_tma=True, split_kv=True)
    if arch is None:
        # Interpreter: cost is per tile element and test shapes are small (N <= 256), so
        # small tiles waste the least on padding.
        return Fa1Config(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if dtype == torch.float32 or arch < 80:
        # No tensor cores: fp32 dots ask for IEEE products (FMA), and Triton 3.6 emits no
        # mma for sm75 (checked: fp16 tl.dot compiles to FMA there). An FMA dot holds both
        # operands in registers, so tiles stay small: 32x32 w4 at d <= 32, 32x32 w8 at d = 64,
        # 16x16 w8 above: no spill on sm90 (compile probe; with 4 warps d = 64..128 spill
        # 12-44 B). On sm75 the d = 64 causal entry spills 8 B (fp32) / 12 B (fp16). An FMA
        # path, kept for correctness, not speed (tests/test_compile_probes.py pins the spill).
        if d <= 32:
            return Fa1Config(block_m=32, block_n=32, num_warps=4, num_stages=1)
        if d <= 64:
            return Fa1Config(block_m=32, block_n=32, num_warps=8, num_stages=1)
        return Fa1Config(block_m=16, block_n=16, num_warps=8, num_stages=1)
    # Tensor cores (sm80+). The fp32 running O_i plus the S tile bound the Q tile: 64-row
    # tiles (wgmma on sm90) spill from d = 96 on (116-584 B at 64x64 / 64x32), so the Q tile
    # is 32 rows (mma.sync) and the K/V tile as large as registers and smem allow, since the
    # O round trips scale with 1 / B_c: 32x256 w8 is 207-220 regs at d = 64 (80 KB) and
    # 231-232 regs at d = 96/128 (144 KB), no spill; the causal variant spills 60-64 B there,
    # 32x128 w8 does not (226 regs, 76 KB).
    if d <= 32:
        return Fa1Config(block_m=64, block_n=64, num_warps=4, num_stages=1)  # 133 regs, wgmma
    if d <= 64:
        return Fa1Config(block_m=32, block_n=256, num_warps=8, num_stages=1)
    if d <= 128:
        if _smem_kb(arch) >= 144 and not causal:
            return Fa1Config(block_m=32, block_n=256, num_warps=8, num_stages=1)
        return Fa1Config(block_m=32, block_n=128, num_warps=8, num_stages=1)
    # d = 256: w4 spills 104 B when causal; w8 is 167-242 regs, 80 KB.
    return Fa1Config(block_m=16, block_n=64, num_warps=8, num_stages=1)


def bwd_config(head_dim: int, dtype: torch.dtype, arch: int | None) -> Fa1Config:
    """Backward tiles: K_j, V_j and the fp32 dK_j, dV_j accumulators stay on chip."""
    d = padded_head_dim(head_dim)
    if arch is None:
        return Fa1Config(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if dtype == torch.float32 or arch < 80:
        # FMA dots (see fwd_config): 16x16 w4 is 158-255 regs, 0 spill up to d = 128 on
        # sm75/sm90; at d = 256, w8 (233 regs) where w4 spills 1 KB.
        return Fa1Config(block_m=16, block_n=16, num_warps=4 if d <= 128 else 8, num_stages=1)
    # Two fp32 accumulators (dK_j, dV_j: B_c x d each) live through the whole inner loop on
    # top of S, dP and the dQ tile: 64-row Q tiles spill 60-900 B at d = 64..128 on sm90,
    # 32-row ones do not (186-242 regs at d <= 64 w4; 210-224 regs at d = 128 w8, 80 KB).
    if d <= 64:
        return Fa1Config(block_m=32, block_n=64, num_warps=4, num_stages=1)
    if d <= 128:
        return Fa1Config(block_m=32, block_n=64, num_warps=8, num_stages=1)
    return Fa1Config(block_m=16, block_n=32, num_warps=8, num_stages=1)  # 228 regs, 65 KB


def config_for(p: AttnParams, arch: int | None, tma: bool = True) -> Fa1Config:
    """The forward config fa1 uses for problem `p` on `arch` (None: the interpreter):
    `fwd_config` of max(head_dim, head_dim_v), the dtype and the causal flag. `tma=False`: the
    pointer-path entry, where a tensor is not 16-byte aligned for a TMA descriptor."""
    return fwd_config(max(p.head_dim, p.head_dim_v), p.dtype, arch, p.causal, tma=tma)


def bwd_config_for(p: AttnParams, arch: int | None) -> Fa1Config:
    """The backward config fa1 uses for problem `p` on `arch`: `bwd_config` of
    max(head_dim, head_dim_v) and the dtype (one tile serves causal and not)."""
    return bwd_config(max(p.head_dim, p.head_dim_v), p.dtype, arch)


# Local memory (the spill stack frame, bytes per thread) of the sm90 TMA forward entries, per
# (padded head_dim, causal), as a launch of the standard sweep (B·N = 16k, Hq·D = 2048) compiles
# them: ptxas "bytes stack frame" in fa1_probe.py's `launch_probe` (N = 2048; Triton 3.6.0, ptxas
# 12.8). On the H200, Triton's `n_spills` is the same frame in 4-byte words: 0 / 14 / 26 / 126
# at D = 64 / 64 causal / 128 / 128 causal, at N = 2k..16k and N = 2000. ptxas's spill stores
# for them: 0 / 64 / 112 / 656 B. CI pins these through the probe (tests/test_compile_probes.py),
# the GPU suite at launch (tests/test_fa1_tma.py), both at that shape: the frame depends on
# the launch's integer specialisation (B = 1, N = 1024, where each program owns one Q block
# and Triton makes that count a constant, gives 24 / 72 / 136 / 400 B). What the spill costs is
# in the measurements: at D = 128 the spilling 128 x 256 tile beats every spill-free tile, 236
# vs 165 TFLOP/s at N = 16k (193 vs 153 at N = 2000; causal 151 vs 138).
TMA_STACK_BYTES: dict[tuple[int, bool], int] = {
    (32, False): 0,
    (32, True): 32,
    (64, False): 0,
    (64, True): 56,
    (128, False): 104,
    (128, True): 504,
}

# Forward programs to aim for per SM (benchmarks/fa1_tune.py, H200 2026-11-29, commit e035e4e, bf16,
# B·N = 16k, Hq·D = 2048, pointer-path tiles): 1 / 2 / 4 / 8 programs per SM gave 71 / 116 /
# 117 / 130 TFLOP/s at D = 128, N = 16k and 52 / 63 / 85 / 87 at D = 64, N = 16k (N = 2k:
# 116 -> 119, 82 -> 86). Only one 32x256 program fits an SM at a time (144 KB of shared
# memory): more, shorter programs shrink the last wave and the per-program serial K/V
# prologue. The sm90 TMA tiles keep 8: `tune --tma --per-sm 2 --per-sm 8`
# (fa1-tune-tma-8799983.json), shipped tiles at N = 16k: 8 gives 236 / 202 TFLOP/s
# (D = 128 / 64) against 232 / 145 for 2; at N = 2k 2 per SM is the faster one, 219 / 204
# against 201 / 192 (one value serves every N).
PROGRAMS_PER_SM = 8


def q_splits(
    batch_heads: int, num_q_blocks: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM
) -> int:
    """How many programs share one (batch, head) of the forward, along the Q blocks.

    The paper's grid is one program per (batch, head). Here the Q blocks of a head are shared
    out over several programs (same loop order inside each) until there are about
    `programs_per_sm` programs per SM; each split re-reads K and V (common/traffic.py,
    q_splits; mostly L2 hits, since the splits of a head run at the same time).
    """
    return max(1, min(num_q_blocks, -(-programs_per_sm * num_sms // batch_heads)))
