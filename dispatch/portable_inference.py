"""The portable version's inference entry points: packed sequences and KV-cache attention.

Both are the dense portable kernel (dispatch/portable.py) run once per sequence on that
sequence's own lengths: exact, any device, every option, and the reference every kernel is
compared with in the GPU checks. The per-sequence loop reads the lengths on the host (one
device-to-host copy per call), which the kernels never do.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from flashsuite.common.kvcache import append_kv, row_kv
from flashsuite.common.validation import KVCacheParams, VarlenParams


def supports_varlen(vp: VarlenParams, arch: int | None) -> tuple[bool, str]:
    return True, "every option, any device (one dense call per sequence)"


def supports_kvcache(kp: KVCacheParams, arch: int | None) -> tuple[bool, str]:
    return True, "every option, any device (one dense call per row, pages gathered)"


def _bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(itertools.pairwise(c))


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, vp: VarlenParams):
    """q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) -> out (total_q, Hq, Dv)
    in q's dtype, lse (Hq, total_q) float32."""
    from flashsuite.dispatch import portable

    p = vp.attn
    out = q.new_zeros(vp.total_q, p.heads_q, p.head_dim_v)  # (total_q, Hq, Dv)
    lse = q.new_full((p.heads_q, vp.total_q), float("-inf"), dtype=torch.float32)
    for (q0, q1), (k0, k1) in zip(_bounds(cu_seqlens_q), _bounds(cu_seqlens_k), strict=True):
        if q1 == q0:
            continue
        pb = replace(p, batch=1, seqlen_q=q1 - q0, seqlen_k=k1 - k0)
        ob, lb = portable.forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], pb)
        out[q0:q1] = ob[0]  # (nq, Hq, Dv)
        lse[:, q0:q1] = lb[0]  # (Hq, nq)
    return out, lse


def varlen_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, vp: VarlenParams, dlse=None
):
    """dq, dk, dv like q, k, v (keys of empty query sequences get zero gradients); `dlse`
    (Hq, total_q), the gradient reaching the LSE (None: 0)."""
    from flashsuite.dispatch import portable

    p = vp.attn
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in zip(_bounds(cu_seqlens_q), _bounds(cu_seqlens_k), strict=True):
        if q1 == q0 or k1 == k0:
            continue
        pb = replace(p, batch=1, seqlen_q=q1 - q0, seqlen_k=k1 - k0)
        grads = portable.backward(
            dout[None, q0:q1],
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            out[None, q0:q1],
            lse[None, :, q0:q1],
            pb,
            dlse=None if dlse is None else dlse[None, :, q0:q1],
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0] for g in grads)
    return dq, dk, dv


def kvcache_forward(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp: KVCacheParams, *, leftpad=None,
    descales=None,
):  # fmt: skip
    """q (B, Nq, Hq, D) against each row's first cache_seqlens[b] + Nnew cache tokens (from
    slot leftpad[b] on, when given), after writing k, v (B, Nnew, Hkv, D) into the cache in
    place. Returns out (B, Nq, Hq, Dv) in q's dtype, lse (B, Hq, Nq) float32. A float8 cache
    (kp.fp8_cache) is read dequantised to float32 by `descales` = (descale_k, descale_v), each
    None (1) or (B, Hkv)."""
    from flashsuite.common.fp8 import dequantised
    from flashsuite.dispatch import portable

    p = kp.attn
    if k is not None:
        append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
    out = q.new_empty(p.batch, p.seqlen_q, p.heads_q, p.head_dim_v)  # (B, Nq, Hq, Dv)
    lse = q.new_empty(p.batch, p.heads_q, p.seqlen_q, dtype=torch.float32)  # (B, Hq, Nq)
    ends = (cache_seqlens.long() + kp.seqlen_new).tolist()
    starts = [0] * len(ends) if leftpad is None else leftpad.tolist()
    for b, (lp, n) in enumerate(zip(starts, ends, strict=True)):
        lp = min(max(lp, 0), n)  # unchecked metadata reads nothing outside the row
        kb = row_kv(k_cache, b, n, block_table)[lp:][None]  # (1, n - lp, Hkv, D)
        vb = row_kv(v_cache, b, n, block_table)[lp:][None]  # (1, n - lp, Hkv, Dv)
        if kp.fp8_cache:  # float32 (1, n - lp, Hkv, D|Dv): the cache's values times descales
            dk, dv = descales or (None, None)
            kb = dequantised(kb, None if dk is None else dk[b : b + 1])
            vb = dequantised(vb, None if dv is None else dv[b : b + 1])
        pb = replace(p, batch=1, seqlen_k=n - lp)
        ob, lb = portable.forward(q[b : b + 1], kb, vb, pb)
        out[b], lse[b] = ob[0], lb[0]
    return out, lse
