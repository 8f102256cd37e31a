"""Hadamard rotation of q and k over the head dim (incoherent processing for fp8 attention).

With H an orthonormal (D, D) Hadamard matrix (H Hᵀ = I), (q H)(k H)ᵀ = q kᵀ: the scores, and so
the attention, are unchanged, while each rotated coordinate is a ±1/√D mix of all D original
ones. A few large channels (outliers) are spread over every coordinate, so that a scale fitted
to the amax no longer gives most coordinates only a sliver of the fp8 range. V is not rotated
(that would rotate the output). The gradient of a rotated operand rotates back:
dq = dq_rotated Hᵀ (`rotate(..., inverse=True)`).

`hadamard(n)` is Sylvester's construction for n = 2^k and, for n = 12·2^k (D = 96, 192),
Paley's order-12 matrix (quadratic residues mod 11) Kronecker Sylvester's; entries are exactly
±1/√n in float64.
"""

from __future__ import annotations

import functools
import math

import torch

# Quadratic residues modulo 11, the Jacobsthal matrix of Paley's construction of order 12.
_PALEY_Q = 11
_RESIDUES = frozenset((i * i) % _PALEY_Q for i in range(1, _PALEY_Q))


def _paley12() -> torch.Tensor:
    """The ±1 Hadamard matrix of order 12 (Paley I, q = 11 ≡ 3 mod 4), float64."""
    q = _PALEY_Q
    chi = [0] + [1 if a in _RESIDUES else -1 for a in range(1, q)]  # quadratic character
    jac = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)])  # (q, q)
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)  # skew: S = -Sᵀ
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = jac
    return torch.eye(q + 1, dtype=torch.float64) + s  # (12, 12), H Hᵀ = 12 I


def _size_ok(n: int) -> bool:
    """n = 2^k, or 12·2^k (3·2^k with k >= 2)."""
    odd = n // (n & -n)  # n without its factors of 2
    return odd == 1 or (odd == 3 and n >= 12)


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    h = _paley12() if n % 3 == 0 else torch.ones(1, 1, dtype=torch.float64)
    sylvester = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h, sylvester)  # doubles the order, still ±1 with H Hᵀ = n I
    return h / math.sqrt(n)


def hadamard(
    n: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> torch.Tensor:
    """Orthonormal Hadamard matrix (n, n): entries ±1/√n, H Hᵀ = I. n = 2^k or 12·2^k."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not _size_ok(n):
        raise ValueError(f"n: expected 2^k or 12·2^k (64, 96, 128, 192, 256, ...), got {n!r}")
    return _hadamard_cpu(n).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """x (..., D) floating -> x H (or x Hᵀ with `inverse`), computed in float64 and returned in
    float64 for float64 x, float32 otherwise (the values to quantise; a 16-bit result would
    round them again). D must be 2^k or 12·2^k."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        got = f"{x.dim()}-d {x.dtype}" if isinstance(x, torch.Tensor) else type(x)
        raise ValueError(f"x: expected a floating tensor (..., D), got {got}")
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"x: expected the unquantised tensor, got {x.dtype} (rotate first)")
    d = x.shape[-1]
    if not _size_ok(d):
        raise ValueError(f"x: expected a head dim 2^k or 12·2^k, got D = {d}")
    h = hadamard(d, device=x.device)
    out = x.double() @ (h.T if inverse else h)  # (..., D)
    return out if x.dtype == torch.float64 else out.float()
