"""flashsuite as the flash backend of PyTorch's SDPA (`torch.nn.attention`'s plug-in point).

    from flashsuite import dispatch
    dispatch.activate_sdpa()            # or: with dispatch.sdpa_plugin(): ...
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # unmodified model code
    dispatch.deactivate_sdpa()          # PyTorch's own flash kernel again

PyTorch routes SDPA's flash backend through a few aten ops, whose CUDA kernels a provider
may replace (`torch.nn.attention.register_flash_attention_impl`, where FA3 and FA4 register
too). Activation registers flashsuite's implementations of

    _scaled_dot_product_flash_attention (+ _backward)   F.scaled_dot_product_attention,
                                                        nn.MultiheadAttention, causal biases
    _flash_attention_forward (+ _backward)              torch.nn.attention.varlen, nested
    _flash_attention_forward_no_dropout_inplace         varlen_attn_out (where torch has it)

for the CUDA dispatch key. Each runs `dispatch.attention` (or `attention_varlen`) with auto
selection, so a call reaches fa3 / fa2 where they take it, and the backward op runs the
backward auto selection pairs with it, from the saved out and log-sum-exp (every version
computes the same function and the same natural-log LSE, so any version's backward is
exact on any version's forward). PyTorch decides first whether a call goes to its flash backend
at all (fp16/bf16, head_dim <= 256, no dense mask, ...); what reaches the plug-in but no kernel
takes (e.g. a head_dim of 80) runs flashsuite's portable version, which is exact but slow.
What flashsuite does not implement raises a RuntimeError that says so: dropout_p > 0,
return_debug_mask, ALiBi slopes, seqused_k, a paged block_table.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

IMPL_NAME = "flashsuite"


def _refuse(op: str, **unsupported: object) -> None:
    """RuntimeError naming the first argument flashsuite does not implement, with its value
    (None, False and 0 are the values that ask for nothing)."""
    for name, value in unsupported.items():
        if torch.is_tensor(value):
            shown = f"a tensor of shape {tuple(value.shape)}"
        elif value is None or value is False or value == 0:
            continue
        else:
            shown = repr(value)
        raise RuntimeError(
            f"flashsuite SDPA plug-in ({op}): {name} is not supported (got {shown}); "
            f"dispatch.deactivate_sdpa() restores PyTorch's own flash kernel"
        )


def _bnhd(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """(B, H, N, D) -> (B, N, H, D) views; a copy only where the last dim is not contiguous."""
    out = []
    for t in tensors:
        t = t.transpose(1, 2)
        out.append(t if t.size(-1) <= 1 or t.stride(-1) == 1 else t.contiguous())
    return out


def _like(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` with the strides of empty_like(ref) (what PyTorch's meta kernels promise for these
    ops' outputs), copied only where they differ."""
    if t.stride() == ref.stride():
        return t
    res = torch.empty_like(ref, dtype=t.dtype)
    return t if res.stride() == t.stride() else res.copy_(t)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (seed, offset) pair the flash ops return for dropout; unused without dropout."""
    seed = torch.zeros(2, dtype=torch.uint64, device=device)
    return seed, torch.zeros((), dtype=torch.uint64, device=device)


def _window(left: int | None, right: int | None) -> tuple[int, int]:
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def sdpa_flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
):
    """aten::_scaled_dot_product_flash_attention: query (B, Hq, Nq, D), key and value
    (B, Hkv, Nk, D); is_causal is bottom-right (PyTorch sends square problems, or a
    `causal_lower_right` bias). Returns (out like query, lse (B, Hq, Nq) float32, None, None,
    Nq, Nk, seed, offset, empty debug mask)."""
    from flashsuite.dispatch import api

    _refuse("forward", dropout_p=dropout_p, return_debug_mask=return_debug_mask)
    q, k, v = _bnhd(query, key, value)
    out, lse = api.attention(q, k, v, causal=is_causal, softmax_scale=scale, return_lse=True)
    seed, offset = _rng_state(query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    out = _like(query, out.transpose(1, 2))  # (B, Hq, Nq, D)
    return out, lse, None, None, query.size(2), key.size(2), seed, offset, debug


def sdpa_flash_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: torch.Tensor,
    philox_offset: torch.Tensor,
    *,
    scale: float | None = None,
):
    """aten::_scaled_dot_product_flash_attention_backward: grad_query, grad_key, grad_value
    like query, key, value (layout (B, H, N, D))."""
    from flashsuite.dispatch import api

    _refuse("backward", dropout_p=dropout_p)
    dout, q, k, v, o = _bnhd(grad_out, query, key, value, out)
    dq, dk, dv = api.attention_backward(dout, q, k, v, o, logsumexp, causal=is_causal,
                                        softmax_scale=scale)  # fmt: skip
    return tuple(_like(t, g.transpose(1, 2)) for t, g in ((query, dq), (key, dk), (value, dv)))


def flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    return_debug_mask: bool,
    *,
    scale: float | None = None,
    window_size_left: int | None = None,
    window_size_right: int | None = None,
    seqused_k: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
):
    """aten::_flash_attention_forward, flash-attn's layout: dense query (B, Nq, Hq, D) or, with
    cum_seq_q / cum_seq_k int32 (B + 1,), packed (total_q, Hq, D) against (total_k, Hkv, D).
    Returns (out like query, lse (B, Hq, Nq) or (Hq, total_q) float32, seed, offset, empty
    debug mask). `num_splits` is a performance hint flashsuite's kernels choose for themselves;
    `out`, when given, receives the output."""
    from flashsuite.dispatch import api, inference

    _refuse(
        "_flash_attention_forward",
        dropout_p=dropout_p,
        return_debug_mask=return_debug_mask,
        seqused_k=seqused_k,
        alibi_slopes=alibi_slopes,
        block_table=block_table,
    )
    window = _window(window_size_left, window_size_right)
    options = dict(causal=is_causal, softmax_scale=scale, window_size=window, return_lse=True)
    if cum_seq_q is None and cum_seq_k is None:
        result, lse = api.attention(query, key, value, **options)
    elif cum_seq_q is not None and cum_seq_k is not None:
        result, lse = inference.attention_varlen(
            query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k), **options
        )
    else:
        given = "cum_seq_q" if cum_seq_q is not None else "cum_seq_k"
        raise RuntimeError(
            "flashsuite SDPA plug-in (_flash_attention_forward): cum_seq_q and cum_seq_k are "
            f"given together or not at all (got only {given})"
        )
    if out is not None:
        out.copy_(result)
        result = out
    seed, offset = _rng_state(query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return _like(query, result), lse, seed, offset, debug


def flash_forward_into(
    out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """aten::_flash_attention_forward_no_dropout_inplace: `_flash_attention_forward` writing
    its output into `out`; returns the LSE."""
    return flash_forward(query, key, value, *args, out=out, **kwargs)[1]


def flash_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: torch.Tensor | None,
    cum_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    rng_state: torch.Tensor,
    unused: torch.Tensor,
    *,
    scale: float | None = None,
    window_size_left: int | None = None,
    window_size_right: int | None = None,
):
    """aten::_flash_attention_backward: grad_query, grad_key, grad_value like query, key,
    value, dense or packed as in `flash_forward`."""
    from flashsuite.dispatch import api, inference

    _refuse("_flash_attention_backward", dropout_p=dropout_p)
    window = _window(window_size_left, window_size_right)
    options = dict(causal=is_causal, softmax_scale=scale, window_size=window)
    if cum_seq_q is None:
        grads = api.attention_backward(grad_out, query, key, value, out, logsumexp, **options)
    else:
        grads = inference.attention_varlen_backward(
            grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
            int(max_q), int(max_k), **options,
        )  # fmt: skip
    return tuple(_like(t, g) for t, g in zip((query, key, value), grads, strict=True))


# aten op -> implementation; ops this torch does not have are left out.
_IMPLS = {
    "_scaled_dot_product_flash_attention": sdpa_flash_forward,
    "_scaled_dot_product_flash_attention_backward": sdpa_flash_backward,
    "_flash_attention_forward": flash_forward,
    "_flash_attention_backward": flash_backward,
    "_flash_attention_forward_no_dropout_inplace": flash_forward_into,
}


@dataclass
class Handle:
    """The registered kernels; `remove()` unregisters them (PyTorch's own come back)."""

    library: torch.library.Library | None
    ops: tuple[str, ...]

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def register(dispatch_key: str = "CUDA") -> Handle:
    """Register flashsuite's implementations of the flash ops for `dispatch_key` (what
    activation calls, with "CUDA"); the returned handle's `remove()` undoes it."""
    lib = torch.library.Library("aten", "IMPL", dispatch_key)
    ops = tuple(name for name in _IMPLS if hasattr(torch.ops.aten, name))
    for name in ops:
        lib.impl(name, _IMPLS[name], dispatch_key)
    return Handle(lib, ops)


def _torch_registry():
    """torch.nn.attention's registry functions, or None where this torch has none."""
    import torch.nn.attention as attn

    if not hasattr(attn, "register_flash_attention_impl"):
        return None
    return attn


# Without torch's registry (older torch), the active handle is kept here.
_own_handle: Handle | None = None


@functools.cache
def _registered() -> bool:
    """Register the plug-in under IMPL_NAME with torch's registry (once; not activated)."""
    attn = _torch_registry()
    if attn is None:
        return False
    attn.register_flash_attention_impl(IMPL_NAME, register_fn=register)
    return True


def active() -> bool:
    """Whether flashsuite is SDPA's flash backend now."""
    attn = _torch_registry()
    if attn is None:
        return _own_handle is not None
    return attn.current_flash_attention_impl() == IMPL_NAME


def activate_sdpa() -> str:
    """Make flashsuite the flash backend of `F.scaled_dot_product_attention` (and of the other
    flash ops listed in this module's docstring) on CUDA devices; returns the name it is
    registered under in `torch.nn.attention` ("flashsuite"). Idempotent."""
    global _own_handle
    if _registered():
        import torch.nn.attention as attn

        attn.activate_flash_attention_impl(IMPL_NAME)
    elif _own_handle is None:
        _own_handle = register()
    return IMPL_NAME


def deactivate_sdpa() -> None:
    """PyTorch's own flash kernel again, if flashsuite is the active flash backend (another
    provider's activation is left alone)."""
    global _own_handle
    attn = _torch_registry()
    if attn is None:
        if _own_handle is not None:
            _own_handle.remove()
            _own_handle = None
    elif attn.current_flash_attention_impl() == IMPL_NAME:
        attn.restore_flash_attention_impl()


@contextlib.contextmanager
def sdpa_plugin() -> Iterator[str]:
    """Within the block flashsuite is SDPA's flash backend; afterwards whatever was active
    before is again (PyTorch's own kernel, another registered provider, or flashsuite)."""
    attn = _torch_registry()
    if attn is not None:
        previous = attn.current_flash_attention_impl()
    else:
        previous = IMPL_NAME if _own_handle is not None else None
    activate_sdpa()
    try:
        yield IMPL_NAME
    finally:
        if previous is None:
            deactivate_sdpa()
        elif previous != IMPL_NAME:
            attn.activate_flash_attention_impl(previous)


_registered()
