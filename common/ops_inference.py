"""Custom ops for the inference entry points, one set per version (like common/ops.py):

    flashsuite::<name>_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal, scale, window_left, window_right,
                                  softcap) -> (out, lse)
    flashsuite::<name>_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ...same
                                  scalars) -> (dq, dk, dv)
    flashsuite::<name>_kvcache_fwd(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                   causal, scale, window_left, window_right, softcap,
                                   num_splits, cache_leftpad=None, descale_k=None,
                                   descale_v=None) -> (out, lse) (mutates k_cache, v_cache)

Fake implementations give torch.compile(fullgraph=True) the output shapes; the varlen forward's
autograd formula calls the varlen backward on the saved (q, k, v, out, lse) and cu_seqlens.
The metadata value checks (a device-to-host copy, once per set of metadata tensors and
their versions: `check_varlen_metadata_once`, `check_kvcache_metadata_once`) run inside the
ops, where the graph does not see them.
(No `from __future__ import annotations`: custom_op reads the annotations.)
"""

from types import ModuleType
from typing import Optional

import torch

from flashsuite.common.metadata import (
    check_kvcache_metadata_once,
    check_varlen_metadata_once,
    metadata_checks_enabled,
)
from flashsuite.common.ops import grads_in
from flashsuite.common.validation import KVCacheParams, check_kvcache_inputs, check_varlen_inputs


def varlen_params(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap):
    return check_varlen_inputs(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal=causal,
        softmax_scale=scale,
        window_size=(wl, wr),
        softcap=softcap,
    )


class VarlenOp:
    """flashsuite::<name>_varlen_fwd/_bwd for a version module with varlen_forward/_backward."""

    def __init__(self, name: str, mod: ModuleType) -> None:
        self.name = name
        self.fwd = _define_varlen_forward(name, mod)
        self.bwd = _define_varlen_backward(name, mod) if hasattr(mod, "varlen_backward") else None
        self.fwd.register_autograd(self._backward, setup_context=self._setup_context)

    @staticmethod
    def _setup_context(ctx, inputs, output) -> None:
        q, k, v, cu_q, cu_k = inputs[:5]
        ctx.set_materialize_grads(False)  # an unused out or LSE: None, not a tensor of zeros
        ctx.options = inputs[5:]
        ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)

    def _backward(self, ctx, dout, dlse):
        if self.bwd is None:
            raise RuntimeError(f"{self.name}: this version has no varlen backward")
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dout, dlse = grads_in(out, dout, dlse)
        dq, dk, dv = self.bwd(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.options, dlse)
        return (dq, dk, dv) + (None,) * 9


def _define_varlen_forward(name: str, mod: ModuleType):
    @torch.library.custom_op(f"flashsuite::{name}_varlen_fwd", mutates_args=())
    def fwd(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        scale: float,
        window_left: int,
        window_right: int,
        softcap: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vp = varlen_params(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal, scale, window_left, window_right, softcap,
        )  # fmt: skip
        if metadata_checks_enabled():
            check_varlen_metadata_once(cu_seqlens_q, cu_seqlens_k, vp)
        out, lse = mod.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, vp)
        return out.contiguous(), lse.contiguous()

    @fwd.register_fake
    def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap):
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))  # (total_q, Hq, Dv)
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)  # (Hq, total_q)
        return out, lse

    return fwd


def _define_varlen_backward(name: str, mod: ModuleType):
    @torch.library.custom_op(f"flashsuite::{name}_varlen_bwd", mutates_args=())
    def bwd(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        scale: float,
        window_left: int,
        window_right: int,
        softcap: float,
        dlse: Optional[torch.Tensor] = None,  # noqa: UP045 (custom_op schema inference)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        vp = varlen_params(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal, scale, window_left, window_right, softcap,
        )  # fmt: skip
        grads = mod.varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, vp, dlse=dlse
        )
        return tuple(g.contiguous() for g in grads)

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, *_args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    return bwd


def kvcache_params(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, wl, wr, softcap, splits,
    leftpad=None, descale_k=None, descale_v=None,
) -> KVCacheParams:  # fmt: skip
    return check_kvcache_inputs(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        causal=causal,
        softmax_scale=scale,
        window_size=(wl, wr),
        softcap=softcap,
        num_splits=splits,
        cache_leftpad=leftpad,
        descale_k=descale_k,
        descale_v=descale_v,
    )


def define_kvcache_op(name: str, mod: ModuleType):
    """flashsuite::<name>_kvcache_fwd for a version module with kvcache_forward."""

    @torch.library.custom_op(f"flashsuite::{name}_kvcache_fwd", mutates_args=("k_cache", "v_cache"))
    def fwd(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: Optional[torch.Tensor],  # noqa: UP045 (custom_op schema inference)
        v: Optional[torch.Tensor],  # noqa: UP045
        cache_seqlens: torch.Tensor,
        block_table: Optional[torch.Tensor],  # noqa: UP045
        causal: bool,
        scale: float,
        window_left: int,
        window_right: int,
        softcap: float,
        num_splits: int,
        cache_leftpad: Optional[torch.Tensor] = None,  # noqa: UP045
        descale_k: Optional[torch.Tensor] = None,  # noqa: UP045
        descale_v: Optional[torch.Tensor] = None,  # noqa: UP045
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kp = kvcache_params(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, scale, window_left,
            window_right, softcap, num_splits, cache_leftpad, descale_k, descale_v,
        )  # fmt: skip
        if metadata_checks_enabled():
            check_kvcache_metadata_once(cache_seqlens, block_table, kp, None, cache_leftpad)
        scales = (descale_k, descale_v) if kp.fp8_cache else None
        out, lse = mod.kvcache_forward(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp, leftpad=cache_leftpad,
            descales=scales,
        )  # fmt: skip
        return out.contiguous(), lse.contiguous()

    @fwd.register_fake
    def _(q, k_cache, v_cache, *_args):
        b, nq, hq, _ = q.shape
        out = q.new_empty((b, nq, hq, v_cache.shape[-1]))  # (B, Nq, Hq, Dv)
        lse = q.new_empty((b, hq, nq), dtype=torch.float32)  # (B, Hq, Nq)
        return out, lse

    return fwd
