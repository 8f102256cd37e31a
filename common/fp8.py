"""Float8 (e4m3) inputs for the fp8 forward: per-(batch, head) quantisation and its inverse.

The fp8 path takes q, k, v in float8_e4m3fn with descale factors of shape (B, Hkv): the
real value of an element is its e4m3 value times the descale of its batch and kv head (q's
descale is per kv head too, shared by the query heads of a GQA group; docs/design.md).
`quantize_e4m3` makes such a pair from a floating tensor with descale = amax / 448 (amax over
one (batch, head) slice), so each slice uses e4m3's full range and nothing saturates.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def _check_finite(name: str, x: torch.Tensor) -> None:
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise ValueError(f"{name}: expected finite values, got {bad} NaN or infinite entries")


def quantize_e4m3(
    x: torch.Tensor, descale: torch.Tensor | None = None, group: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, H, D) floating -> (x8 (B, N, H, D) float8_e4m3fn, descale (B, H // group)).

    `group` > 1 is q's case under GQA: the query heads h of one kv head (h // group) share a
    descale. Without `descale` it is amax / 448 over the (batch, kv head) slice, float32 (1 for
    an all-zero slice). Each
    element is divided by its descale in float32, clamped to [-448, 448] (saturation:
    e4m3fn has no infinity) and rounded to nearest even. NaN or infinite inputs raise
    ValueError (they have no e4m3 encoding that a descale could undo).
    """
    if not x.is_floating_point() or x.dim() != 4:
        raise ValueError(
            f"x: expected a 4-d floating tensor (B, N, H, D), got {x.dim()}-d {x.dtype}"
        )
    _check_finite("x", x)
    b, n, hq, d = x.shape
    if group < 1 or hq % group:
        raise ValueError(f"group: expected a divisor of x's {hq} heads, got {group}")
    h = hq // group
    xf = x.float().reshape(b, n, h, group * d)  # (B, N, Hkv, G * D): a group's heads together
    if descale is None:
        amax = xf.abs().amax(dim=(1, 3))  # (B, H)
        descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    else:
        if tuple(descale.shape) != (b, h) or descale.dtype != torch.float32:
            raise ValueError(
                f"descale: expected float32 of shape (B, H) = {(b, h)}, "
                f"got {descale.dtype} {tuple(descale.shape)}"
            )
        _check_finite("descale", descale)
        if not bool((descale > 0).all()):
            raise ValueError("descale: expected positive values")
    scaled = (xf / descale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)  # (B, N, Hkv, G * D)
    return scaled.to(E4M3).reshape(b, n, hq, d), descale


def dequantize_e4m3(x8: torch.Tensor, descale: torch.Tensor, group: int = 1) -> torch.Tensor:
    """x8 (B, N, H, D) e4m3 and descale (B, H // group) -> float32 (B, N, H, D).

    `group` > 1 is q's case under GQA: query head h uses the descale of kv head h // group.
    """
    ds = descale.repeat_interleave(group, dim=1) if group > 1 else descale  # (B, H)
    return x8.float() * ds[:, None, :, None]
