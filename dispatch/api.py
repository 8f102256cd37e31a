"""The public API: attention(), select(), explain(), sdpa().

Selection is one table: an ordered list of candidates per architecture, the first whose
`supports(params, arch)` says yes wins. An explicit `version=` never falls back: if it cannot
take the inputs it raises `Unsupported` with the version's own reason.
"""

from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_scalar

from flashsuite.common import arch as arch_mod
from flashsuite.common.validation import (
    AttnParams,
    check_flag,
    check_inputs,
    remember,
    signature,
)
from flashsuite.dispatch import fallback, registry


class Unsupported(ValueError):
    """An explicitly requested version cannot take these inputs (the message says why)."""


def auto_order(arch: int | None) -> tuple[str, ...]:
    """Candidates for version="auto", best first (docs/design.md, "How the pieces fit"):
    the kernels, then on sm80+ PyTorch's own SDPA ("sdpa", dispatch/fallback.py), then the
    portable version."""
    if arch is None:
        return ("torch",)  # CPU: no kernel runs here (the Triton interpreter is for tests)
    if 90 <= arch < 100:
        return ("fa3", "fa2", fallback.NAME, "torch")
    if arch >= 80:
        return ("fa2", fallback.NAME, "torch")
    return ("fa1", "torch")


@dataclass(frozen=True)
class Choice:
    """What would run: the forward's version, the backward's, and why (one line per candidate)."""

    version: str
    backward: str | None
    arch: int | None
    reasons: tuple[str, ...]
    params: AttnParams

    def __str__(self) -> str:
        return explain_choice(self)


_deterministic = arch_mod.deterministic_algorithms


def _needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _check(
    name: str, p: AttnParams, arch: int | None, needs_grad: bool, return_lse: bool
) -> tuple[bool, str]:
    if name == fallback.NAME:  # PyTorch's SDPA: differentiable through PyTorch's autograd
        return fallback.supports(p, arch, return_lse)
    ok, reason = registry.available(name)
    if not ok:
        return False, f"not available: {reason}"
    mod = registry.module(name)
    ok, reason = mod.supports(p, arch)
    if not ok:
        return False, reason
    if needs_grad and not p.is_fp8:
        bwd = registry.backward_source(name, p, arch)
        if bwd is None:
            return False, "no backward available for this version (inputs require grad)"
        partial = hasattr(mod, "supports_backward") and not mod.HAS_BACKWARD
        if bwd != name:
            ok, why = registry.module(bwd).supports(p, arch)
            if not ok:
                return False, f"its backward comes from {bwd}, which cannot take it: {why}"
            reason = f"{reason}; backward by {bwd} (recompute from saved q, k, v, out, lse)"
            if partial:
                reason += f", not its own: {registry.own_backward(name, p, arch)[1]}"
        elif partial:
            reason = f"{reason}; own backward: {registry.own_backward(name, p, arch)[1]}"
    return True, reason


def _select(p: AttnParams, version: str, needs_grad: bool, return_lse: bool = False) -> Choice:
    arch = arch_mod.device_arch(p.device)
    requested = version
    if version == "auto":
        requested = os.environ.get("FLASHSUITE_VERSION", "auto") or "auto"
    if requested != "auto":
        registry.check_name(requested)
        ok, reason = _check(requested, p, arch, needs_grad, return_lse)
        if not ok:
            raise Unsupported(
                f"version {requested!r} cannot run {p.describe()} on "
                f"{arch_mod.arch_name(arch)}: {reason}"
            )
        how = "FLASHSUITE_VERSION" if version == "auto" else "explicit version="
        reasons = (f"{requested}: {how}; {reason}",)
        return Choice(requested, _bwd(requested, needs_grad, p, arch), arch, reasons, p)
    reasons = []
    for name in auto_order(arch):
        ok, reason = _check(name, p, arch, needs_grad, return_lse)
        reasons.append(f"{name}: {'yes' if ok else 'no'} - {reason}")
        if ok:
            return Choice(name, _bwd(name, needs_grad, p, arch), arch, tuple(reasons), p)
    raise AssertionError("the portable version supports everything")  # pragma: no cover


def _bwd(name: str, needs_grad: bool, p: AttnParams, arch: int | None) -> str | None:
    if not needs_grad:
        return None
    return name if name == fallback.NAME else registry.backward_source(name, p, arch)


def select(q, k, v, *, version: str = "auto", **options) -> Choice:
    """What `attention(q, k, v, **options)` would run on this machine, and why."""
    p = check_inputs(q, k, v, **_api_options(options))
    return _select(p, version, _needs_grad(q, k, v), bool(options.get("return_lse", False)))


def explain(q, k, v, *, version: str = "auto", **options) -> str:
    """`select`, for humans: the problem, the architecture, each candidate and its verdict."""
    return explain_choice(select(q, k, v, version=version, **options))


def explain_choice(c: Choice) -> str:
    lines = [f"{c.params.describe()} on {arch_mod.arch_name(c.arch)} -> {c.version}"]
    lines += [f"  {r}" for r in c.reasons]
    if c.version == fallback.NAME:
        lines.append(
            "  runs torch.nn.functional.scaled_dot_product_attention (no flashsuite kernel)"
        )
        if c.backward is not None:
            lines.append("  backward: PyTorch's autograd of scaled_dot_product_attention")
    elif c.backward is not None and c.backward != c.version:
        lines.append(f"  backward: {c.backward} (paired by dispatch on the saved tensors)")
    elif (
        c.backward is not None
        and c.backward == c.version
        and c.version in registry.BACKWARD_PARTNER
    ):
        lines.append(f"  backward: {c.backward}'s own kernel")
    return "\n".join(lines)


_API_DEFAULTS = dict(
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    descale_q=None,
    descale_k=None,
    descale_v=None,
)


def _api_options(options: dict) -> dict:
    unknown = set(options) - set(_API_DEFAULTS) - {"return_lse"}
    if unknown:
        raise TypeError(
            f"unexpected option(s) {sorted(unknown)}; expected some of {sorted(_API_DEFAULTS)}"
        )
    return {key: options.get(key, default) for key, default in _API_DEFAULTS.items()}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    return_lse: bool = False,
    version: str = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention softmax(q·kᵀ·scale)·v, memory O(N).

    q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv), Hq % Hkv == 0, last dim contiguous
    (a float8 v may have its keys contiguous instead: common.fp8.keys_major). Returns out
    (B, Nq, Hq, Dv) in q's dtype (bf16 for float8 inputs) and, with `return_lse=True`, lse
    (B, Hq, Nq) float32 (natural log; -inf where a row sees no key), both differentiable.
    `causal` is bottom-right aligned; see docs/design.md for window_size and softcap.
    `sinks` (Hq,) floating: attention sinks (gpt-oss), one logit per query head in every row's
    softmax whose column is dropped (`with_sinks`); the LSE then includes it.
    """
    check_flag("return_lse", return_lse)
    if sinks is not None:
        check_sinks(sinks, q)
        out, lse = attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
            softcap=softcap, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
            return_lse=True, version=version,
        )  # fmt: skip
        return with_sinks(out, lse, sinks, return_lse)
    descales = (descale_q, descale_k, descale_v)
    if _compiling():
        name, p, op_args = _trace_select(q, k, v, causal, softmax_scale, window_size, softcap,
                                         descales, return_lse, version)  # fmt: skip
        out, lse = _trace_run(name, q, k, v, op_args, descales)
        return (out, lse) if return_lse else out
    if descale_q is None and descale_k is None and descale_v is None:
        plan = _lookup(q, k, v, causal, softmax_scale, window_size, softcap, version, return_lse)
        if plan is not None:
            out, lse = _run(plan, q, k, v)
            return (out, lse) if return_lse else out
    p = check_inputs(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        softcap=softcap,
        descale_q=descale_q,
        descale_k=descale_k,
        descale_v=descale_v,
    )
    name = _select(p, version, _needs_grad(q, k, v), bool(return_lse)).version
    if name == fallback.NAME:
        out = fallback.forward(q, k, v, p.causal, p.scale)
        return out  # the route is never chosen with return_lse=True
    out, lse = registry.op(name).fwd(q, k, v, *p.to_op_args(), *descales)
    return (out, lse) if return_lse else out


def check_sinks(sinks, q: torch.Tensor, name: str = "sinks") -> None:
    """sinks: a floating tensor (Hq,) on q's device, Hq = q.shape[-2] (q (B, Nq, Hq, D) or
    packed (total_q, Hq, D)); else a ValueError naming `name`."""
    hq = q.shape[-2]
    if not (
        isinstance(sinks, torch.Tensor)
        and sinks.is_floating_point()
        and tuple(sinks.shape) == (hq,)
        and sinks.device == q.device
    ):
        got = (
            f"{str(sinks.dtype).removeprefix('torch.')} of shape {tuple(sinks.shape)} on "
            f"{sinks.device}"
            if isinstance(sinks, torch.Tensor)
            else type(sinks).__name__
        )
        raise ValueError(
            f"{name}: expected a floating tensor of shape ({hq},) (one logit per query head) "
            f"on {q.device}, got {got}"
        )


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks, return_lse: bool = False):
    """Attention with sinks from the attention over the real keys: a logit s_h per query head
    joins every row's softmax and its column is dropped, so out' = sum_j exp(score_j) v_j /
    (exp(lse) + exp(s_h)) = out * sigmoid(lse - s_h), and lse' = logaddexp(lse, s_h); a row
    without keys gives 0. out (..., Nq, Hq, Dv) with lse (..., Hq, Nq), or packed out
    (total_q, Hq, Dv) with lse (Hq, total_q): heads next to last in both. Computed in float32
    (float64 for float64 inputs), out returned in its dtype; differentiable in out, lse and
    sinks. (out', lse') with `return_lse`, else out'. `check_sinks` validates sinks."""
    dtype = torch.promote_types(out.dtype, torch.float32)
    s = sinks.to(dtype)[:, None]  # (Hq, 1)
    keep = torch.sigmoid(lse.to(dtype) - s)  # (..., Hq, Nq)
    scaled = (out.to(dtype) * keep.transpose(-1, -2)[..., None]).to(out.dtype)
    if not return_lse:
        return scaled
    return scaled, torch.logaddexp(lse, s.to(lse.dtype))


@dataclass(frozen=True)
class Plan:
    """What `attention` decided for one static signature: the version, the validated problem,
    whether the inputs need a gradient, whether the version's forward may be called directly
    (`_run`), its forward op with the op's option arguments, the version's forward, and the
    op pair's eager autograd path for inputs that need a gradient (op, forward and autograd
    are None for PyTorch's SDPA, `fallback.NAME`), and the version's
    `bind_forward(params, return_lse)` where it has one and the plan is direct (a function of
    (q, k, v) alone, whose LSE may be None where the call does not return it)."""

    version: str
    params: AttnParams
    needs_grad: bool
    direct: bool
    op: object
    op_args: tuple
    forward: object
    autograd: object = None
    bound: object = None


# The eager fast path of `attention`: key of one call (`_lookup`) -> Plan. One validation and one
# selection per static signature (shapes, dtypes, devices, options, version, grad, return_lse,
# selection state); a call that differs in any of them misses and is decided afresh. Under
# torch.compile `_trace_select` decides instead.
_plans: dict[tuple, Plan] = {}

# Environment variables that selection reads (docs/design.md): a change re-decides.
_SELECTION_ENV = (
    "FLASHSUITE_VERSION",
    "FLASHSUITE_ARCH",
    "TRITON_INTERPRET",
    *(f"FLASHSUITE_{name.upper()}_BWD" for name in registry.VERSIONS),
    *(f"FLASHSUITE_{name.upper()}_VARLEN_BWD" for name in registry.VERSIONS),
)
# Read through arch_mod.env_table (a few ns per name, not os.environ.get's microsecond).
_ENV_DATA = arch_mod.env_table
_ENV_KEYS = tuple(map(arch_mod.env_key, _SELECTION_ENV))


def _lookup(
    q, k, v, causal, softmax_scale, window_size, softcap, version, return_lse=False
) -> Plan | None:
    """The memoised plan of one call, made (validated, selected) on a miss; None when the
    arguments are not memoisable (the caller then takes the op path, which raises what is
    wrong). Selection only: nothing is launched."""
    sig = signature(q, k, v, causal, softmax_scale, window_size, softcap)
    if sig is None or type(return_lse) is not bool:
        return None
    needs_grad = _needs_grad(q, k, v)
    key = (
        sig,
        version,
        needs_grad,
        return_lse,  # PyTorch's SDPA (fallback.NAME) has no LSE to return
        arch_mod.override_state(),
        _deterministic(),  # fa3's own backward depends on it
        tuple(map(_ENV_DATA.get, _ENV_KEYS)),
    )
    plan = _plans.get(key)
    if plan is None:
        p = check_inputs(
            q,
            k,
            v,
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            softcap=softcap,
        )
        name = _select(p, version, needs_grad, return_lse).version
        if name == fallback.NAME:
            plan = Plan(name, p, needs_grad, False, None, (), None)
        else:
            pair = registry.op(name)
            # The forward itself runs only on real devices (the op's fake answers for meta).
            real = p.device.type in ("cpu", "cuda")
            direct = not needs_grad and real
            module = registry.module(name)
            autograd = pair.eager_autograd if needs_grad and real and not p.is_fp8 else None
            bind = getattr(module, "bind_forward", None) if direct else None
            plan = Plan(name, p, needs_grad, direct, pair.fwd, p.to_op_args(), module.forward,
                        autograd, bind(p, return_lse) if bind is not None else None)  # fmt: skip
        remember(_plans, key, plan)
    return plan


def _plan(q, k, v, *, version: str = "auto", **options) -> Plan | None:
    """The plan `attention(q, k, v, version=version, **options)` runs in eager mode (None
    where it takes the op path without one: float8 descales, arguments of types that are not
    memoised)."""
    opts = _api_options(options)
    if any(opts[name] is not None for name in ("descale_q", "descale_k", "descale_v")):
        return None
    causal, scale, window, softcap = (
        opts[name] for name in ("causal", "softmax_scale", "window_size", "softcap")
    )
    return_lse = options.get("return_lse", False)
    return _lookup(q, k, v, causal, scale, window, softcap, version, return_lse)


def _run(plan: Plan, q, k, v) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a plan's forward. Through the custom op where it adds something (a tensor subclass
    or a dispatch/function mode that must see the op, the profiler); else the version's
    forward directly, as the op's implementation would (the dispatcher's Python layers are
    most of a tiny call's host time), and with a gradient the op pair's eager autograd path
    (the same forward, saved tensors and backward, without the op's layers). PyTorch's SDPA
    returns no LSE (None)."""
    if (
        not (plan.direct or plan.autograd is not None)
        or type(q) is not torch.Tensor
        or type(k) is not torch.Tensor
        or type(v) is not torch.Tensor
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch.autograd._profiler_enabled()
    ):
        if plan.op is None:
            return fallback.forward(q, k, v, plan.params.causal, plan.params.scale), None
        return plan.op(q, k, v, *plan.op_args, None, None, None)
    if plan.autograd is not None:
        return plan.autograd(q, k, v, plan.params)
    if plan.bound is not None:
        return plan.bound(q, k, v)  # out (and lse, or None) contiguous, new tensors
    out, lse = plan.forward(q, k, v, plan.params, None, None, None)
    return out.contiguous(), lse.contiguous()


_compiling = torch.compiler.is_compiling

# Under torch.compile and torch.export, selection is decided from static facts only: the
# architecture, dtype, device, head dims and the options. Batch, sequence lengths and head
# counts stay symbolic (a new length never recompiles); the options and head dims become
# constants of the trace, guarded on their values. Any version's support of a problem
# depends on those facts alone, apart from launch limits far beyond what fits in memory
# (fa3: batch and heads <= 65535, lengths < 2^30), which a traced call does not check.
_TRACE_SEQLEN = 4096  # the length selection plans for (none of the answers depends on it)


def _constant(x: object) -> object:
    """A scalar option as a constant of the trace (a guard on its value), else unchanged."""
    return guard_scalar(x) if isinstance(x, (bool, int, float)) else x


def _trace_select(
    q, k, v, causal, softmax_scale, window_size, softcap, descales, return_lse, version
) -> tuple[str, AttnParams, tuple]:
    """Validate and select while torch.compile or torch.export traces `attention`: the
    version's name, the params (sizes symbolic) and the op's option arguments (constants)."""
    causal, softmax_scale, softcap = (_constant(x) for x in (causal, softmax_scale, softcap))
    if isinstance(window_size, (tuple, list)):
        window_size = tuple(_constant(w) for w in window_size)
    # Shape relations (equal batches, Hq % Hkv == 0, ...) become guards, never constants.
    p = check_inputs(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        softcap=softcap,
        descale_q=descales[0],
        descale_k=descales[1],
        descale_v=descales[2],
    )
    static = (
        p.dtype,
        p.device,
        operator.index(p.head_dim),
        operator.index(p.head_dim_v),
        p.causal,
        p.window_left,
        p.window_right,
        p.softcap,
        softmax_scale,
    )
    name, op_args = _resolve_static(version, static, _needs_grad(q, k, v), bool(return_lse))
    if op_args is None:  # the selection's error, raised where the trace sees a user exception
        raise _TRACE_ERRORS[name[0]](name[1])
    return name, p, op_args


_TRACE_ERRORS = {"Unsupported": Unsupported, "ValueError": ValueError}


@torch.compiler.assume_constant_result
def _resolve_static(version: str, static: tuple, needs_grad: bool, return_lse: bool):
    """(version name, op option arguments) for the static facts of a traced call, or ((error
    type, message), None) where selection refuses (an explicit version that cannot take the
    inputs, an unknown one); run once at trace time, its answer a constant of the graph."""
    dtype, device, d, dv, causal, left, right, softcap, softmax_scale = static
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    n = _TRACE_SEQLEN
    p = AttnParams(1, n, n, 1, 1, d, dv, dtype, device, causal, left, right, softcap, scale)
    try:
        name = _select(p, version, needs_grad, return_lse).version
    except (Unsupported, ValueError) as exc:  # Unsupported first: it is a ValueError too
        kind = "Unsupported" if isinstance(exc, Unsupported) else "ValueError"
        return (kind, str(exc)), None
    if name != fallback.NAME:
        registry.op(name)  # define flashsuite::<name>_fwd/_bwd before the graph calls them
    return name, p.to_op_args()


def _trace_run(name: str, q, k, v, op_args: tuple, descales: tuple):
    """The traced call of the selected version's op (or of PyTorch's SDPA, without an LSE)."""
    if name == fallback.NAME:
        return fallback.forward(q, k, v, op_args[0], op_args[1]), None
    return getattr(torch.ops.flashsuite, f"{name}_fwd")(q, k, v, *op_args, *descales)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    version: str = "auto",
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `attention` from its saved tensors: the backward of the version selected
    for these inputs with a gradient (fa3's forward pairs with fa2's backward where its own
    does not run), recomputing P from q, k and lse. dout and out (B, Nq, Hq, Dv), lse
    (B, Hq, Nq) float32 from any version's forward: every version computes the same function
    and the same natural-log LSE. `dlse` (B, Hq, Nq), the gradient of a loss that also uses
    the LSE (a ring-attention merge), or None."""
    p = check_inputs(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap,
    )  # fmt: skip
    if dlse is not None:
        dlse = dlse_arg(dlse, "(B, Hq, Nq)", (p.batch, p.heads_q, p.seqlen_q), q.device)
    name = _select(p, version, needs_grad=True, return_lse=True).version
    return registry.op(name).bwd(dout, q, k, v, out, lse, *p.to_op_args(), dlse)


def dlse_arg(dlse, layout: str, want: tuple, device: torch.device) -> torch.Tensor:
    """An explicit backward's `dlse`: a tensor of shape `want` (`layout` names its dims), as
    float32 contiguous on `device`; else a ValueError naming dlse."""
    if not isinstance(dlse, torch.Tensor) or tuple(dlse.shape) != want:
        got = tuple(dlse.shape) if isinstance(dlse, torch.Tensor) else type(dlse).__name__
        raise ValueError(f"dlse: expected a tensor of shape {layout} = {want}, got {got}")
    return dlse.to(device=device, dtype=torch.float32).contiguous()


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention` (same meaning exactly).

    Layout (B, H, N, D), top-left `is_causal`; `torch.nn.attention.bias.causal_lower_right`
    and `causal_upper_left` masks are taken as bottom-right and top-left causal. A problem
    goes to a flashsuite kernel where auto selection picks one; everything else goes to
    PyTorch's own SDPA: a dense mask, dropout, non-4-D inputs, top-left causal with Nq < Nk,
    and whatever no kernel takes (on a CPU, every problem: the portable version is a reference,
    PyTorch's CPU kernels are faster).
    """
    torch_sdpa = lambda: F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    if (
        not _compiling()
        and isinstance(query, torch.Tensor)
        and query.device.type != "cuda"
        and not arch_mod.is_overridden()
        and _ENV_DATA.get(_ENV_KEYS[0]) is None
    ):
        return torch_sdpa()  # no kernel runs on this device: auto would pick the reference
    causal = is_causal
    if attn_mask is not None:
        causal = _causal_variant(attn_mask, query, key, is_causal)
        if causal is None:
            return torch_sdpa()
    if dropout_p > 0.0 or any(t.dim() != 4 for t in (query, key, value)):
        return torch_sdpa()
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not enable_gqa:
        return torch_sdpa()  # PyTorch's own error message for mismatched heads
    nq, nk = query.shape[2], key.shape[2]
    window = (-1, -1)
    if causal == "bottom-right":
        window = (-1, 0)
    elif causal:
        if nq < nk:
            return torch_sdpa()  # top-left causal hides keys beyond Nq: not a bottom-right window
        window = (-1, nq - nk)  # top-left: query i sees keys j <= i
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, N, H, D) views, no copy
    if any(t.size(-1) > 1 and t.stride(-1) != 1 for t in (q, k, v)):
        return torch_sdpa()
    if _compiling():
        name, _, op_args = _trace_select(
            q, k, v, False, scale, window, 0.0, (None, None, None), False, "auto"
        )
        if name in (fallback.NAME, "torch") and _version_forced() is None:
            return torch_sdpa()
        return _trace_run(name, q, k, v, op_args, (None, None, None))[0].transpose(1, 2)
    plan = _lookup(q, k, v, False, scale, window, 0.0, "auto")
    if plan is None or (plan.version in (fallback.NAME, "torch") and _version_forced() is None):
        return torch_sdpa()
    return _run(plan, q, k, v)[0].transpose(1, 2)  # (B, Hq, Nq, Dv)


def _version_forced() -> str | None:
    """FLASHSUITE_VERSION, when set to something other than auto."""
    value = os.environ.get("FLASHSUITE_VERSION", "auto") or "auto"
    return None if value == "auto" else value


def _causal_variant(attn_mask, query, key, is_causal: bool) -> bool | str | None:
    """A `torch.nn.attention.bias.CausalBias` as a causal mode: "bottom-right" (lower right),
    True (upper left, SDPA's is_causal); None for any other mask, a bias of other lengths, or
    one given together with is_causal (PyTorch's SDPA then answers, or raises)."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if not isinstance(attn_mask, CausalBias) or is_causal:
        return None
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (query.shape[-2], key.shape[-2]):
        return None
    return "bottom-right" if attn_mask.variant == CausalVariant.LOWER_RIGHT else True
