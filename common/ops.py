"""Wrap a version's forward/backward into a `torch.library.custom_op` pair with autograd.

Each version exposes plain `forward(q, k, v, params)` / `backward(dout, q, k, v, out, lse,
params)` functions (docs/versions.md). This module turns them into

    flashsuite::<name>_fwd(q, k, v, causal, scale, window_left, window_right, softcap,
                           descale_q, descale_k, descale_v) -> (out, lse)
    flashsuite::<name>_bwd(dout, q, k, v, out, lse, causal, scale, window_left,
                           window_right, softcap, dlse=None) -> (dq, dk, dv)

with fake (meta) implementations, so `torch.compile(fullgraph=True)` and `torch.export` see
opaque ops with known output shapes, and with the forward's autograd formula calling the
backward op on the saved (q, k, v, out, lse): nothing of size Nq x Nk is ever saved. Both
outputs are differentiable: a gradient reaching the LSE (dlse, None when the LSE is unused)
enters the backward as D = rowsum(dO * O) - dlse, since d lse_i / d s_ij = P_ij.

(No `from __future__ import annotations` here: custom_op reads the annotations to build the
op schema.)
"""

from collections.abc import Callable
from typing import Optional

import torch

from flashsuite.common.validation import AttnParams

ForwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class AttentionOp:
    """The custom-op pair for one version; call it like the forward op."""

    def __init__(self, name: str, forward: ForwardFn, backward: BackwardFn | None) -> None:
        self.name = name
        self.forward_fn, self.backward_fn = forward, backward
        self.fwd = _define_forward(name, forward)
        self.bwd = _define_backward(name, backward) if backward is not None else None
        self.fwd.register_autograd(self._backward, setup_context=self._setup_context)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: AttnParams,
        descale_q: torch.Tensor | None = None,
        descale_k: torch.Tensor | None = None,
        descale_v: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fwd(q, k, v, *p.to_op_args(), descale_q, descale_k, descale_v)

    def eager_autograd(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttnParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward op's result and autograd graph for inputs other than float8, without the
        op: the version's forward and backward called from a torch.autograd.Function. What the
        dispatcher runs in eager mode on plain tensors (the custom op's autograd layer, its
        argument defaults and its dynamo guard cost more host time than a small kernel); the
        op stays the path of torch.compile, torch.export, tensor subclasses and modes."""
        return _EagerAttention.apply(q, k, v, p, self)

    @staticmethod
    def _setup_context(ctx, inputs, output) -> None:
        q, k, v = inputs[:3]
        out, lse = output
        ctx.set_materialize_grads(False)  # an unused out or LSE: None, not a tensor of zeros
        ctx.options = inputs[3 : 3 + len(AttnParams.OP_ARGS)]  # AttnParams.to_op_args()
        ctx.fp8 = q.dtype == torch.float8_e4m3fn
        if not ctx.fp8:
            ctx.save_for_backward(q, k, v, out, lse)

    def _backward(self, ctx, dout, dlse):
        if ctx.fp8:
            raise RuntimeError(f"{self.name}: the float8 path is forward-only (no backward)")
        if self.bwd is None:
            raise RuntimeError(f"{self.name}: this version has no backward")
        q, k, v, out, lse = ctx.saved_tensors
        dout, dlse = grads_in(out, dout, dlse)
        dq, dk, dv = self.bwd(dout, q, k, v, out, lse, *ctx.options, dlse)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def grads_in(out: torch.Tensor, dout, dlse) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients a backward takes from autograd's (None where an output was unused): dout
    as a tensor (zeros when only the LSE was used), dlse float32 contiguous or None."""
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    return dout, dlse


class _EagerAttention(torch.autograd.Function):
    """AttentionOp.eager_autograd: the same saved tensors and backward as the op's autograd
    formula (q, k, v, out, lse; a gradient of the LSE enters as dlse)."""

    @staticmethod
    def forward(ctx, q, k, v, p: AttnParams, op: AttentionOp):
        out, lse = op.forward_fn(q, k, v, p, None, None, None)
        out, lse = out.contiguous(), lse.contiguous()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.p, ctx.op = p, op
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        op = ctx.op
        if op.backward_fn is None:
            raise RuntimeError(f"{op.name}: this version has no backward")
        q, k, v, out, lse = ctx.saved_tensors
        dout, dlse = grads_in(out, dout, dlse)
        dq, dk, dv = op.backward_fn(dout, q, k, v, out, lse, ctx.p, dlse=dlse)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), None, None


def _define_forward(name: str, forward: ForwardFn):
    @torch.library.custom_op(f"flashsuite::{name}_fwd", mutates_args=())
    def fwd(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        window_left: int,
        window_right: int,
        softcap: float,
        descale_q: Optional[torch.Tensor],  # noqa: UP045 (custom_op schema inference)
        descale_k: Optional[torch.Tensor],  # noqa: UP045
        descale_v: Optional[torch.Tensor],  # noqa: UP045
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = AttnParams.from_op_args(q, k, v, causal, scale, window_left, window_right, softcap)
        out, lse = forward(q, k, v, p, descale_q, descale_k, descale_v)
        return out.contiguous(), lse.contiguous()  # no-ops for versions that keep the contract

    @fwd.register_fake
    def _(q, k, v, causal, scale, window_left, window_right, softcap, dq_, dk_, dv_):
        b, nq, hq, _ = q.shape
        out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
        out = q.new_empty((b, nq, hq, v.shape[-1]), dtype=out_dtype)  # (B, Nq, Hq, Dv)
        lse = q.new_empty((b, hq, nq), dtype=torch.float32)  # (B, Hq, Nq)
        return out, lse

    return fwd


def _define_backward(name: str, backward: BackwardFn):
    @torch.library.custom_op(f"flashsuite::{name}_bwd", mutates_args=())
    def bwd(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        window_left: int,
        window_right: int,
        softcap: float,
        dlse: Optional[torch.Tensor] = None,  # noqa: UP045 (custom_op schema inference)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = AttnParams.from_op_args(q, k, v, causal, scale, window_left, window_right, softcap)
        dq, dk, dv = backward(dout, q, k, v, out, lse, p, dlse=dlse)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, causal, scale, window_left, window_right, softcap, dlse=None):
        # Contiguous, like the real implementation returns (the fake must match its strides).
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    return bwd
