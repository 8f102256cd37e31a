"""Float8 inputs for fp8 attention: quantisation in three scaling modes and its inverse.

An fp8 operand is a float8 tensor (B, N, H, D) plus float32 descale factors: the real value of
an element is its float8 value times the descale of its block. The scaling mode says which
elements share a descale:

- "tensor": one descale for the whole tensor, stored as (B, H // group) with every entry
  equal: the layout fa3's fp8 forward takes, so a per-tensor scale needs no other kernel.
- "head": one per (batch, head group), (B, H // group). This is what fa3's fp8 forward takes
  today (docs/design.md): k and v per kv head (group 1), q per kv head too, the `group`
  = Hq // Hkv query heads of one kv head sharing it.
- "block": one per (batch, head group, block of `block` rows along N), (B, H // group,
  ceil(N / block)); row n uses block n // block. For a kernel: q in blocks of its tile_m
  query rows, k and v in blocks of its tile_n keys, so each S tile and each P·V step meets
  one scalar per operand (S_tile = q8·k8ᵀ · ds_q[m_block] · ds_k[n_block]; V's descale folds
  into the accumulator's rescale between key blocks).

`quantize` picks descale = amax / fp8_max over each block (1 for an all-zero block), so every
block uses the format's full range and nothing saturates; `Fp8Tensor.dequantize` is the
inverse up to rounding. e4m3 (3 mantissa bits, max 448) is for forward operands, e5m2 (2 bits,
max 57344, a wider exponent range) for gradients. `quantize_e4m3` / `dequantize_e4m3` are the
"head" mode with the (tensor, descale) pair the dispatch API takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_MAX = {E4M3: E4M3_MAX, E5M2: 57344.0}  # the largest finite value of each format
# Mantissa bits of each format: round to nearest has relative error <= 2^-(bits + 1) on
# normal numbers.
FP8_MANTISSA_BITS = {E4M3: 3, E5M2: 2}
# Smallest subnormal of each format: below the normal range rounding has absolute error <= half
# of it (2^-10 for e4m3, 2^-17 for e5m2), in the scaled domain.
FP8_MIN_SUBNORMAL = {E4M3: 2.0**-9, E5M2: 2.0**-16}
SCALING_MODES = ("tensor", "head", "block")


def _check_finite(name: str, x: torch.Tensor) -> None:
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise ValueError(f"{name}: expected finite values, got {bad} NaN or infinite entries")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def descale_shape(mode: str, shape: tuple[int, ...], group: int, block: int) -> tuple[int, ...]:
    """The descale layout of a (B, N, H, D) operand: (B, H // group), or (B, H // group,
    ceil(N / block)) in "block" mode."""
    b, n, h, _ = shape
    if mode == "block":
        return (b, h // group, math.ceil(n / block))
    return (b, h // group)


@dataclass(frozen=True)
class Fp8Tensor:
    """An fp8 operand in the layout an fp8 attention kernel takes.

    data (B, N, H, D) float8_e4m3fn or float8_e5m2; descale float32 in the layout of `mode`
    (module docstring): element (b, n, h, :) is data * descale[b, h // group] ("tensor",
    "head") or data * descale[b, h // group, n // block] ("block"). `block` is 0 outside
    "block" mode. Construction checks that the pieces fit together.
    """

    data: torch.Tensor
    descale: torch.Tensor
    mode: str = "head"
    group: int = 1
    block: int = 0

    def __post_init__(self) -> None:
        _check_mode(self.mode, self.block)
        if self.data.dtype not in FP8_MAX or self.data.dim() != 4:
            raise ValueError(
                "data: expected a 4-d float8_e4m3fn or float8_e5m2 tensor (B, N, H, D), "
                f"got {self.data.dim()}-d {_dtype_name(self.data.dtype)}"
            )
        _check_group(self.group, self.data.shape[2])
        want = descale_shape(self.mode, tuple(self.data.shape), self.group, self.block)
        _check_descale(self.descale, want, self.mode, self.data.device)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    def descale_per_row(self) -> torch.Tensor:
        """float32 (B, N, H, 1) (N is 1 outside "block" mode): each row's descale."""
        return _per_row(self.descale, self.mode, self.group, self.block, self.data.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 (B, N, H, D): data times its descale."""
        return self.data.float() * self.descale_per_row()

    @property
    def kernel_descale(self) -> torch.Tensor:
        """The descale as `dispatch.attention` takes it (descale_q / _k / _v): (B, H // group)
        in "tensor" and "head" mode, the (B, H // group, nblocks, block) `block_view` in
        "block" mode."""
        if self.mode == "block":
            return block_view(self.descale, self.block)
        return self.descale


def block_view(descale: torch.Tensor, block: int) -> torch.Tensor:
    """Block descales (B, H, nblocks) -> the (B, H, nblocks, block) view the attention API
    takes for per-block scaling: element [b, h, i, j] is the descale of row i·block + j, the
    last dim of stride 0 (no copy), so its extent carries the block size."""
    if not isinstance(descale, torch.Tensor) or descale.dim() != 3:
        got = f"{descale.dim()}-d" if isinstance(descale, torch.Tensor) else type(descale)
        raise ValueError(f"descale: expected a 3-d tensor (B, H, nblocks), got {got}")
    _check_mode("block", block)
    return descale.unsqueeze(-1).expand(*descale.shape, block)


def dequantised(x8: torch.Tensor, descale: torch.Tensor | None, group: int = 1) -> torch.Tensor:
    """float32 (B, N, H, D) of an fp8 operand and its attention-API descale: (B, H // group) or
    a (B, H', nblocks, block) `block_view`, None for 1. `group` is q's query heads per kv
    head: a descale with fewer heads than x8 is shared by each group."""
    if descale is None:
        return x8.to(torch.float32)
    rows = descale_rows(descale, x8.shape[1])  # (B, H', N or 1)
    if rows.shape[1] != x8.shape[2]:
        rows = rows.repeat_interleave(group, dim=1)  # (B, H, N or 1)
    return x8.to(torch.float32) * rows.transpose(1, 2)[..., None]


def descale_rows(descale: torch.Tensor, n: int) -> torch.Tensor:
    """An attention API descale, (B, H) or a (B, H, nblocks, block) `block_view`, as float32
    (B, H, N or 1): each of the n rows' descale (1 row outside block mode, for all)."""
    if descale.dim() == 2:
        return descale[:, :, None]  # (B, H, 1)
    b, h, nb, block = descale.shape
    return descale[:, :, :, :1].expand(b, h, nb, block).reshape(b, h, nb * block)[:, :, :n]


def _check_mode(mode: str, block: int) -> None:
    if mode not in SCALING_MODES:
        raise ValueError(f"mode: expected one of {SCALING_MODES}, got {mode!r}")
    if mode == "block":
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"block: expected a positive int in 'block' mode, got {block!r}")
    elif block:
        raise ValueError(f"block: expected 0 (unset) in {mode!r} mode, got {block!r}")


def _check_group(group: int, heads: int) -> None:
    if not isinstance(group, int) or group < 1 or heads % group:
        raise ValueError(f"group: expected a divisor of the {heads} heads, got {group!r}")


def _check_descale(
    descale: torch.Tensor, want: tuple[int, ...], mode: str, device: torch.device
) -> None:
    layout = "(B, H, nblocks)" if mode == "block" else "(B, H)"
    if not isinstance(descale, torch.Tensor):
        raise TypeError(f"descale: expected a float32 tensor {layout}, got {type(descale)}")
    if tuple(descale.shape) != want or descale.dtype != torch.float32:
        raise ValueError(
            f"descale: expected float32 of shape {layout} = {want} for {mode!r} mode "
            "(H: heads // group), "
            f"got {_dtype_name(descale.dtype)} {tuple(descale.shape)}"
        )
    if descale.device != device:
        raise ValueError(f"descale: expected device {device}, got {descale.device}")
    _check_finite("descale", descale)
    if not bool((descale > 0).all()):
        raise ValueError("descale: expected positive values")


def _per_row(descale: torch.Tensor, mode: str, group: int, block: int, n: int) -> torch.Tensor:
    """Descales in `mode`'s layout -> float32 (B, N, H, 1) (N is 1 outside "block" mode)."""
    ds = descale.repeat_interleave(group, dim=1) if group > 1 else descale  # (B, H[, nblocks])
    if mode != "block":
        return ds[:, None, :, None]  # (B, 1, H, 1)
    rows = ds.repeat_interleave(block, dim=2)[:, :, :n]  # (B, H, N)
    return rows.transpose(1, 2)[..., None]  # (B, N, H, 1)


def _amax(xf: torch.Tensor, mode: str, group: int, block: int) -> torch.Tensor:
    """Block amax of float32 xf (B, N, H, D) in the descale layout of `mode`."""
    b, n, h, d = xf.shape
    hg = h // group
    grouped = xf.abs().reshape(b, n, hg, group * d)  # (B, N, Hg, G * D): a group's heads
    if mode == "tensor":
        return grouped.amax().expand(b, hg).contiguous()  # (B, Hg), all equal
    if mode == "head":
        return grouped.amax(dim=(1, 3))  # (B, Hg)
    nb = math.ceil(n / block)
    padded = torch.nn.functional.pad(grouped, (0, 0, 0, 0, 0, nb * block - n))  # zeros
    return padded.reshape(b, nb, block, hg, group * d).amax(dim=(2, 4)).transpose(1, 2)


def keys_major_empty(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """An uninitialised (B, N, H, D) tensor laid out keys-major (the keys contiguous): a view of
    (B, H, D, N16) storage, N16 = N rounded up to 16, so stride(1) == 1 and every other stride a
    multiple of 16 elements. For fp8 V this is the Vᵀ fa3's forward reads where it would
    otherwise copy V into that layout before each call (docs/fp8.md, "V laid out keys-major").
    """
    b, n, h, d = shape
    n16 = -(-n // 16) * 16
    return torch.empty(b, h, d, n16, dtype=dtype, device=device)[..., :n].permute(0, 3, 1, 2)


def keys_major(x: torch.Tensor) -> torch.Tensor:
    """x (B, N, H, D) -> the same values in `keys_major_empty`'s layout (one copy)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        got = f"{x.dim()}-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a 4-d tensor (B, N, H, D), got {got}")
    from .transpose import keys_major_copy

    return keys_major_copy(x, keys_major_empty(tuple(x.shape), x.dtype, x.device))


def quantize(
    x: torch.Tensor,
    mode: str = "head",
    *,
    group: int = 1,
    block: int = 0,
    dtype: torch.dtype = E4M3,
    descale: torch.Tensor | None = None,
    keys_major: bool = False,
) -> Fp8Tensor:
    """x (B, N, H, D) floating -> Fp8Tensor in scaling `mode` ("tensor", "head", "block").

    `group` > 1 makes that many consecutive heads share a descale (q under GQA: its kv head's
    group); `block` is the rows per descale in "block" mode (e.g. 128 for q, the kernel's
    tile_n for k and v). Without `descale` it is amax / fp8_max per block in float32 (1 for an
    all-zero block). Each element is divided by its descale in float32, clamped to the format's
    finite range (saturation: float8_e4m3fn has no infinity) and rounded to nearest even.
    NaN or infinite inputs raise ValueError (they have no fp8 encoding a descale could undo).
    `keys_major` returns the data in `keys_major_empty`'s layout (the rounded bytes copied
    once more, by `common.transpose.keys_major_copy`): the V that fa3's fp8 forward reads
    without its Vᵀ copy.
    """
    _check_mode(mode, block)
    if dtype not in FP8_MAX:
        raise ValueError(
            f"dtype: expected float8_e4m3fn or float8_e5m2, got {_dtype_name(dtype)}"
            if isinstance(dtype, torch.dtype)
            else f"dtype: expected float8_e4m3fn or float8_e5m2, got {dtype!r}"
        )
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 4:
        got = f"{x.dim()}-d {_dtype_name(x.dtype)}" if isinstance(x, torch.Tensor) else type(x)
        raise ValueError(f"x: expected a 4-d floating tensor (B, N, H, D), got {got}")
    if x.dtype in FP8_MAX:
        raise ValueError(f"x: expected a wide floating tensor, got {_dtype_name(x.dtype)}")
    _check_finite("x", x)
    _check_group(group, x.shape[2])
    xf = x.float()
    fmax = FP8_MAX[dtype]
    if descale is None:
        amax = _amax(xf, mode, group, block)
        descale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    else:
        want = descale_shape(mode, tuple(x.shape), group, block)
        _check_descale(descale, want, mode, x.device)
    scale = _per_row(descale, mode, group, block, x.shape[1])  # (B, N or 1, H, 1)
    scaled = (xf / scale).clamp(-fmax, fmax)  # (B, N, H, D) float32
    data = scaled.to(dtype)
    if keys_major:
        from .transpose import keys_major_copy

        data = keys_major_copy(data, keys_major_empty(tuple(x.shape), dtype, x.device))
    return Fp8Tensor(data, descale, mode, group, block)


def quantize_e4m3(
    x: torch.Tensor,
    descale: torch.Tensor | None = None,
    group: int = 1,
    keys_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, H, D) floating -> (x8 (B, N, H, D) float8_e4m3fn, descale (B, H // group)):
    `quantize` in "head" mode, as the pair dispatch.attention takes (descale_q/k/v);
    `keys_major` for v (see `quantize`)."""
    t = quantize(x, "head", group=group, descale=descale, keys_major=keys_major)
    return t.data, t.descale


def to_e4m3(x: torch.Tensor, descale: torch.Tensor | None) -> torch.Tensor:
    """x (B, N, H, D) -> float8_e4m3fn with a given descale (B, H) (None: 1): `quantize_e4m3`'s
    rounding (x / descale in float32, clamped to +-448, to nearest even) without its checks, which
    read values on the host; the KV-cache append of 16-bit tokens into a float8 cache."""
    xf = x.float()
    if descale is not None:
        xf = xf / descale[:, None, :, None]
    return xf.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize_e4m3(x8: torch.Tensor, descale: torch.Tensor, group: int = 1) -> torch.Tensor:
    """x8 (B, N, H, D) e4m3 and descale (B, H // group) -> float32 (B, N, H, D).

    `group` > 1 is q's case under GQA: query head h uses the descale of kv head h // group.
    """
    return Fp8Tensor(x8, descale, "head", group).dequantize()
