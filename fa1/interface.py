"""fa1: FlashAttention-1 (Dao et al. 2022, Alg. 1 and the recompute backward, Alg. 4) in Triton.

The version contract of docs/versions.md: `available`, `supports`, `forward`, `backward`.
Launchers only; the kernels and their loop order are described in `kernels.py`.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import replace

import torch

from flashsuite.common.arch import real_arch, triton_available, triton_interpreter
from flashsuite.common.validation import AttnParams
from flashsuite.fa1.configs import (
    MAX_HEAD_DIM,
    Fa1Config,
    bwd_config_for,
    config_for,
    padded_head_dim,
    q_splits,
)

NAME = "fa1"
HAS_BACKWARD = True

# Turing, FlashAttention-1's own floor. Triton 3.6 compiles for sm75 but emits no mma there
# (tl.dot becomes FMA; checked with a compile probe), so fa1 on Turing is correct, not fast.
MIN_ARCH = 75
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Forward programs per (batch, head): unset = configs.q_splits (1 when B * H fills the GPU),
# "1" = the paper's grid always, n = n splits (also how tests reach the split path on CPU).
SPLITS_ENV = "FLASHSUITE_FA1_QSPLITS"


def available() -> tuple[bool, str]:
    """Triton importable, and a CUDA GPU or the Triton interpreter."""
    return triton_available(NAME)


def supports(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    """Can fa1 take this problem on `arch` (None = CPU, only under the Triton interpreter)?"""
    if arch is None:
        if not triton_interpreter():
            return False, "fa1: needs a CUDA GPU (sm75+) or TRITON_INTERPRET=1 on CPU"
    elif arch < MIN_ARCH:
        return False, f"fa1: needs sm{MIN_ARCH}+ (Turing, FA1's floor), got sm{arch}"
    if p.is_fp8:
        return False, "fa1: float8 inputs not supported (use fa3 on sm90)"
    if p.dtype not in _DTYPES:
        return False, f"fa1: dtype {str(p.dtype).removeprefix('torch.')} not in fp16/bf16/fp32"
    if p.dtype == torch.bfloat16 and arch is not None and arch < 80:
        return False, f"fa1: bfloat16 needs sm80+, got sm{arch}"
    if p.is_local:
        return False, "fa1: sliding window not supported (causal and full attention only)"
    if p.softcap > 0:
        return False, "fa1: softcap not supported"
    for name, d in (("head_dim", p.head_dim), ("head_dim_v", p.head_dim_v)):
        if not 1 <= d <= MAX_HEAD_DIM:
            return False, f"fa1: {name} {d} not in [1, {MAX_HEAD_DIM}]"
    if arch is not None and arch < 80 and max(p.head_dim, p.head_dim_v) > 128:
        return False, f"fa1: head_dim > 128 needs sm80+ (64 KB of shared memory on sm{arch})"
    cfg = config_for(p, arch)
    tiles = f"{cfg.block_m}x{cfg.block_n} tiles, {cfg.num_warps} warps, {cfg.num_stages} stage(s)"
    if cfg.use_tma:
        split = ", K/V block in two halves" if cfg.split_kv else ""
        return True, f"fa1: {tiles}{split}, TMA (pointer loads if a stride is not 16-byte aligned)"
    return True, f"fa1: {tiles}, pointer loads" + (" (Triton interpreter)" if arch is None else "")


def _arch_of(t: torch.Tensor) -> int | None:
    """The arch the kernel will run on (None: CPU tensors under the interpreter)."""
    return real_arch(t.device) if t.is_cuda else None


def _num_splits(batch_heads: int, num_q_blocks: int, q: torch.Tensor) -> int:
    env = os.environ.get(SPLITS_ENV)
    if env:
        return max(1, min(int(env), num_q_blocks))
    if not q.is_cuda:
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return q_splits(batch_heads, num_q_blocks, num_sms)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tl.dot is TF32 on the GPU by default; fp32 inputs ask for true fp32 products.
    return "ieee" if dtype == torch.float32 else "tf32"


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: AttnParams,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    *,
    cfg: Fa1Config | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv), last dim contiguous.

    Returns out (B, Nq, Hq, Dv) contiguous in q's dtype and lse (B, Hq, Nq) float32 (natural
    log, -inf for rows that see no key). Descales are for fp8, which fa1 does not take.
    `cfg` and `splits` override the tile table and the Q splits (benchmarks/fa1_tune.py).
    """
    out, lse, _ = _forward(q, k, v, p, cfg, splits)
    return out, lse


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and positive outer strides that are multiples
    of 16 bytes (the last dim is dense); a broadcast (stride 0) dim of size > 1 does not do."""
    return all(
        t.data_ptr() % 16 == 0
        and all(
            (st > 0 or size == 1) and st * t.element_size() % 16 == 0
            for st, size in zip(t.stride()[:-1], t.shape[:-1], strict=True)
        )
        for t in tensors
    )


def _descriptors(q, k, v, out, o_acc, cfg: Fa1Config):
    """Host TMA descriptors for USE_DESC: rank 4 over the API tensors seen as (B, H, N, D)
    (a strided view, no copy; bounds per sequence, so tails are zero-filled / clipped). The
    unit dims lead, so the kernel's (1, 1, rows, D) boxes reshape to 2-D shared-memory tiles
    that wgmma reads in place (a (1, rows, 1, D) box is copied to registers first)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bd, bdv = padded_head_dim(q.shape[3]), padded_head_dim(v.shape[3])

    def desc(t, block):
        t = t.transpose(1, 2)  # (B, H, N, D) view
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    acc3 = o_acc.flatten(0, 1)  # (B * Hq, Nq, Dv) fp32
    kv_rows = cfg.block_n // 2 if cfg.split_kv else cfg.block_n  # one K/V load's rows
    return (
        desc(q, [1, 1, cfg.block_m, bd]),
        desc(k, [1, 1, kv_rows, bd]),
        desc(v, [1, 1, kv_rows, bdv]),
        TensorDescriptor(acc3, list(acc3.shape), list(acc3.stride()), [1, cfg.block_m, bdv]),
        desc(out, [1, 1, cfg.block_m, bdv]),
    )


def _forward(q, k, v, p: AttnParams, cfg: Fa1Config | None, splits: int | None):
    """`forward`, also returning Triton's compiled kernel (None if nothing was launched)."""
    from flashsuite.fa1.kernels import fa1_fwd_kernel

    b, nq, hq, _ = q.shape
    nk, dv = k.shape[1], v.shape[3]
    out = torch.empty(b, nq, hq, dv, device=q.device, dtype=p.out_dtype)  # (B, Nq, Hq, Dv)
    lse = torch.empty(b, hq, nq, device=q.device, dtype=torch.float32)  # (B, Hq, Nq)
    if b * hq * nq == 0:
        return out, lse, None
    if nk == 0:  # no key at all: every row is fully masked
        return out.zero_(), lse.fill_(-math.inf), None
    grid, args, kwargs = fwd_launch(q, k, v, out, lse, p, cfg, splits, on_gpu=q.is_cuda)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        kernel = fa1_fwd_kernel[grid](*args, **kwargs)
    return out, lse, kernel


def fwd_launch(
    q, k, v, out, lse, p: AttnParams, cfg: Fa1Config | None, splits: int | None, *, on_gpu: bool
) -> tuple[tuple[int, int], tuple, dict]:
    """The forward kernel's grid, positional and keyword arguments (allocating the fp32
    scratch): what `_forward` launches and what benchmarks/fa1_probe.py's launch_probe
    compiles. `on_gpu`: the kernel will run on a GPU (the TMA path then fences its proxies; the
    interpreter has none).
    """
    from flashsuite.fa1.kernels import LOG2E

    b, nq, hq, d = q.shape
    nk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    # Alg. 1 line 2: the running O, m, l live in HBM (fp32); their initial values are folded
    # into the first K/V step, so the buffers need no initialisation pass.
    o_acc = torch.empty(b, hq, nq, dv, device=q.device, dtype=torch.float32)  # (B, Hq, Nq, Dv)
    row_max = torch.empty(b, hq, nq, device=q.device, dtype=torch.float32)  # (B, Hq, Nq)
    row_sum = torch.empty(b, hq, nq, device=q.device, dtype=torch.float32)  # (B, Hq, Nq)
    # TMA descriptors (sm90 entries) need 16-byte strides; otherwise the pointer entry.
    tma_ok = q.dtype != torch.float32 and _tma_ok(q, k, v, out, o_acc)
    if cfg is None:
        cfg = config_for(p, _arch_of(q), tma=tma_ok)
    num_q_blocks = -(-nq // cfg.block_m)
    splits = min(splits, num_q_blocks) if splits else _num_splits(b * hq, num_q_blocks, q)
    per_split = -(-num_q_blocks // splits)
    grid = (b * hq, -(-num_q_blocks // per_split))
    use_desc = cfg.use_tma and tma_ok
    descs = _descriptors(q, k, v, out, o_acc, cfg) if use_desc else (None,) * 5
    if cfg.split_kv and not use_desc:  # an explicit cfg: the pointer path has no halves
        cfg = replace(cfg, block_n=cfg.block_n // 2, split_kv=False)
    args = (
        q, k, v, out, lse, o_acc, row_max, row_sum, *descs,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        nq, nk, hq, hq // hkv, p.scale * LOG2E.value, per_split,
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D=padded_head_dim(d), BLOCK_DV=padded_head_dim(dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_NS=cfg.block_n // 2 if cfg.split_kv else cfg.block_n, SPLIT_KV=cfg.split_kv,
        CAUSAL=p.causal, DOT_PRECISION=_dot_precision(q.dtype), USE_DESC=use_desc,
        PROXY_FENCE=use_desc and on_gpu,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return grid, args, kwargs


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute backward (Alg. 4) from the saved (q, k, v, out, lse); dout like out; `dlse`
    (B, Hq, Nq) float32, the gradient reaching the LSE (None: 0), taken off delta.

    Returns dq, dk, dv contiguous with the shapes and dtypes of q, k, v (dk, dv summed over
    each GQA group). Always deterministic: one program owns a (batch, K/V head), no atomics.
    """
    from flashsuite.fa1.kernels import LOG2E, fa1_bwd_kernel, fa1_bwd_preprocess_kernel

    b, nq, hq, d = q.shape
    nk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    dq = torch.empty(b, nq, hq, d, device=q.device, dtype=q.dtype)  # (B, Nq, Hq, D)
    dk = torch.empty(b, nk, hkv, d, device=q.device, dtype=k.dtype)  # (B, Nk, Hkv, D)
    dv_ = torch.empty(b, nk, hkv, dv, device=q.device, dtype=v.dtype)  # (B, Nk, Hkv, Dv)
    if nq == 0 or nk == 0 or b * hq == 0:
        return dq.zero_(), dk.zero_(), dv_.zero_()
    lse = lse.contiguous()  # (B, Hq, Nq)
    if dout.stride(-1) != 1:  # autograd may hand over expanded gradients (stride 0)
        dout = dout.contiguous()
    delta = torch.empty(b, hq, nq, device=q.device, dtype=torch.float32)  # (B, Hq, Nq)
    dq_acc = torch.empty(b, hq, nq, d, device=q.device, dtype=torch.float32)  # (B, Hq, Nq, D)
    cfg = bwd_config_for(p, _arch_of(q))
    block_dv = padded_head_dim(dv)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        pre_m = 64
        fa1_bwd_preprocess_kernel[(-(-nq // pre_m), b * hq)](
            out, dout, delta,
            out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            nq, hq, HEAD_DIM_V=dv, BLOCK_DV=block_dv, BLOCK_M=pre_m,
        )  # fmt: skip
        if dlse is not None:  # D = rowsum(dO ∘ O) - dlse: d lse_i / d s_ij = P_ij
            delta -= dlse
        fa1_bwd_kernel[(b * hkv,)](
            q, k, v, dout, lse, delta, dq, dk, dv_, dq_acc,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv_.stride(0), dv_.stride(1), dv_.stride(2),
            nq, nk, hkv, hq // hkv, p.scale, p.scale * LOG2E.value,
            HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D=padded_head_dim(d), BLOCK_DV=block_dv,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=p.causal,
            DOT_PRECISION=_dot_precision(q.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return dq, dk, dv_
