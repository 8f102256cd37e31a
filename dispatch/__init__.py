"""flashsuite.dispatch: one API over every FlashAttention generation.

    from flashsuite import dispatch
    out = dispatch.attention(q, k, v, causal=True)          # (B, N, H, D) layout
    print(dispatch.explain(q, k, v, causal=True))           # which version, and why

Imports torch only; the versions (Triton, CuTe DSL) load lazily on first use.
"""

from flashsuite.dispatch.api import (
    Choice,
    Unsupported,
    attention,
    auto_order,
    explain,
    sdpa,
    select,
)
from flashsuite.dispatch.registry import VERSIONS

__all__ = [
    "VERSIONS",
    "Choice",
    "Unsupported",
    "attention",
    "auto_order",
    "explain",
    "sdpa",
    "select",
]
