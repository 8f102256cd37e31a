"""FlashAttention-2 kernels in Triton: forward, and the recompute backward.

Layout (the flash-attn convention): q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv),
out (B, Nq, Hq, Dv), lse (B, Hq, Nq) float32 natural log. Any strides with a contiguous last dim.

Schedule (FA2): the forward grid is (Q blocks, Hq, B); each program owns one Q tile for the
whole K/V loop, keeps O and the running (m, l) in registers, rescales by 1/l once at the end.
The softmax runs in base 2 with the softmax scale and log2(e) folded into one multiply.
Masking (bottom-right causal, sliding window, key tail) is handled by splitting the K/V loop
into three stages: masked blocks before, unmasked blocks (no `tl.where`), masked blocks after;
blocks that nobody in the tile can see are never visited. The masked stages (one or two
blocks per tile) run unpipelined (`LOOP_STAGES=1`): pipelined, they mostly held the registers
that made the backward spill 0.3-1 KB in the sm_90a probe (the dK/dV kernel's last stage is a
per-config choice, `TAIL_STAGES`).

Backward: `_bwd_preprocess` computes delta = rowsum(dO * O) and lse2 = LSE * log2(e) (+inf where
P must be 0), both padded to whole blocks so they load without masks; `_bwd_dkdv` runs one
program per (K/V block, Hkv, B), sums dK/dV over every query head of the GQA group in registers
(no atomics), recomputing P = exp2(S * scale * log2e - lse2); dQ is either a separate pass over Q
blocks (`_bwd_dq`, deterministic) or, with `DQ_ATOMIC`, TMA reduce-adds from `_bwd_dkdv` into
an fp32 accumulator through a host tensor descriptor (5 GEMMs per block pair instead of 7).

Plain pointers (no block pointers) everywhere but that dQ accumulator, so the same code runs on
triton 3.6 on the GPU and under TRITON_INTERPRET=1 on CPU tensors. Offsets that can exceed 2^31
(batch, head, sequence start) are formed in int64; per-tile offsets stay int32.

The kernels live by concern: `mask.py` (score transform, masking, the stage boundaries of a
tile), `fwd_kernels.py` (forward), `bwd_kernels.py` (backward). This module re-exports them
under the names the interface, the probes and the other fa2 kernels import.
"""

from __future__ import annotations

from flashsuite.fa2.bwd_kernels import (
    _bwd_dkdv,
    _bwd_dkdv_inner,
    _bwd_dq,
    _bwd_dq_inner,
    _bwd_preprocess,
)
from flashsuite.fa2.fwd_kernels import _attn_fwd, _fwd_inner
from flashsuite.fa2.mask import (
    _NO_SPEC,
    LN2,
    LOG2E,
    _key_range,
    _query_range,
    _scores,
    _tanh,
    _visible,
)

__all__ = [
    "LN2",
    "LOG2E",
    "_NO_SPEC",
    "_attn_fwd",
    "_bwd_dkdv",
    "_bwd_dkdv_inner",
    "_bwd_dq",
    "_bwd_dq_inner",
    "_bwd_preprocess",
    "_fwd_inner",
    "_key_range",
    "_query_range",
    "_scores",
    "_tanh",
    "_visible",
]
