"""Input validation shared by every version, and the resolved problem description `AttnParams`.

Every public entry point calls `check_inputs` first. Errors name the tensor or option, the
expected value and the actual one; types and dtypes raise `TypeError`, shapes and values
raise `ValueError`. Kernels then only see problems that are well formed; whether a *version*
can take them is its own `supports(params, arch)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
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
    # fp8 per-block descales: rows of q / keys of k and v per descale (0: one per (batch, kv
    # head), the (B, Hkv) descales; `check_inputs` reads them off block views).
    fp8_block_q: int = 0
    fp8_block_kv: int = 0
    # A float8 v laid out keys-major (stride(1) == 1 where the head dim is not contiguous:
    # common.fp8.keys_major): fa3's forward reads it as Vᵀ, so it takes the host-Vᵀ build.
    v_keys_major: bool = False

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
        """The params of q, k, v and the ops' option arguments, validated (`check_inputs`).

        A signature that validated once (`signature`: shapes, dtypes, devices, strides,
        options with their types) is answered from a memo without re-checking: validation is a
        pure function of that metadata. Inputs that fail are never memoised, so they raise on
        every call."""
        key = signature(q, k, v, causal, scale, (window_left, window_right), softcap)
        p = _validated.get(key) if key is not None else None
        if p is None:
            p = check_inputs(
                q,
                k,
                v,
                causal=causal,
                softmax_scale=scale,
                window_size=(window_left, window_right),
                softcap=softcap,
            )
            if key is not None:
                remember(_validated, key, p)
        return p

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


# What validation reads of one call, to memoise its verdict: `signature` builds the key.
_validated: dict[tuple, AttnParams] = {}
MEMO_LIMIT = 4096  # many distinct shapes (e.g. a growing decode length): start over


def remember(memo: dict, key: tuple, value: object) -> None:
    """Store `value` under `key`, clearing `memo` first when it holds MEMO_LIMIT entries."""
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = value


def signature(q, k, v, causal, scale, window_size, softcap) -> tuple | None:
    """Everything `check_inputs` looks at, as a hashable key: per tensor its shape, dtype,
    device and strides; the options, of exact types (True == 1 and hashes alike, but
    `causal=1` and `softcap=True` are errors: a bool is memoised only as `causal`, an int or
    float, which validate alike for equal values, only as scale and softcap). None when an
    argument is not of a memoisable type (not a tensor, a window that is not a tuple of two
    ints, ...): the caller then validates the slow way, which also produces the error."""
    if (
        type(causal) is not bool
        or type(window_size) is not tuple
        or len(window_size) != 2
        or type(window_size[0]) is not int
        or type(window_size[1]) is not int
        or (scale is not None and type(scale) not in (float, int))
        or type(softcap) not in (float, int)
    ):
        return None
    try:
        # Whole stride tuples: `t.stride()` costs half of `t.stride(-1)` (about 150 against
        # 300 ns), and a layout that differs anywhere is a key of its own.
        return (
            q.shape, q.dtype, q.device, q.stride(),
            k.shape, k.dtype, k.device, k.stride(),
            v.shape, v.dtype, v.device, v.stride(),
            causal, scale, window_size, softcap,
        )  # fmt: skip
    except (AttributeError, TypeError, IndexError, RuntimeError):
        return None  # not a tensor, or 0-D: check_inputs says what is wrong


def _check_tensor(name: str, t: object, keys_ok: bool = False) -> torch.Tensor:
    """`t` as a (B, N, H, D) operand: a 4-D tensor of a supported dtype whose last dim is
    contiguous, or with `keys_ok` (v) a float8 one whose key dim is (stride(1) == 1: V laid out
    keys-major, common.fp8.keys_major, which fa3's fp8 forward reads without a copy)."""
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
        fp8 = t.dtype in FP8_DTYPES
        if keys_ok and fp8 and (t.size(1) <= 1 or t.stride(1) == 1):
            return t
        also = " or, float8 only, the key dim stride(1) == 1" if keys_ok and fp8 else ""
        raise ValueError(
            f"{name}: the last dim (head_dim) must be contiguous: expected stride(-1) == 1{also}, "
            f"got {t.stride(-1)} (strides {tuple(t.stride())})"
        )
    return t


def check_flag(name: str, value: object) -> bool:
    """`value`, or a TypeError naming `name` unless it is a bool (a truthy string or tensor
    would otherwise pass for True)."""
    if type(value) is not bool:
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


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
    v = _check_tensor("v", v, keys_ok=True)
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
    blocks = {"descale_q": 0, "descale_k": 0, "descale_v": 0}  # rows per descale; 0: per head
    for name, ds in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v)):
        if ds is None:
            continue
        if not is_fp8:
            raise ValueError(
                f"{name}: descale factors are only for float8 inputs, q is {_dt(q.dtype)}"
            )
        _check_descale_tensor(name, ds, q.device)
        blocks[name] = _check_descale_shape(name, ds, b, hq if name == "descale_q" else hkv,
                                            hkv, nq if name == "descale_q" else nk)  # fmt: skip
    if 0 not in (blocks["descale_k"], blocks["descale_v"]) and (
        blocks["descale_k"] != blocks["descale_v"]
    ):
        raise ValueError(
            f"descale_v: expected blocks of {blocks['descale_k']} keys (descale_k's), "
            f"got {blocks['descale_v']}"
        )
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
        fp8_block_q=blocks["descale_q"],
        fp8_block_kv=max(blocks["descale_k"], blocks["descale_v"]),
        v_keys_major=is_fp8 and v.size(-1) > 1 and v.stride(-1) != 1,
    )


def _check_descale_tensor(name: str, ds: object, device: torch.device) -> None:
    """A descale argument: a float32 tensor on `device` (its shape is the caller's)."""
    if not isinstance(ds, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(ds).__name__}")
    if ds.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype float32, got {_dt(ds.dtype)}")
    if ds.device != device:
        raise ValueError(f"{name}: expected device {device} (q's device), got {ds.device}")


def _check_descale_shape(name: str, ds: torch.Tensor, b: int, heads: int, hkv: int, n: int) -> int:
    """The rows per descale of an fp8 descale: 0 for (B, Hkv) (one per batch and kv head),
    `block` for a (B, H, ceil(N / block), block) block view (common.fp8.block_view: the last
    dim of stride 0). q's H may be Hq (per query head) or Hkv (its group shares one)."""
    if ds.dim() == 2:
        if tuple(ds.shape) != (b, hkv):
            raise ValueError(
                f"{name}: expected shape (B, Hkv) = {(b, hkv)} or a block view "
                f"(B, H, nblocks, block), got {tuple(ds.shape)}"
            )
        return 0
    if ds.dim() != 4:
        raise ValueError(
            f"{name}: expected shape (B, Hkv) or a block view (B, H, nblocks, block), "
            f"got {ds.dim()}-d {tuple(ds.shape)}"
        )
    block = ds.shape[3]
    heads_ok = (heads, hkv) if heads != hkv else (hkv,)
    nblocks = math.ceil(n / block) if block else 0
    if block < 1 or ds.shape[0] != b or ds.shape[1] not in heads_ok or ds.shape[2] != nblocks:
        h = " or ".join(str(x) for x in heads_ok)
        raise ValueError(
            f"{name}: expected a block view (B, H, ceil(N / block), block) with B = {b}, "
            f"H = {h}, N = {n}, got {tuple(ds.shape)}"
        )
    if block > 1 and ds.stride(3) != 0:
        raise ValueError(
            f"{name}: expected a block view with stride 0 in its last dim (one descale per "
            f"block: common.fp8.block_view), got strides {ds.stride()}"
        )
    return block


# ------------------------------------------------------------------------------------------
# Inference entry points: packed sequences (varlen) and KV-cache attention
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarlenParams:
    """Packed sequences: `attn` holds batch = B (len(cu_seqlens) - 1), seqlen_q/seqlen_k =
    max_seqlen_q/max_seqlen_k (upper bounds of the per-sequence lengths), heads, dims, dtype
    and options; each sequence is aligned bottom-right on its own lengths."""

    attn: AttnParams
    total_q: int
    total_k: int

    def describe(self) -> str:
        return f"varlen {self.attn.describe()} total_q={self.total_q} total_k={self.total_k}"


@dataclass(frozen=True)
class KVCacheParams:
    """Attention of q against a KV cache: `attn` holds batch = B, seqlen_q = Nq, seqlen_k = the
    cache capacity of one row (N_max, or max_pages * page_size when paged). Row b attends the
    first cache_seqlens[b] + seqlen_new keys, aligned bottom-right on that length.
    `page_size` is 0 for a contiguous cache; `num_splits` 0 means "pick by heuristic"."""

    attn: AttnParams
    seqlen_new: int
    page_size: int
    num_pages: int
    num_splits: int
    # cache_leftpad given: row b's keys start at cache_leftpad[b] (a contiguous cache only), so
    # it attends cache slots [cache_leftpad[b], cache_seqlens[b] + seqlen_new).
    leftpad: bool = False
    # A float8_e4m3fn cache under 16-bit queries: token t of row b, head h is
    # k_cache[...] * descale_k[b, h] (the same for v), descales float32 (B, Hkv) or 1.
    fp8_cache: bool = False

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    def describe(self) -> str:
        cache = f"paged(page={self.page_size}, pages={self.num_pages})" if self.paged else "dense"
        new = f" +{self.seqlen_new} new" if self.seqlen_new else ""
        pad = " leftpad" if self.leftpad else ""
        fp8 = " e4m3-cache" if self.fp8_cache else ""
        return f"kvcache {cache}{fp8}{pad}{new} {self.attn.describe()}"


PAGE_SIZES = (16, 256)  # inclusive range of supported page sizes (multiples of 16)


def _check_3d(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(
            f"{name}: expected a 3-D tensor (total_tokens, heads, head_dim), "
            f"got {t.dim()}-D with shape {tuple(t.shape)}"
        )
    return t


def _check_int(name: str, value: object, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if value < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {value}")
    return value


def check_index_tensor(
    name: str, t: object, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """An int32 tensor of exactly `shape` on `device` (shape -1: any size on that dim)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype int32, got {_dt(t.dtype)}")
    if t.dim() != len(shape) or any(s >= 0 and s != a for s, a in zip(shape, t.shape, strict=True)):
        want = tuple("any" if s < 0 else s for s in shape)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (q's device), got {t.device}")
    return t


def check_varlen_inputs(
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
) -> VarlenParams:
    """Validate packed q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) and the
    shapes, dtypes and devices of cu_seqlens; their values are
    `common.metadata.check_varlen_metadata`'s."""
    q, k, v = _check_3d("q", q), _check_3d("k", k), _check_3d("v", v)
    total_q, total_k = q.shape[0], k.shape[0]
    if v.shape[0] != total_k:
        raise ValueError(f"v: expected {total_k} tokens (k.shape[0]), got {v.shape[0]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v: expected {k.shape[1]} heads (k.shape[1]), got {v.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k: expected head_dim {q.shape[2]} (q.shape[2]), got {k.shape[2]}")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
        check_index_tensor("cu_seqlens_q", cu_seqlens_q, (-1,), q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 1:
        raise ValueError(
            f"cu_seqlens_q: expected shape (B + 1,) with B >= 1, got {tuple(cu_seqlens_q.shape)}"
        )
    check_index_tensor("cu_seqlens_q", cu_seqlens_q, (batch + 1,), q.device)
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, (batch + 1,), q.device)
    max_q = _check_int("max_seqlen_q", max_seqlen_q)
    max_k = _check_int("max_seqlen_k", max_seqlen_k)
    # Dense checks (dtype, device, head counts, head_dim range, options) on 4-D views.
    p = check_inputs(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        softcap=softcap,
    )
    if p.is_fp8:
        raise TypeError("q: float8 inputs are not supported by attention_varlen")
    attn = replace(p, batch=batch, seqlen_q=max_q, seqlen_k=max_k)
    return VarlenParams(attn=attn, total_q=total_q, total_k=total_k)


def check_kvcache_inputs(
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
    cache_leftpad: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
) -> KVCacheParams:
    """Validate q (B, Nq, Hq, D), a cache (B_cache, N_max, Hkv, D) or, with block_table
    (B, max_pages) int32, pages (num_pages, page_size, Hkv, D), the optional new k, v
    (B, Nnew, Hkv, D), the optional cache_leftpad (B,) int32 (a contiguous cache only) and the
    shapes of the metadata; their values are `common.metadata.check_kvcache_metadata`'s. An int
    cache_seqlens is checked here. A float8_e4m3fn cache (k_cache and v_cache) takes fp16 / bf16
    queries, optional float32 (B, Hkv) descale_k, descale_v, and new k, v in e4m3 or in q's
    dtype (quantised by the append)."""
    q = _check_tensor("q", q)
    k_cache = _check_tensor("k_cache", k_cache)
    v_cache = _check_tensor("v_cache", v_cache)
    b = q.shape[0]
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(
            f"v_cache: expected shape {tuple(k_cache.shape[:3])} + (Dv,) (k_cache's first three "
            f"dims), got {tuple(v_cache.shape)}"
        )
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(
            f"k_cache: expected head_dim {q.shape[3]} (q.shape[3]), got {k_cache.shape[3]}"
        )
    page_size = num_pages = 0
    if block_table is not None:
        block_table = check_index_tensor("block_table", block_table, (b, -1), q.device)
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if page_size % 16 or not PAGE_SIZES[0] <= page_size <= PAGE_SIZES[1]:
            raise ValueError(
                f"k_cache: expected a page size (k_cache.shape[1]) that is a multiple of 16 in "
                f"[{PAGE_SIZES[0]}, {PAGE_SIZES[1]}] with block_table, got {page_size}"
            )
        if num_pages < 1 or block_table.shape[1] < 1:
            raise ValueError(
                f"block_table: expected at least one page (num_pages = {num_pages}, "
                f"max_pages = {block_table.shape[1]})"
            )
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] < b:
            raise ValueError(
                f"k_cache: expected a batch of at least {b} (q.shape[0]), got {k_cache.shape[0]}"
            )
        capacity = k_cache.shape[1]
    fp8_cache = _check_fp8_cache(q, k_cache, v_cache, descale_k, descale_v)
    n_new = 0
    if (k is None) != (v is None):
        missing = "v" if v is None else "k"
        raise ValueError(f"{missing}: expected a tensor (k and v are given together), got None")
    if k is not None:
        k, v = _check_tensor("k", k), _check_tensor("v", v)
        n_new = k.shape[1]
        for name, t, c in (("k", k, k_cache), ("v", v, v_cache)):
            want = (b, n_new, c.shape[2], c.shape[3])
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{name}: expected shape (B, Nnew, Hkv, D) = {want}, got {tuple(t.shape)}"
                )
            quantised = fp8_cache and t.dtype == q.dtype  # rounded to e4m3 by the append
            if (t.dtype != c.dtype and not quantised) or t.device != c.device:
                also = f" or {_dt(q.dtype)} (q's, quantised on the append)" if fp8_cache else ""
                raise TypeError(
                    f"{name}: expected dtype {_dt(c.dtype)} on {c.device} ({name}_cache's){also}, "
                    f"got {_dt(t.dtype)} on {t.device}"
                )
        if n_new > capacity:
            raise ValueError(
                f"k: expected at most {capacity} new tokens (the cache capacity), got {n_new}"
            )
    if cache_seqlens is None:
        raise TypeError("cache_seqlens: expected an int32 tensor of shape (B,) or an int, got None")
    if isinstance(cache_seqlens, torch.Tensor):
        check_index_tensor("cache_seqlens", cache_seqlens, (b,), q.device)
    else:
        n = _check_int("cache_seqlens", cache_seqlens)
        if n + n_new > capacity:
            raise ValueError(
                f"cache_seqlens: expected cache_seqlens + Nnew <= {capacity} (the cache "
                f"capacity), got {n} + {n_new}"
            )
    splits = _check_int("num_splits", num_splits)
    if cache_leftpad is not None:
        check_index_tensor("cache_leftpad", cache_leftpad, (b,), q.device)
        if block_table is not None:
            raise ValueError(
                "cache_leftpad: expected None with a paged cache (block_table), got a tensor: "
                "each row's keys start at its first page"
            )
    kc, vc = k_cache[:1], v_cache[:1]
    if fp8_cache:  # the dense checks on stand-ins in q's dtype (shapes, devices, heads)
        kc, vc = (q.new_empty(1, c.shape[1], c.shape[2], c.shape[3]) for c in (k_cache, v_cache))
    # Dense checks (dtypes, devices, heads, head_dim range, options) on views with B rows.
    p = check_inputs(
        q,
        kc.expand(b, -1, -1, -1),
        vc.expand(b, -1, -1, -1),
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        softcap=softcap,
    )
    if p.is_fp8:
        raise TypeError(
            "q: float8 queries are not supported by attention_with_kvcache (a float8_e4m3fn "
            "cache takes float16 or bfloat16 queries)"
        )
    attn = replace(p, seqlen_k=capacity)
    leftpad = cache_leftpad is not None
    return KVCacheParams(attn, n_new, page_size, num_pages, splits, leftpad, fp8_cache)


def _check_fp8_cache(q, k_cache, v_cache, descale_k, descale_v) -> bool:
    """Whether the cache is float8_e4m3fn (then both caches are, q is 16-bit and each descale
    is None or float32 (B, Hkv) on q's device); descales without such a cache are an error."""
    fp8 = k_cache.dtype in FP8_DTYPES or v_cache.dtype in FP8_DTYPES
    if fp8:
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dtype != torch.float8_e4m3fn:
                raise TypeError(
                    f"{name}: expected float8_e4m3fn (a float8 cache stores both K and V so), "
                    f"got {_dt(c.dtype)}"
                )
            if c.device != q.device:  # (the dense checks below run on stand-ins on q's device)
                raise ValueError(f"{name}: expected device {q.device} (q's), got {c.device}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"q: expected float16 or bfloat16 with a float8_e4m3fn cache, got {_dt(q.dtype)}"
            )
    want = (q.shape[0], k_cache.shape[2])
    for name, ds in (("descale_k", descale_k), ("descale_v", descale_v)):
        if ds is None:
            continue
        if not fp8:
            raise ValueError(
                f"{name}: descale factors are for a float8_e4m3fn cache, the cache is "
                f"{_dt(k_cache.dtype)}"
            )
        _check_descale_tensor(name, ds, q.device)
        if tuple(ds.shape) != want:
            raise ValueError(f"{name}: expected shape (B, Hkv) = {want}, got {tuple(ds.shape)}")
    return fp8
