"""The inference entry points: attention_varlen() (packed sequences) and
attention_with_kvcache() (decode / chunked prefill against a KV cache, contiguous or paged),
with flash-attn's argument names, and their select/explain.

Selection works as for `attention` (dispatch/api.py): the candidates of `auto_order(arch)`,
each asked through its `supports_varlen` / `supports_kvcache`; a version without that entry
point answers no, and auto passes by a version whose `VARLEN_AUTO_SELECT` (packed sequences)
or `KVCACHE_AUTO_SELECT` (KV cache) is False (that path runs only when asked for by name). A
version without a varlen backward of its own is differentiated by its partner's
(`registry.BACKWARD_PARTNER`) on the saved tensors; one whose own varlen backward is partial
(`supports_varlen_backward`: fa3) by its own where `registry.own_varlen_backward` says yes,
decided per call, else by the partner's. An explicit `version=` never falls back.
Design: docs/inference.md.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from flashsuite.common import arch as arch_mod
from flashsuite.common.fp8 import to_e4m3
from flashsuite.common.kvcache import length_tensor
from flashsuite.common.metadata import (
    check_kvcache_metadata_once,
    check_varlen_metadata_once,
    metadata_checks_enabled,
)
from flashsuite.common.ops import grads_in
from flashsuite.common.ops_inference import VarlenOp, define_kvcache_op
from flashsuite.common.validation import (
    AttnParams,
    KVCacheParams,
    VarlenParams,
    check_flag,
    check_kvcache_inputs,
    check_varlen_inputs,
    remember,
    signature,
)
from flashsuite.dispatch import api, fallback, registry
from flashsuite.dispatch.api import Choice, Unsupported, auto_order, explain_choice

_ENTRY = {"varlen": "attention_varlen", "kvcache": "attention_with_kvcache"}


def _varlen_backward_source(
    name: str, vp: VarlenParams | None = None, arch: int | None = None
) -> str | None:
    """The version whose varlen backward differentiates `name`'s varlen forward on `vp`: its
    own (a partial one where `registry.own_varlen_backward` says yes), else its partner's where
    that is available (None: no varlen backward). Without `vp`, a partial own backward answers
    with the partner."""
    mod = registry.module(name)
    if hasattr(mod, "varlen_backward") and not hasattr(mod, "supports_varlen_backward"):
        return name
    if vp is not None and registry.own_varlen_backward(name, vp, arch)[0]:
        return name
    partner = registry.BACKWARD_PARTNER.get(name)
    if partner is None or not registry.available(partner)[0]:
        return None
    return partner if hasattr(registry.module(partner), "varlen_backward") else None


def _check(kind: str, name: str, params, arch: int | None, needs_grad: bool) -> tuple[bool, str]:
    ok, reason = registry.available(name)
    if not ok:
        return False, f"not available: {reason}"
    mod = registry.module(name)
    supports = getattr(mod, f"supports_{kind}", None)
    if supports is None:
        return False, f"{name}: no {_ENTRY[kind]} path"
    ok, reason = supports(params, arch)
    if not ok or not needs_grad:
        return ok, reason
    if kind == "kvcache" or _varlen_backward_source(name, params, arch) is None:
        return False, f"{name}: no {_ENTRY[kind]} backward (inputs require grad)"
    if hasattr(mod, "supports_varlen_backward"):
        own, why = registry.own_varlen_backward(name, params, arch)
        if not own:
            partner = _varlen_backward_source(name, params, arch)
            return ok, f"{reason}; backward by {partner}, not its own: {why}"
        reason = f"{reason}; own varlen backward: {why}"
    return ok, reason


def _auto_refusal(kind: str, name: str) -> str | None:
    """Why auto selection passes by `name` for this entry point although it could run it."""
    flag = {"varlen": "VARLEN_AUTO_SELECT", "kvcache": "KVCACHE_AUTO_SELECT"}[kind]
    if not getattr(registry.module(name), flag, True):
        what = {"varlen": "varlen", "kvcache": "split-KV decode"}[kind]
        return (
            f"{name}: {what} kernel not in auto selection yet (not verified on a GPU; "
            f"version='{name}' runs it)"
        )
    return None


def _select(kind: str, params, version: str, needs_grad: bool) -> Choice:
    arch = arch_mod.device_arch(params.attn.device)
    requested = version
    if version == "auto":
        requested = os.environ.get("FLASHSUITE_VERSION", "auto") or "auto"

    def bwd(name: str) -> str | None:
        return _varlen_backward_source(name, params, arch) if needs_grad else None

    if requested != "auto":
        registry.check_name(requested)
        ok, reason = _check(kind, requested, params, arch, needs_grad)
        if not ok:
            raise Unsupported(
                f"version {requested!r} cannot run {params.describe()} on "
                f"{arch_mod.arch_name(arch)}: {reason}"
            )
        how = "FLASHSUITE_VERSION" if version == "auto" else "explicit version="
        return Choice(requested, bwd(requested), arch, (f"{requested}: {how}; {reason}",), params)
    reasons = []
    for name in auto_order(arch):
        if name == fallback.NAME:  # PyTorch's SDPA has no packed or KV-cache entry point here
            continue
        ok, reason = _check(kind, name, params, arch, needs_grad)
        if ok:
            refusal = _auto_refusal(kind, name)
            ok, reason = (False, refusal) if refusal else (ok, reason)
        reasons.append(f"{name}: {'yes' if ok else 'no'} - {reason}")
        if ok:
            return Choice(name, bwd(name), arch, tuple(reasons), params)
    raise AssertionError("the portable version supports everything")  # pragma: no cover


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# As for `attention`: selection runs once at trace time, its answer a constant of the graph.
@torch.compiler.assume_constant_result
def _resolve(kind: str, version: str, key: tuple, extra: tuple, needs_grad: bool) -> str:
    attn = AttnParams.from_key(key)
    params = VarlenParams(attn, *extra) if kind == "varlen" else KVCacheParams(attn, *extra)
    name = _select(kind, params, version, needs_grad).version
    _op(kind, name)  # define the custom ops before the graph calls them
    return name


@functools.cache
def _op(kind: str, name: str):
    mod = registry.module(name)
    if kind == "kvcache":
        return define_kvcache_op(name, mod)
    if hasattr(mod, "supports_varlen_backward"):
        # A partial own varlen backward: chosen per call, on the problem differentiated.
        return VarlenOp(
            name,
            SimpleNamespace(
                varlen_forward=mod.varlen_forward, varlen_backward=_choosing_varlen_backward(name)
            ),
        )
    source = _varlen_backward_source(name)
    if source is not None and source != name:
        # The forward's module with the partner's varlen backward (same saved tensors).
        mod = SimpleNamespace(
            varlen_forward=mod.varlen_forward,
            varlen_backward=registry.module(source).varlen_backward,
        )
    return VarlenOp(name, mod)


def _choosing_varlen_backward(name: str):
    """A varlen backward that runs `name`'s own where `registry.own_varlen_backward` says yes,
    else the partner's (`_varlen_backward_source`), on the problem being differentiated."""

    def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, vp: VarlenParams, dlse=None):
        source = _varlen_backward_source(name, vp, arch_mod.device_arch(vp.attn.device))
        if source is None:
            raise RuntimeError(f"{name}: no varlen backward can take {vp.describe()}")
        return registry.module(source).varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, vp, dlse=dlse
        )

    return backward


def _extra(params) -> tuple:
    if isinstance(params, VarlenParams):
        return (params.total_q, params.total_k)
    return (
        params.seqlen_new, params.page_size, params.num_pages, params.num_splits, params.leftpad,
        params.fp8_cache,
    )  # fmt: skip


def select_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, version="auto", **options
) -> Choice:
    """What `attention_varlen` would run on these inputs, and why."""
    vp = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options
    )
    return _select("varlen", vp, version, _needs_grad(q, k, v))


def explain_varlen(*args, **kwargs) -> str:
    """`select_varlen`, for humans."""
    return explain_choice(select_varlen(*args, **kwargs))


def select_kvcache(q, k_cache, v_cache, k=None, v=None, *, version="auto", **options) -> Choice:
    """What `attention_with_kvcache` would run on these inputs, and why."""
    options.pop("return_lse", None)
    kp = check_kvcache_inputs(q, k_cache, v_cache, k, v, **options)
    return _select("kvcache", kp, version, False)


def explain_kvcache(*args, **kwargs) -> str:
    """`select_kvcache`, for humans."""
    return explain_choice(select_kvcache(*args, **kwargs))


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    version: str = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences: sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]
    against k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]], each aligned bottom-right on its own lengths.

    q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), fp16/bf16/fp32; cu_seqlens
    int32 (B + 1,) on q's device, starting at 0, non-decreasing, ending at the total; max_seqlen
    an upper bound of the lengths (it may be loose). Returns out (total_q, Hq, Dv) and, with
    `return_lse`, lse (Hq, total_q) float32. Differentiable in q, k, v, through out and lse.
    `sinks` (Hq,): attention sinks, as in `dispatch.attention`.
    """
    check_flag("return_lse", return_lse)
    if sinks is not None:
        api.check_sinks(sinks, q)
        out, lse = attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            return_lse=True, version=version,
        )  # fmt: skip
        return api.with_sinks(out, lse, sinks, return_lse)
    if not api._compiling():
        plan = _varlen_lookup(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
            softmax_scale, window_size, softcap, version,
        )  # fmt: skip
        direct = plan is not None and plan.forward is not None
        if direct and _direct(q, k, v, cu_seqlens_q, cu_seqlens_k):
            vp = plan.params
            if metadata_checks_enabled():
                check_varlen_metadata_once(cu_seqlens_q, cu_seqlens_k, vp)
            if plan.needs_grad:
                out, lse = _EagerVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, plan)
            else:
                out, lse = plan.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, vp)
                out, lse = out.contiguous(), lse.contiguous()
            return (out, lse) if return_lse else out
    vp = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
    )  # fmt: skip
    needs_grad = _needs_grad(q, k, v)
    name = _resolve("varlen", version, vp.attn.to_key(), _extra(vp), needs_grad)
    fwd = getattr(torch.ops.flashsuite, f"{name}_varlen_fwd")
    out, lse = fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *_varlen_op_args(vp))
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class VarlenPlan:
    """What `attention_varlen` decided for one static signature (`_varlen_lookup`): the
    version, the validated problem, whether the inputs need a gradient, the version's varlen
    forward (None where the op must run it: meta tensors) and the version whose varlen backward
    differentiates it on this problem (`_varlen_backward_source`'s; None without a gradient,
    or where no version has one), its function looked up when the backward runs."""

    version: str
    params: VarlenParams
    needs_grad: bool
    forward: object
    backward: str | None


# The eager fast path of attention_varlen: key of one call (`_varlen_lookup`) -> VarlenPlan. One
# validation and one selection per static signature: shapes, dtypes, devices and strides of q,
# k, v, the shapes of cu_seqlens, max_seqlen, the options, the version, the gradient and the
# selection state (deterministic algorithms included: they choose the backward). The values of
# cu_seqlens are checked per call (`check_varlen_metadata_once`).
_varlen_plans: dict[tuple, VarlenPlan] = {}


def _varlen_lookup(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
    window_size, softcap, version,
) -> VarlenPlan | None:  # fmt: skip
    """The memoised plan of one call, validated and selected on a miss (which raises what is
    wrong); None when an argument is not of a memoisable type (the caller then takes the op
    path, which raises the error)."""
    sig = signature(q, k, v, causal, softmax_scale, window_size, softcap)
    if (
        sig is None
        or type(max_seqlen_q) is not int
        or type(max_seqlen_k) is not int
        or type(version) is not str
    ):
        return None
    try:
        cu = (
            cu_seqlens_q.shape, cu_seqlens_q.dtype, cu_seqlens_q.device,
            cu_seqlens_k.shape, cu_seqlens_k.dtype, cu_seqlens_k.device,
        )  # fmt: skip
    except AttributeError:
        return None
    needs_grad = _needs_grad(q, k, v)
    key = (
        sig, cu, max_seqlen_q, max_seqlen_k, version, needs_grad, arch_mod.override_state(),
        api._deterministic(), tuple(map(api._ENV_DATA.get, api._ENV_KEYS)),
    )  # fmt: skip
    plan = _varlen_plans.get(key)
    if plan is None:
        vp = check_varlen_inputs(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        )  # fmt: skip
        name = _resolve("varlen", version, vp.attn.to_key(), _extra(vp), needs_grad)
        real = vp.attn.device.type in ("cpu", "cuda")
        backward = None
        if needs_grad:
            backward = _varlen_backward_source(name, vp, arch_mod.device_arch(vp.attn.device))
        forward = registry.module(name).varlen_forward if real else None
        plan = VarlenPlan(name, vp, needs_grad, forward, backward)
        remember(_varlen_plans, key, plan)
    return plan


class _EagerVarlen(torch.autograd.Function):
    """The varlen op pair's autograd formula without the ops (attention_varlen's eager path):
    the same saved tensors (q, k, v, out, lse, cu_seqlens) and the plan's backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, plan: VarlenPlan):
        out, lse = plan.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, plan.params)
        out, lse = out.contiguous(), lse.contiguous()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.plan = plan
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        plan = ctx.plan
        if plan.backward is None:
            raise RuntimeError(
                f"{plan.version}: no varlen backward can take {plan.params.describe()}"
            )
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dout, dlse = grads_in(out, dout, dlse)
        backward = registry.module(plan.backward).varlen_backward
        dq, dk, dv = backward(dout, q, k, v, out, lse, cu_q, cu_k, plan.params, dlse=dlse)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), None, None, None


def _varlen_op_args(vp: VarlenParams) -> tuple:
    """The varlen ops' scalar arguments after cu_seqlens (common/ops_inference.py)."""
    p = vp.attn
    return (p.seqlen_q, p.seqlen_k, p.causal, p.scale, p.window_left, p.window_right, p.softcap)


def attention_varlen_backward(
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
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    version: str = "auto",
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `attention_varlen` from its saved tensors (dout and out (total_q, Hq, Dv),
    lse (Hq, total_q) float32): the varlen backward that auto selection pairs with these inputs
    under a gradient, recomputing P from q, k and lse. `dlse` (Hq, total_q), the gradient of a
    loss that also uses the LSE, or None."""
    vp = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
    )  # fmt: skip
    if dlse is not None:
        dlse = api.dlse_arg(dlse, "(Hq, total_q)", (vp.attn.heads_q, vp.total_q), q.device)
    name = _select("varlen", vp, version, needs_grad=True).version
    bwd = _op("varlen", name).bwd
    args = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *_varlen_op_args(vp))
    return bwd(*args, dlse)


# The eager fast path of attention_with_kvcache: key of one call (`_kv_lookup`) -> (version,
# problem, the version's kvcache_forward). One validation and one selection per static
# signature, as `attention` memoises its plans: a decode loop repeats one signature every step
# (its lengths are values, checked per call by check_kvcache_metadata_once where enabled).
_kv_plans: dict[tuple, tuple] = {}


def _kv_lookup(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, window_size,
    softcap, num_splits, version, cache_leftpad=None, descale_k=None, descale_v=None,
) -> tuple | None:  # fmt: skip
    """The memoised (version, KVCacheParams, kvcache_forward) of one call, validated and
    selected on a miss (which raises what is wrong); None when an argument is not of a
    memoisable type (the caller then takes the op path, which raises the error)."""
    sig = signature(q, k_cache, v_cache, causal, softmax_scale, window_size, softcap)
    if sig is None or type(num_splits) is not int or type(version) is not str:
        return None
    try:
        new = None
        if k is not None or v is not None:
            new = (k.shape, k.dtype, k.device, k.stride(), v.shape, v.dtype, v.device, v.stride())
        # Lengths are values, checked per call (an int here, a tensor's by
        # check_kvcache_metadata_once): a decode loop's growing length keeps its plan.
        lens = (
            int
            if type(cache_seqlens) is int
            else (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device)
        )
        table = pad = scales = None
        if block_table is not None:
            table = (block_table.shape, block_table.dtype, block_table.device)
        if cache_leftpad is not None:
            pad = (cache_leftpad.shape, cache_leftpad.dtype, cache_leftpad.device)
        if descale_k is not None or descale_v is not None:
            scales = tuple(
                None if t is None else (t.shape, t.dtype, t.device) for t in (descale_k, descale_v)
            )
    except (AttributeError, TypeError, RuntimeError):
        return None
    key = (
        sig, new, lens, table, pad, scales, num_splits, version, arch_mod.override_state(),
        tuple(map(api._ENV_DATA.get, api._ENV_KEYS)),
    )  # fmt: skip
    plan = _kv_plans.get(key)
    if plan is None:
        kp = check_kvcache_inputs(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
            causal=causal, softmax_scale=softmax_scale, window_size=window_size,
            softcap=softcap, num_splits=num_splits, cache_leftpad=cache_leftpad,
            descale_k=descale_k, descale_v=descale_v,
        )  # fmt: skip
        name = _resolve("kvcache", version, kp.attn.to_key(), _extra(kp), False)
        plan = (name, kp, registry.module(name).kvcache_forward)
        remember(_kv_plans, key, plan)
    return plan


def _cache_dtype(k, v, k_cache, descale_k, descale_v):
    """New k, v for a float8 cache, each as given when already e4m3, else rounded to e4m3 with
    its cache's descales (common.fp8.to_e4m3), so that the append copies bytes."""
    if k is None:
        return k, v
    k = k if k.dtype == k_cache.dtype else to_e4m3(k, descale_k)
    v = v if v.dtype == k_cache.dtype else to_e4m3(v, descale_v)
    return k, v


def _direct(*tensors) -> bool:
    """Whether a version's function may run without its custom op: plain tensors, and no
    dispatch or function mode and no profiler that must see the op (as `api._run` decides)."""
    return (
        all(t is None or type(t) is torch.Tensor for t in tensors)
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._is_torch_function_mode_enabled()
        and not torch.autograd._profiler_enabled()
    )


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor | int | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int = 0,
    return_lse: bool = False,
    version: str = "auto",
    cache_leftpad: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against a KV cache (decode, or chunked prefill), forward only.

    q (B, Nq, Hq, D); k_cache, v_cache (B_cache, N_max, Hkv, D|Dv), or with block_table
    (B, max_pages) int32 paged (num_pages, page_size, Hkv, D|Dv), page_size a multiple of 16 in
    [16, 256]; cache_seqlens int32 (B,) or an int: the tokens already in each row. k, v
    (B, Nnew, Hkv, D|Dv), when given, are written into the cache in place at cache_seqlens
    before attending; row b then attends its first cache_seqlens[b] + Nnew tokens, causal
    aligned to the end of that row. num_splits = 0 picks the split-KV count by heuristic.
    cache_leftpad int32 (B,) (a contiguous cache only, as flash-attn's): row b's keys start
    at slot cache_leftpad[b] <= cache_seqlens[b], so it attends slots cache_leftpad[b] ..
    cache_seqlens[b] + Nnew - 1 (a left-padded batch's rows), causal aligned to their end.
    A float8_e4m3fn cache (both k_cache and v_cache) under fp16 / bf16 queries: key t of row b,
    head h is k_cache[...] * descale_k[b, h], float32 descales of shape (B, Hkv) (None: 1), the
    same for v; new k, v in e4m3 are appended as they are, in q's dtype rounded to e4m3 with
    the descales first (common.fp8.to_e4m3). `sinks` (Hq,): attention sinks, as in
    `dispatch.attention`. Returns out (B, Nq, Hq, Dv) in q's dtype and, with `return_lse`, lse
    (B, Hq, Nq) float32, neither carrying a gradient.
    """
    check_flag("return_lse", return_lse)
    if sinks is not None:
        api.check_sinks(sinks, q)
        out, lse = attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
            causal=causal, softmax_scale=softmax_scale, window_size=window_size,
            softcap=softcap, num_splits=num_splits, return_lse=True, version=version,
            cache_leftpad=cache_leftpad, descale_k=descale_k, descale_v=descale_v,
        )  # fmt: skip
        with torch.no_grad():  # forward only, as the rest of this entry point
            return api.with_sinks(out, lse, sinks, return_lse)
    if not api._compiling():
        plan = _kv_lookup(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale,
            window_size, softcap, num_splits, version, cache_leftpad, descale_k, descale_v,
        )  # fmt: skip
        if plan is not None and type(cache_seqlens) is int:
            capacity, new = plan[1].attn.seqlen_k, plan[1].seqlen_new
            if not 0 <= cache_seqlens <= capacity - new:
                plan = None  # the op path's validation says what is wrong
        tensors = (q, k_cache, v_cache, k, v, block_table, cache_leftpad, descale_k, descale_v)
        if plan is not None and _direct(*tensors):
            _, kp, forward = plan
            # An int length is checked above, on the host: only a block table or a left
            # padding is left to check, so a contiguous decode step copies nothing to the host.
            check = metadata_checks_enabled() and (
                block_table is not None
                or cache_leftpad is not None
                or type(cache_seqlens) is not int
            )
            length = None
            if type(cache_seqlens) is int:
                length = cache_seqlens
                cache_seqlens = length_tensor(q.shape[0], length, q.device)
            if type(cache_seqlens) is torch.Tensor:  # (a subclass takes the op path)
                if check:
                    check_kvcache_metadata_once(
                        cache_seqlens, block_table, kp, length, cache_leftpad
                    )
                # What the op's implementation runs (common.ops_inference), without its layers,
                # and without a gradient (a serving loop's no_grad or inference_mode already
                # holds: entering no_grad again would cost more than the check).
                scales = None
                if kp.fp8_cache:
                    scales = (descale_k, descale_v)
                    k, v = _cache_dtype(k, v, k_cache, descale_k, descale_v)
                args = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp)
                if torch.is_grad_enabled():
                    with torch.no_grad():
                        out, lse = forward(*args, leftpad=cache_leftpad, descales=scales)
                else:
                    out, lse = forward(*args, leftpad=cache_leftpad, descales=scales)
                out, lse = out.contiguous(), lse.contiguous()
                return (out, lse) if return_lse else out
    kp = check_kvcache_inputs(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        num_splits=num_splits, cache_leftpad=cache_leftpad, descale_k=descale_k,
        descale_v=descale_v,
    )  # fmt: skip
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    name = _resolve("kvcache", version, kp.attn.to_key(), _extra(kp), False)
    p = kp.attn
    if kp.fp8_cache:
        k, v = _cache_dtype(k, v, k_cache, descale_k, descale_v)
    # Forward only (the op mutates the cache, so it has no autograd formula): the results
    # carry no gradient, whatever requires grad.
    with torch.no_grad():
        out, lse = getattr(torch.ops.flashsuite, f"{name}_kvcache_fwd")(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, p.causal, p.scale,
            p.window_left, p.window_right, p.softcap, kp.num_splits, cache_leftpad, descale_k,
            descale_v,
        )  # fmt: skip
    return (out, lse) if return_lse else out
