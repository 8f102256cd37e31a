"""Tile configurations of fa3's packed (varlen) forward: the dense table's tiles
(`configs.get_config`) on the plain grid, with or without the dense entries' schedule options,
in sections of query heads for causal problems; and whether auto selection takes fa3 for
`dispatch.attention_varlen`."""

from __future__ import annotations

from dataclasses import replace

import torch

from flashsuite.common.validation import AttnParams
from flashsuite.fa3.configs import DTYPES, Fa3Config, dense_options_off, get_config

# Whether auto selection runs fa3 for `dispatch.attention_varlen` on sm90 (else fa2's Triton
# varlen kernel, with fa3's reason in explain()). On: on the H200 (commit e4c4cc5) every GPU
# case of tests/test_fa3_varlen.py passed (per-sequence oracle with NaN guard rows, one binary
# for every batch composition, autograd, 64k mixed tokens), and benchmarks/decode_bench.py
# --varlen timed it at 1.48x fa2's varlen forward (1.34x causal; 64k tokens, H 16, D 128).
VARLEN_AUTO = True


# Whether packed sequences run the dense entries' schedule options (varlen_config; softcap and
# windowed ones never do). On: the GPU cases of tests/test_fa3_varlen.py pass with it, and on an
# H100 (2026-12-06, commit 07880b5, `python -m benchmarks.fa3_varlen_order_ab --head-dim D
# [--non-causal] --options`, 64k tokens in 35 sequences, medians of 5 interleaved passes) it
# timed 1.093x the build without at causal D = 128 (0.833 -> 0.910x the dense forward on the
# same tokens), 1.085x at causal D = 64 (0.896 -> 0.972x), 1.018x non-causal D = 128 and 1.017x
# causal D = 256.
VARLEN_SCHEDULE_OPTIONS = True
# Query heads per launch section of a causal packed grid (varlen_config; 0: the plain order).
VARLEN_CAUSAL_HEAD_SECTION = 8


def varlen_config(
    head_dim: int, dtype: torch.dtype, causal: bool, options: bool | None = None
) -> Fa3Config:
    """The tile config of packed sequences: the dense table's tiles for (head_dim, dtype,
    causal) on the plain grid (one tile per CTA; varlen.py's virtual-block grid). The persistent
    scheduler's order and tile overlap assume one length for every (batch, head). `options`
    (default VARLEN_SCHEDULE_OPTIONS) keeps the dense entry's schedule options (wg_slice,
    split_loops, softmax_apart; `dense_options_off` otherwise).

    Causal grids launch in sections of VARLEN_CAUSAL_HEAD_SECTION query heads (head_section):
    the default (virtual blocks, Hq) order starts the last heads' heaviest tiles after the rest
    of the work, a tail that sections remove. H200, 2026-12-04, commit e2fe513 with the
    sectioned grid, `python -m benchmarks.fa3_varlen_order_ab` (64k tokens in 35 sequences of
    mean 2k, H 16, D 128, bf16, medians of 5 interleaved passes, every sectioned output and LSE
    bitwise equal to the plain grid's): plain 1,398 us (0.878x fa3's dense causal forward on the
    same tokens, 1,081 us), S = 4 / 8 / 16 1,327 / 1,327 / 1,328 us (0.925x)."""
    cfg = get_config(head_dim, dtype, causal)
    if not (VARLEN_SCHEDULE_OPTIONS if options is None else options):
        cfg = dense_options_off(cfg)
    section = VARLEN_CAUSAL_HEAD_SECTION if causal else 0
    return replace(
        cfg, persistent=False, overlap_tiles=False, balanced_order=False, head_section=section
    )


def varlen_config_for(p: AttnParams) -> Fa3Config:
    """`varlen_config` of problem `p` (p.attn of the packed problem); softcap and windowed
    problems without the schedule options, as config_for leaves them."""
    plain = bool(p.softcap or p.is_local)
    return varlen_config(p.head_dim, p.dtype, p.causal, options=False if plain else None)


def can_implement_varlen(cfg: Fa3Config, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the varlen build of the kernel takes `cfg` and `dtype` (on top of can_implement)."""
    if dtype not in DTYPES:
        return False, f"fa3 varlen: dtype {dtype} not in (float16, bfloat16)"
    if cfg.persistent:
        return False, "fa3 varlen: needs the plain grid (persistent=False)"
    if cfg.prefetch_next_q:
        return False, "fa3 varlen: prefetch_next_q follows the dense grid's launch order"
    if cfg.lse_tma:
        return False, "fa3 varlen: lse_tma stores dense LSE rows"
    if cfg.o_direct_store:
        return False, "fa3 varlen: o_direct_store writes dense rows (TMA bounds a sequence)"
    return True, ""
