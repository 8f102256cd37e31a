"""Tile configurations for the fa2 kernels, as data, with the reason for each choice.

Every bf16/fp16 GPU entry was compiled for sm_90a on a CPU machine (`python -m
benchmarks.fa2_tune --probe`, triton 3.6.0): 0 spilled bytes and shared memory <= 232,448 B
(fp32 entries: see `_fwd_fp32`; `--probe --fp32` lists them). The
candidates are the pointer-load tiles that compile within those limits; the
H200 timing sweep (`python -m benchmarks.fa2_tune --out DIR`) decides between the survivors.
Timings quoted below: H200, 2026-11-29, N=8192 bf16, B·N = 16k, Hq·D = 2048, TFLOP/s (SDPA's
flash backend in the same run in brackets).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashsuite.common.validation import AttnParams

SMEM_LIMIT = 232_448  # bytes of shared memory per CTA on sm90 (227 KB)


@dataclass(frozen=True)
class FwdConfig:
    """Forward tile: BLOCK_M query rows per program, BLOCK_N keys per K/V step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BwdConfig:
    """Backward tiles: (block_m1, block_n1) for the dK/dV kernel (a key block of block_n1
    iterating over query blocks of block_m1), (block_m2, block_n2) for the dQ kernel.
    `dq_atomic` folds dQ into the dK/dV kernel through fp32 atomics (5 GEMMs instead of 7,
    not bitwise reproducible)."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int
    num_warps_dq: int
    num_stages_dq: int
    dq_atomic: bool = False
    # Pipeline the dK/dV kernel's last masked stage (query/key tail) with num_stages instead
    # of running it unpipelined: a register-allocation lever, chosen per tile by the probe.
    tail_pipelined: bool = False
    # Two launches of the dK/dV kernel, dV (2 GEMMs per step) then dK (3 GEMMs, dQ atomics
    # there if asked): 5 GEMMs instead of 4, but one fp32 accumulator and one of K/V tiles
    # live at a time, so D = 256 fits a wgmma tile without spilling.
    split_dkdv: bool = False


def padded_head_dim(head_dim: int, dtype: torch.dtype, wgmma: bool) -> int:
    """The kernels' head-dim tile: the next power of two, at least 16 (tl.dot's K).

    With `wgmma` (a GPU launch, not the interpreter) fp16/bf16 take at least 64: Triton 3.6's
    sm90 wgmma path with a 32-wide operand (64-byte shared-memory rows: the P.V GEMM when
    Dv = 32 beside D = 64) reads shared memory past the kernel's allocation (compute-sanitizer
    memcheck on the H200: "Invalid __shared__ read of size 1024 bytes" in _attn_fwd at D = 64,
    Dv = 32, N = 8..48), which faults the context. The padded columns are masked on load and
    store, so only the speed changes.
    """
    floor = 64 if wgmma and dtype in (torch.float16, torch.bfloat16) else 16
    return max(floor, 1 << (head_dim - 1).bit_length())


def dkdv_launches(cfg: BwdConfig) -> tuple[tuple[str, bool, bool], ...]:
    """(name, WANT_DK, WANT_DV) of each launch of the dK/dV kernel, in order: one doing both,
    or with split_dkdv a dV launch, then a dK launch (interface.backward launches these,
    benchmarks/fa2_tune.py's probe compiles them)."""
    if cfg.split_dkdv:
        return (("dv", False, True), ("dk", True, False))
    return (("dkdv", True, True),)


# Under TRITON_INTERPRET=1 warps and stages mean nothing and each block step costs ~ms: small
# tiles keep several blocks (and every masked/unmasked stage) in play at test sizes (N <= 256).
INTERPRETER_FWD = FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
INTERPRETER_BWD = BwdConfig(
    block_m1=32,
    block_n1=32,
    block_m2=32,
    block_n2=32,
    num_warps=4,
    num_stages=1,
    num_warps_dq=4,
    num_stages_dq=1,
)
PREPROCESS_BLOCK_M = 64  # delta = rowsum(dO * O): memory-bound, any tile that vectorises
# The backward's per-row buffers (delta, lse2) are padded to a multiple of ROW_PAD rows, so
# every backward BLOCK_M (and PREPROCESS_BLOCK_M) must divide it.
ROW_PAD = 128


def fwd_config(head_dim: int, dtype: torch.dtype, causal: bool, arch: int | None) -> FwdConfig:
    """Forward tile for max(D, Dv) = head_dim (96 and 192 run padded to 128 and 256).

    Probe numbers: sm_90a, bf16, registers / spilled bytes / shared memory (§ `tune --probe`).
    """
    if arch is None:
        return INTERPRETER_FWD
    if dtype == torch.float32:
        return _fwd_fp32(head_dim)
    if head_dim <= 64:
        # 128x64 w8 s3: 416 (flash 306), causal 412; 123-131 regs, 0 spills, 64 KB. 128x128
        # w8 s3 (the tutorial's sm90 pick, 240-255 regs) gave 387. 128x128 w4 spills ~400 B.
        cfg = FwdConfig(128, 64, num_warps=8, num_stages=3)
    elif head_dim <= 128:
        # 128x64 w8 s3: 478 (flash 344), causal 464; 203-230 regs, 0 spills, 128 KB. 128x128
        # w8 spills 8-40 B at s3 (and 224 KB); any 4-warp 128-row tile spills 0.9-3.9 KB.
        cfg = FwdConfig(128, 64, num_warps=8, num_stages=3)
    else:
        # D 192/256: 128x32 w8, 255 regs, 0 spills. Non-causal s4 (192 KB): 477 (flash 322),
        # s3 467; causal s3 (160 KB): 431. 128x64 spills 24-112 B and needs s2 to fit;
        # 64-row tiles with 4 warps spill.
        cfg = FwdConfig(128, 32, num_warps=8, num_stages=3 if causal else 4)
    return _fit_smem(cfg, arch)


def bwd_config(head_dim: int, dtype: torch.dtype, causal: bool, arch: int | None) -> BwdConfig:
    """Backward tiles for max(D, Dv) = head_dim.

    The dK/dV kernel keeps K, V (shared memory) and the fp32 dK, dV accumulators of a key block
    for the whole loop, with 4 GEMMs per step: it is the register-bound one. Its masked
    (diagonal / window / tail) stages cost 0.06-1 KB of spills at D=128 for the 64x128 tile
    that is spill-free at D=64 (the unmasked loop alone is clean), so D=128 uses 32-query steps.
    """
    if arch is None:
        return INTERPRETER_BWD
    if dtype == torch.float32:
        return _bwd_fp32(head_dim)
    if head_dim <= 64:
        # Non-causal dK/dV 32x128 w8 s3: 338 (1.18x flash), 205 regs; 64x128 gave 308.
        # Causal 64x128 w8 s3 (FlexAttention's sm90 default): 283 (1.08x), 255 regs; 32x128
        # gave 256. dQ 128x64 w8 s3: 128-163 regs. All 0 spills, <= 81 KB.
        m1 = 64 if causal else 32
        cfg = BwdConfig(m1, 128, 128, 64, num_warps=8, num_stages=3, num_warps_dq=8,
                        num_stages_dq=3)  # fmt: skip
    elif head_dim <= 128:
        # dK/dV 32x128 w8 (96 KB), H200 2026-11-29, N=8192 bf16 (`tune --quick-bwd`):
        # non-causal s3 with the tail stage pipelined 380 TFLOP/s (1.24x flash 307; s2: 327,
        # 32x64 s2: 184); causal s2 with the tail unpipelined 277-279 (0.95x flash
        # 292; pipelined it spills 168 B). 64x128 and 64x64 spill 56-1000 B either way. Both
        # entries sit at 255 regs: small code changes tip them into 8-16 B of spills, so
        # re-probe after any edit of _bwd_dkdv. dQ 128x64 w8 s3: 219-229 regs, 0 spills.
        # dQ by TMA reduce-adds (dq_atomic, 5 GEMMs) measured slower here: 32x64 s2 158,
        # 16x128 s2 193 (non-causal).
        # Causal, H200 2026-11-29, commit e035e4e (`tune --quick-bwd --allow-spill 32`),
        # N = 8k / 16k: s3 with the tail unpipelined 297 / 325 TFLOP/s (1.02 / 1.03x flash
        # 292 / 316) against s2 278 / 300 (0.95x) and 16x128 s3 tail-pipelined 236 / 257. It is
        # the one entry that spills (24 B, KNOWN_SPILL_BYTES): faster than every clean one. D=96
        # causal keeps s2 (s3 spills 72 B there; not timed).
        stages = 2 if causal and head_dim <= 96 else 3
        cfg = BwdConfig(32, 128, 128, 64, num_warps=8, num_stages=stages, num_warps_dq=8,
                        num_stages_dq=3, tail_pipelined=not causal)  # fmt: skip
    elif causal:
        # D 192/256: 132 (0.53x flash 249). Every wgmma dK/dV tile spills: 16x64 / 32x64 w8
        # 0.6-1.2 KB (64 keys x 256 x {K, V, dK, dV}); 64x32 w8 s2 (keys = 32 rows, so
        # mma.sync) is spill-free at 254 regs, 128 KB. dQ: 128x32 spills 16-40 B when causal;
        # 32x32 w4 s2 is clean (209 regs, mma.sync).
        cfg = BwdConfig(64, 32, 32, 32, num_warps=8, num_stages=2, num_warps_dq=4,
                        num_stages_dq=2)  # fmt: skip
    else:
        # dK/dV 64x32 w8 s2 (mma.sync) + dQ 128x32 w8 s3 (255 regs, 224 KB, wgmma): 192 (0.74x
        # flash 258). The one spill-free wgmma dK/dV tile is 16x64 w8 s2 with the tail
        # pipelined (255 regs, 0 spills, 96 KB; s3 48 B): untimed (`tune --quick-bwd` times it).
        cfg = BwdConfig(64, 32, 128, 32, num_warps=8, num_stages=2, num_warps_dq=8,
                        num_stages_dq=3)  # fmt: skip
    return _fit_smem(cfg, arch)


def varlen_fwd_config(
    head_dim: int, dtype: torch.dtype, causal: bool, arch: int | None
) -> FwdConfig:
    """Forward tile of the varlen kernel (fa2/varlen.py): the dense table, except D = 192 causal,
    where the dense 128x32 w8 s3 spills 8 B in the varlen kernel (s2 too); 128x16 is clean
    (242 regs). sm_90a probe (`benchmarks/inference_probe.py`), bf16; not timed on a GPU yet."""
    cfg = fwd_config(head_dim, dtype, causal, arch)
    if arch is not None and dtype != torch.float32 and causal and 128 < head_dim < 256:
        return replace(cfg, block_n=16)
    return cfg


def varlen_bwd_config(
    head_dim: int, dtype: torch.dtype, causal: bool, arch: int | None
) -> BwdConfig:
    """Backward tiles of the varlen kernels (fa2/varlen.py): the dense table, except where a
    varlen kernel, which carries its sequence's bounds through the loop, spills at the dense
    tile. sm_90a probe (`benchmarks/inference_probe.py`), bf16, varlen kernel at the dense tile
    -> the entry here:
    - dK/dV, D <= 64 causal, 64x128: 1704 B -> 32x128 (232 regs, 0 B).
    - dK/dV, D 96/128 causal, 32x128: 136 / 128 B (D = 128 at s2 136, 16x128 80) -> dV and dK
      in two launches at s3 (238-255 regs, 0 B).
    - dK/dV, D > 128 causal, 64x32: 40 B -> 32x32 (180 regs, 0 B).
    - dQ, D > 128 non-causal, 128x32 w8 s3: 80-96 B (64x32 200, s2 96-112) -> the causal
      entry's 32x32 w4 s2 (217-219 regs, 0 B).
    Not timed on a GPU yet."""
    cfg = bwd_config(head_dim, dtype, causal, arch)
    if arch is None or dtype == torch.float32:
        return cfg
    if not causal:
        if head_dim > 128:
            return replace(cfg, block_m2=32, block_n2=32, num_warps_dq=4, num_stages_dq=2)
        return cfg
    if head_dim <= 64:
        return replace(cfg, block_m1=32)
    if head_dim <= 128:
        return replace(cfg, split_dkdv=True, num_stages=3)
    return replace(cfg, block_m1=32)


# Spill bytes (dK/dV kernel) an entry is allowed because it was measured faster than every
# spill-free candidate; the CI probe holds it to this number. Every other entry: 0.
KNOWN_SPILL_BYTES: dict[tuple[str, int, torch.dtype, bool], int] = {
    ("bwd", 128, torch.bfloat16, True): 24,
}


def config_for(p: AttnParams, arch: int | None) -> FwdConfig:
    """The forward config fa2 uses for problem `p` on `arch` (None: the interpreter):
    `fwd_config` of max(head_dim, head_dim_v), the dtype and the causal flag."""
    return fwd_config(max(p.head_dim, p.head_dim_v), p.dtype, p.causal, arch)


def bwd_config_for(p: AttnParams, arch: int | None) -> BwdConfig:
    """The backward config fa2 uses for problem `p` on `arch`: `bwd_config` of
    max(head_dim, head_dim_v), the dtype and the causal flag."""
    return bwd_config(max(p.head_dim, p.head_dim_v), p.dtype, p.causal, arch)


def _fwd_fp32(head_dim: int) -> FwdConfig:
    # fp32 runs its dots in exact fp32 (input_precision="ieee": FMA, no tensor cores), whose
    # operands live in registers: only tiny, unpipelined tiles avoid spills, and spilling FMA
    # code is what took ptxas 20-40 s per kernel on the GPU host. A correct convenience path
    # for checking, not a fast one: compile time matters, speed does not. s1 everywhere
    # (s2 spilled 0.9-4 KB at D>64): D<=64 16x32 w4 71 regs; D>64 16x16 w4 70-138 regs;
    # 0 spills, ~1-2.5 s to compile on the CPU probe machine.
    if head_dim <= 64:
        return FwdConfig(16, 32, num_warps=4, num_stages=1)
    return FwdConfig(16, 16, num_warps=4, num_stages=1)


def _bwd_fp32(head_dim: int) -> BwdConfig:
    # 16x16 s1 for both kernels (see _fwd_fp32), 0 spills, 2-5 s each to compile. Warps per
    # kernel from the probe: D<=64 w4 (44-104 regs); D96/128 dK/dV w4 (94-113 regs; w8
    # spilled 12-24 B causal), dQ w8 (61-72 regs; w4 spilled 28-56 B); D>128 w8 for both
    # (77-99 regs; w4 spilled 76 B, w2 3.3 KB).
    w1 = 4 if head_dim <= 128 else 8
    w2 = 4 if head_dim <= 64 else 8
    return BwdConfig(16, 16, 16, 16, num_warps=w1, num_stages=1, num_warps_dq=w2,
                     num_stages_dq=1)  # fmt: skip


def _fit_smem(cfg, arch: int):
    """The table is measured on sm90 (227 KB of shared memory per CTA). sm80 has 163 KB and
    sm86/sm89 99 KB: drop to 2 pipeline stages there (not probed; correctness over speed)."""
    if arch == 90 or arch >= 100:
        return cfg
    if isinstance(cfg, FwdConfig):
        return replace(cfg, num_stages=min(cfg.num_stages, 2))
    return replace(cfg, num_stages=min(cfg.num_stages, 2), num_stages_dq=min(cfg.num_stages_dq, 2))


def table() -> list[tuple[str, int, torch.dtype, bool, FwdConfig | BwdConfig]]:
    """Every shipped GPU entry as (kind, head_dim, dtype, causal, config), for probes and CI."""
    rows: list[tuple[str, int, torch.dtype, bool, FwdConfig | BwdConfig]] = []
    for dtype in (torch.bfloat16, torch.float32):
        for d in (32, 64, 96, 128, 192, 256):
            for causal in (False, True):
                rows.append(("fwd", d, dtype, causal, fwd_config(d, dtype, causal, 90)))
                rows.append(("bwd", d, dtype, causal, bwd_config(d, dtype, causal, 90)))
    return rows
