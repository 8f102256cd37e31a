"""Input validation shared by every version, and the resolved problem description `AttnParams`.

Every public entry point calls `check_inputs` first. Errors name the tensor or option, the
expected value and the actual one; types and dtypes raise `TypeError`, shapes and values
raise `ValueError`. Kernels then only see problems that are well formed; whether a *version*
can take them is its own `supports(params, arch)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

MAX_HEAD_DIM = 256
FP8_DTYPES = (torch.float8_e4m3fn,)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SUPPORTED_DTYPES = FLOAT_DTYPES + FP8_DTYPES


@dataclass(frozen=True)
class AttnParams:
    """One attention problem, resolved: shapes, dtype and options in canonical form.

    Canonical options: `causal=True` implies `window_right == 0`; a window of (-1, 0) is
    reported as causal. `-1` means unbounded on that side. Query i sees key j iff
    `(window_left < 0 or j >= i + shift - window_left) and
    (window_right < 0 or j <= i + shift + window_right)` with `shift = seqlen_k - seqlen_q`.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    window_left: int
    window_right: int
    softcap: float
    scale: float

    @property
    def is_local(self) -> bool:
        """A window that bounds something beyond plain causal masking."""
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal)

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.is_fp8 else self.dtype

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 for MHA, Hq for MQA)."""
        return self.heads_q // self.heads_kv

    @property
    def shift(self) -> int:
        """Bottom-right alignment: query i lines up with key i + shift."""
        return self.seqlen_k - self.seqlen_q

    # The options of one call as the custom ops take them (common/ops.py), in their order. The
    # one definition: the dispatcher calls the ops with `to_op_args()`, the ops rebuild the
    # params with `from_op_args` (which validates, the ops being callable directly).
    OP_ARGS: ClassVar[tuple[str, ...]] = (
        "causal",
        "scale",
        "window_left",
        "window_right",
        "softcap",
    )

    def to_op_args(self) -> tuple[bool, float, int, int, float]:
        """(causal, scale, window_left, window_right, softcap): the ops' option arguments."""
        return tuple(getattr(self, name) for name in self.OP_ARGS)

    @classmethod
    def from_op_args(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        window_left: int,
        window_right: int,
        softcap: float,
    ) -> AttnParams:
        """The params of q, k, v and the ops' option arguments, validated (`check_inputs`)."""
        return check_inputs(
            q,
            k,
            v,
            causal=causal,
            softmax_scale=scale,
            window_size=(window_left, window_right),
            softcap=softcap,
        )

    def to_key(self) -> tuple:
        """Every field as a plain Python scalar (dtype and device as strings): hashable and a
        constant for torch.compile. `from_key` inverts it."""
        return (
            int(self.batch),
            int(self.seqlen_q),
            int(self.seqlen_k),
            int(self.heads_q),
            int(self.heads_kv),
            int(self.head_dim),
            int(self.head_dim_v),
            _dt(self.dtype),
            str(self.device),
            self.causal,
            self.window_left,
            self.window_right,
            self.softcap,
            self.scale,
        )

    @classmethod
    def from_key(cls, key: tuple) -> AttnParams:
        b, nq, nk, hq, hkv, d, dv, dtype, device, causal, wl, wr, softcap, scale = key
        dt, dev = getattr(torch, dtype), torch.device(device)
        return cls(b, nq, nk, hq, hkv, d, dv, dt, dev, causal, wl, wr, softcap, scale)

    def describe(self) -> str:
        opts = []
        if self.causal:
            opts.append("causal")
        if self.is_local:
            opts.append(f"window=({self.window_left},{self.window_right})")
        if self.softcap:
            opts.append(f"softcap={self.softcap:g}")
        dt = str(self.dtype).removeprefix("torch.")
        hv = "" if self.head_dim_v == self.head_dim else f", Dv={self.head_dim_v}"
        gqa = "" if self.heads_kv == self.heads_q else f"/Hkv={self.heads_kv}"
        return (
            f"B={self.batch} Nq={self.seqlen_q} Nk={self.seqlen_k} Hq={self.heads_q}{gqa} "
            f"D={self.head_dim}{hv} {dt}" + (" " + " ".join(opts) if opts else "")
        )


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(
            f"{name}: expected a 4-D tensor (batch, seqlen, heads, head_dim), "
            f"got {t.dim()}-D with shape {tuple(t.shape)}"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(_dt(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {_dt(t.dtype)}")
    if t.size(-1) > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dim (head_dim) must be contiguous: expected stride(-1) == 1, "
            f"got {t.stride(-1)} (strides {tuple(t.stride())})"
        )
    return t


def check_window(window_size: object) -> tuple[int, int]:
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    for side, w in (("left", left), ("right", right)):
        if w < -1:
            raise ValueError(f"window_size: {side} must be >= -1 (-1 = unbounded), got {w}")
    return left, right


def check_inputs(
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
) -> AttnParams:
    """Validate q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv) and the options."""
    q = _check_tensor("q", q)
    k = _check_tensor("k", k)
    v = _check_tensor("v", v)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's device), got {t.device}")
        if t.dtype != q.dtype:
            raise TypeError(
                f"{name}: expected dtype {_dt(q.dtype)} (q's dtype), got {_dt(t.dtype)}"
            )
    b, nq, hq, d = q.shape
    bk, nk, hkv, dk = k.shape
    bv, nv, hv, dv = v.shape
    if bk != b or bv != b:
        bad, got = ("k", bk) if bk != b else ("v", bv)
        raise ValueError(f"{bad}: expected batch {b} (q.shape[0]), got {got}")
    if nv != nk:
        raise ValueError(f"v: expected seqlen {nk} (k.shape[1]), got {nv}")
    if hv != hkv:
        raise ValueError(f"v: expected {hkv} heads (k.shape[2]), got {hv}")
    if dk != d:
        raise ValueError(f"k: expected head_dim {d} (q.shape[3]), got {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"k: the number of query heads ({hq}) must be a multiple of the number of "
            f"key/value heads, got {hkv} (GQA/MQA needs Hq % Hkv == 0)"
        )
    for name, dim in (("q", d), ("v", dv)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected head_dim in [1, {MAX_HEAD_DIM}], got {dim}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    left, right = check_window(window_size)
    if causal:
        right = 0
    elif left < 0 and right == 0:
        causal = True
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale: expected a float or None, got {softmax_scale!r}")
        scale = float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale: expected a finite number, got {softmax_scale}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected a float, got {softcap!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: expected a finite number >= 0 (0 = off), got {softcap}")
    is_fp8 = q.dtype in FP8_DTYPES
    for name, ds in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v)):
        if ds is None:
            continue
        if not is_fp8:
            raise ValueError(
                f"{name}: descale factors are only for float8 inputs, q is {_dt(q.dtype)}"
            )
        if not isinstance(ds, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(ds).__name__}")
        if ds.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype float32, got {_dt(ds.dtype)}")
        if tuple(ds.shape) != (b, hkv):
            raise ValueError(f"{name}: expected shape (B, Hkv) = {(b, hkv)}, got {tuple(ds.shape)}")
        if ds.device != q.device:
            raise ValueError(f"{name}: expected device {q.device}, got {ds.device}")
    return AttnParams(
        batch=b,
        seqlen_q=nq,
        seqlen_k=nk,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        head_dim_v=dv,
        dtype=q.dtype,
        device=q.device,
        causal=causal,
        window_left=left,
        window_right=right,
        softcap=float(softcap),
        scale=scale,
    )
