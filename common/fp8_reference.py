"""Reference fp8 attention: what an fp8 kernel computes from quantised q, k, v in any scaling
mode (common/fp8.py), in PyTorch on any device.

The specification of the fp8 numerics, for tests of fp8 kernels and for the accuracy studies
(benchmarks/fp8_scaling_study.py): q, k and v are the values their descales imply (per tensor,
per (batch, head) or per block of rows, dequantised in float32), the scores are computed and
softmaxed in float32, and P = exp(S - rowmax) is rounded to e4m3 before P·V, as an fp8 kernel
must feed its P·V tensor-core product (P in [0, 1] needs no scale); the row sum stays float32.
The row max is the final one: a kernel's online softmax rounds P against a running max instead,
a difference tests/test_fp8.py shows to be within the suite's fp8 factor.

Shapes: B batch, Nq/Nk query/key length, Hq/Hkv query/kv heads, G = Hq // Hkv, D head dim.
"""

from __future__ import annotations

import torch

from flashsuite.common.fp8 import E4M3, Fp8Tensor
from flashsuite.common.reference import visibility_mask


def scores_capped_and_masked(s: torch.Tensor, options: dict) -> torch.Tensor:
    """Scaled scores (B, Hq, Nq, Nk) with the softcap of `options` applied and the keys a query
    may not see (causal / window, bottom-right) set to -inf."""
    softcap = options.get("softcap", 0.0)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)  # (B, Hq, Nq, Nk)
    visible = visibility_mask(
        s.shape[-2],
        s.shape[-1],
        causal=options.get("causal", False),
        window_size=options.get("window_size", (-1, -1)),
        device=s.device,
    )  # (Nq, Nk)
    return s.masked_fill(~visible, float("-inf"))  # (B, Hq, Nq, Nk)


def _check_operands(q: Fp8Tensor, k: Fp8Tensor, v: Fp8Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Fp8Tensor):
            raise TypeError(f"{name}: expected an Fp8Tensor (common.fp8.quantize), got {type(t)}")
    (b, _, hq, d), (bk, nk, hkv, dk) = q.data.shape, k.data.shape
    bv, nv, hv, _ = v.data.shape
    if (bk, bv) != (b, b):
        raise ValueError(f"k, v: expected batch {b} (q's), got {bk} and {bv}")
    if dk != d:
        raise ValueError(f"k: expected head dim {d} (q's), got {dk}")
    if (nv, hv) != (nk, hkv):
        raise ValueError(f"v: expected (Nk, Hkv) = {(nk, hkv)} (k's), got {(nv, hv)}")
    if hq % hkv:
        raise ValueError(f"q: expected a multiple of k's {hkv} heads, got {hq}")
    for name, t in (("k", k), ("v", v)):
        if t.group != 1:
            raise ValueError(f"{name}: expected group 1 (a descale per kv head), got {t.group}")
    if (hq // hkv) % q.group:
        raise ValueError(
            f"q: expected a group dividing Hq // Hkv = {hq // hkv} (a descale never spans two "
            f"kv heads), got {q.group}"
        )
    devices = {t.data.device for t in (q, k, v)}
    if len(devices) > 1:
        raise ValueError(f"q, k, v: expected one device, got {sorted(map(str, devices))}")


def attention_fp8(
    q: Fp8Tensor,
    k: Fp8Tensor,
    v: Fp8Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    out_dtype: torch.dtype = torch.bfloat16,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of fp8 q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv), each an
    Fp8Tensor in its own scaling mode, with P rounded to e4m3 (module docstring).

    Options as dispatch.attention (bottom-right causal, window, softcap; softmax_scale None is
    1/√D). Returns out (B, Nq, Hq, Dv) in `out_dtype` (bf16, an fp8 kernel's output, by
    default) and with `return_lse` also lse (B, Hq, Nq) float32 of the dequantised scores.
    Rows that see no key give out 0 and LSE -inf.
    """
    _check_operands(q, k, v)
    hq, d = q.data.shape[2:]
    g = hq // k.data.shape[2]
    qf = q.dequantize()  # (B, Nq, Hq, D) float32
    kf = k.dequantize().repeat_interleave(g, dim=2)  # (B, Nk, Hq, D)
    vf = v.dequantize().repeat_interleave(g, dim=2)  # (B, Nk, Hq, Dv)
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale  # (B, Hq, Nq, Nk)
    options = dict(causal=causal, window_size=window_size, softcap=softcap)
    s = scores_capped_and_masked(s, options)  # (B, Hq, Nq, Nk)
    m = s.amax(-1, keepdim=True)  # (B, Hq, Nq, 1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # no -inf - -inf
    p = torch.exp(s - m)  # (B, Hq, Nq, Nk), 0 where masked
    denom = p.sum(-1, keepdim=True)  # (B, Hq, Nq, 1), float32 like a kernel's row sum
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(E4M3).float(), vf)  # (B, Nq, Hq, Dv)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom).transpose(1, 2)
    out = (out / denom).to(out_dtype)  # (B, Nq, Hq, Dv)
    if not return_lse:
        return out
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, Nq), -inf where the row sees nothing
    return out, lse.float()
