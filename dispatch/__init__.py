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
from flashsuite.dispatch.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flashsuite.dispatch.flash_backend import activate_sdpa, deactivate_sdpa, sdpa_plugin
from flashsuite.dispatch.hf import register_transformers
from flashsuite.dispatch.inference import (
    attention_varlen,
    attention_with_kvcache,
    explain_kvcache,
    explain_varlen,
    select_kvcache,
    select_varlen,
)
from flashsuite.dispatch.registry import VERSIONS

__all__ = [
    "VERSIONS",
    "Choice",
    "Unsupported",
    "activate_sdpa",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "auto_order",
    "deactivate_sdpa",
    "explain",
    "explain_kvcache",
    "explain_varlen",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "register_transformers",
    "sdpa",
    "sdpa_plugin",
    "select",
    "select_kvcache",
    "select_varlen",
]
