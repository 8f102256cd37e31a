"""flash-attn 2's functions, same names, argument order, defaults and return values:

    # from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flashsuite.dispatch.flash_attn import (
        flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
    )

so switching is an import. They run `dispatch.attention`, `attention_varlen` and
`attention_with_kvcache` with auto selection. The packed forms (`flash_attn_qkvpacked_func`,
`flash_attn_kvpacked_func` and their varlen twins) take q, k, v stacked in one tensor
((B, N, 3, H, D), (B, Nk, 2, Hkv, D); varlen (total, 3, H, D), (total_k, 2, Hkv, D)) and run
the unpacked call on its views, so the packed tensor gets one gradient. What flashsuite does
not implement raises a clear error instead of being ignored: dropout_p > 0, alibi_slopes.
The varlen call with a block_table runs as KV-cache attention on the pages in place where no
gradient is needed and every sequence has max_seqlen_q queries or at most 16 (a decode batch;
`_paged_as_kvcache`), and otherwise gathers each sequence's pages into packed k, v first
(`_gather_pages`, one copy). The KV-cache call's rotary tables rotate q and the new k in one
Triton launch before the attention (common.rotary_kernel), its cache_batch_idx reads each
cache row as pages of that row (`_batch_idx_pages`), and its cache_leftpad starts each row of
a contiguous cache at a slot of its own.

Two differences in values, both in rows that see no key: flashsuite returns an LSE of -inf
there (log 0; flash-attn's kernels write +inf), and the output 0 as flash-attn does.
`return_attn_probs=True` returns (out, softmax_lse, S_dmask) as flash-attn does; S_dmask is
an empty tensor there too, flash-attn filling it only when dropout_p > 0.
`deterministic` is honoured: fa1's, fa2's and the portable backward are deterministic; fa3's
own (the default partner of fa3's forward on sm90) adds dQ in arrival order, as flash-attn's
does, and in a fixed order under torch.use_deterministic_algorithms(True), so
deterministic=True with fa3's backward is refused unless that flag is on (or
FLASHSUITE_FA3_BWD=0 pairs fa2's backward instead). The same holds for the varlen call: under
the flag fa3's ordered varlen backward runs (fa2's deterministic one where fa3's backward is
off). `deterministic`,
`return_attn_probs` and `return_softmax_lse` must be bools.
"""

from __future__ import annotations

import torch

from flashsuite.common.metadata import metadata_checks_enabled
from flashsuite.common.validation import check_flag, check_index_tensor
from flashsuite.dispatch import api, inference


def _refuse(**unsupported: object) -> None:
    """ValueError naming the first argument that asks for what flashsuite does not implement."""
    for name, value in unsupported.items():
        if torch.is_tensor(value):
            raise ValueError(
                f"{name}: not supported by flashsuite (expected None, got a tensor of shape "
                f"{tuple(value.shape)})"
            )
        if value is not None and value != 0:
            raise ValueError(f"{name}: not supported by flashsuite (expected 0, got {value!r})")


def _window(window_size) -> tuple[int, int]:
    """flash-attn takes any (left, right) sequence; the memoised path wants a tuple."""
    return tuple(window_size) if isinstance(window_size, list) else window_size


def _empty_probs(q: torch.Tensor) -> torch.Tensor:
    """flash-attn's S_dmask without dropout: an empty tensor of q's dtype."""
    return torch.empty((0,), dtype=q.dtype, device=q.device)


def _check_deterministic(deterministic: bool, q, k, v, select=None, **options) -> None:
    """deterministic=True with a backward that adds dQ in run-to-run order: refuse. `select`
    gives the dispatch Choice (default: dense `api.select` on q, k, v and `options`)."""
    check_flag("deterministic", deterministic)
    if not deterministic or not api._needs_grad(q, k, v):
        return
    backward = (select or (lambda: api.select(q, k, v, **options)))().backward
    if backward == "fa3" and not torch.are_deterministic_algorithms_enabled():
        raise ValueError(
            "deterministic: expected torch.use_deterministic_algorithms(True) where fa3's own "
            "backward would run (without the flag it adds dQ in arrival order), got the flag "
            "off; turn it on, or set FLASHSUITE_FA3_BWD=0 for fa2's deterministic backward"
        )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's `flash_attn_func`: q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv),
    bottom-right causal, window (left, right) with -1 unbounded. Returns out (B, Nq, Hq, Dv),
    or with return_attn_probs=True (out, softmax_lse (B, Hq, Nq) float32, empty S_dmask)."""
    _refuse(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    options = dict(
        causal=causal, softmax_scale=softmax_scale, window_size=_window(window_size),
        softcap=softcap,
    )  # fmt: skip
    _check_deterministic(deterministic, q, k, v, **options)
    check_flag("return_attn_probs", return_attn_probs)
    if return_attn_probs:
        out, lse = api.attention(q, k, v, return_lse=True, **options)
        return out, lse, _empty_probs(q)
    return api.attention(q, k, v, **options)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn's `flash_attn_varlen_func`: packed q (total_q, Hq, D), k (total_k, Hkv, D),
    v (total_k, Hkv, Dv), cu_seqlens int32 (B + 1,); each sequence bottom-right on its own
    lengths. Returns out (total_q, Hq, Dv), or with return_attn_probs=True (out, softmax_lse
    (Hq, total_q) float32, empty S_dmask). `deterministic` as flash_attn_func's: fa2's and the
    portable varlen backwards are deterministic; fa3's own adds dQ in arrival order unless
    torch.use_deterministic_algorithms(True) is on, so deterministic=True without that flag is
    refused where fa3's would run. With block_table (B, max_pages) int32, k and v are pages
    (num_pages, page_size, Hkv, D) and sequence b's keys are the first cu_seqlens_k[b + 1] −
    cu_seqlens_k[b] tokens of its pages: read in place by the KV-cache path when no gradient
    is needed and every sequence has max_seqlen_q queries or at most 16
    (`_paged_as_kvcache`), else
    gathered into packed k, v first (one copy of total_k tokens, differentiable) and attended
    as above."""
    _refuse(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    options = dict(
        causal=causal, softmax_scale=softmax_scale, window_size=_window(window_size),
        softcap=softcap,
    )  # fmt: skip
    check_flag("return_attn_probs", return_attn_probs)
    if block_table is not None:
        check_flag("deterministic", deterministic)  # the route needs no gradient: no backward
        routed = _paged_as_kvcache(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
            options, return_attn_probs,
        )  # fmt: skip
        if routed is not None:
            return routed
        k, v = _gather_pages(q, k, v, block_table, cu_seqlens_k)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_deterministic(deterministic, q, k, v, lambda: inference.select_varlen(*args, **options))
    result = inference.attention_varlen(*args, **options, return_lse=return_attn_probs)
    return (*result, _empty_probs(q)) if return_attn_probs else result


# The most queries a sequence of a paged varlen call may have for it to run as KV-cache
# attention when the sequences' query counts differ (each padded to max_seqlen_q): the decode
# route's bound on queries (fa3.interface.DECODE_ROUTE_MAX_NQ).
PADDED_MAX_SEQLEN_Q = 16


def _paged_as_kvcache(q, k, v, cu_q, cu_k, max_q, max_k, table, options, return_lse):
    """The paged varlen call as KV-cache attention on the pages in place (no gather, no copy,
    nothing read to the host with the value checks off, so a CUDA graph can capture it), or
    None where it does not apply: a gradient is needed, the pages are not of a size the cache
    path takes (a multiple of 16 in [16, 256]), or the sequences' query counts differ and
    max_seqlen_q is above PADDED_MAX_SEQLEN_Q. Sequence b's queries are row b of a
    (B, max_seqlen_q, Hq, D) q: a view when every sequence has max_seqlen_q of them (total_q =
    B · max_seqlen_q: a decode batch, or speculative steps of one length), else a copy with
    sequence b's l_b queries in its last l_b slots (their bottom-right alignment is then the
    varlen call's; the slots before them are zeros whose outputs are dropped). Its keys are row
    b of the paged cache with cache_seqlens[b] = cu_seqlens_k[b + 1] - cu_seqlens_k[b], causal
    and windows aligned to the end of each row as in the varlen call. With the value checks
    on, one host copy of the offsets must show them well formed (starting at 0,
    non-decreasing, ending at total_q, lengths within max_seqlen and the table's pages) or the
    general path runs and says what is wrong; the cache path then checks the table's
    entries."""
    tensors = (q, k, v, cu_q, cu_k, table)
    if not all(type(t) is torch.Tensor for t in tensors) or isinstance(max_q, bool):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    b = cu_q.shape[0] - 1 if cu_q.dim() == 1 else -1
    if (
        not isinstance(max_q, int)
        or b < 1
        or max_q < 1
        or q.dim() != 3
        or q.shape[0] > b * max_q
        or (q.shape[0] < b * max_q and max_q > PADDED_MAX_SEQLEN_Q)
        or k.dim() != 4
        or v.dim() != 4
        or k.shape[1] % 16
        or not 16 <= k.shape[1] <= 256
    ):
        return None
    check_index_tensor("cu_seqlens_q", cu_q, (b + 1,), q.device)
    check_index_tensor("cu_seqlens_k", cu_k, (b + 1,), q.device)
    check_index_tensor("block_table", table, (b, -1), q.device)
    total_q, hq, d = q.shape
    if metadata_checks_enabled():
        rows = torch.stack([cu_q, cu_k]).cpu()
        steps = rows[:, 1:] - rows[:, :-1]
        limit = min(max_k, table.shape[1] * k.shape[1]) if isinstance(max_k, int) else -1
        if rows[:, 0].any() or int(rows[0, -1]) != total_q or steps.min() < 0:
            return None
        if steps[0].max() > max_q or steps[1].max() > limit:
            return None
    lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    slots = None  # each query's row in the padded (B * max_seqlen_q) queries, when they differ
    if total_q == b * max_q:
        q_rows = q.view(b, max_q, hq, d)
    else:
        cu = cu_q.long()
        t, seq = _token_sequences(cu, total_q)  # (total_q,) each
        # The sequence's queries fill its last slots; clamped so that malformed offsets (value
        # checks off) index nothing outside the padded queries.
        slots = (seq * max_q + max_q - cu[seq + 1] + t).clamp(0, b * max_q - 1)
        q_rows = q.new_zeros(b * max_q, hq, d)
        q_rows[slots] = q
        q_rows = q_rows.view(b, max_q, hq, d)
    result = inference.attention_with_kvcache(
        q_rows, k, v, cache_seqlens=lens, block_table=table, return_lse=return_lse, **options
    )
    out, lse = result if return_lse else (result, None)
    out = out.view(b * max_q, hq, out.shape[-1])
    out = out if slots is None else out[slots]
    if not return_lse:
        return out
    lse = lse.permute(1, 0, 2).reshape(hq, b * max_q)  # (B, Hq, Nq) -> (Hq, B * max_seqlen_q)
    lse = lse if slots is None else lse[:, slots].contiguous()  # (Hq, total_q)
    return out, lse, _empty_probs(q)


def _token_sequences(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token index, its sequence) of the `total` packed tokens that the int64 offsets `cu`
    (B + 1,) divide, both (total,) int64 on cu's device; sequences clamped into [0, B) so
    that malformed offsets (value checks off) index no row outside the batch."""
    t = torch.arange(total, device=cu.device)
    return t, torch.searchsorted(cu[1:], t, right=True).clamp(0, cu.shape[0] - 2)


def _gather_pages(q, k, v, table, cu_seqlens_k) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (total_k, Hkv, D) copies of each sequence's keys and values from pages
    (num_pages, page_size, Hkv, D) through `table` (B, max_pages) int32: token j of sequence
    b is page table[b, j // page_size], slot j % page_size. Clear errors for the table, the
    pages and (value checks on) lengths past a row of pages or entries outside the pages; the
    indices are clamped into range besides, so nothing is read out of bounds without them."""
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, (-1,), q.device)
    b = cu_seqlens_k.shape[0] - 1
    if b < 0:
        raise ValueError("cu_seqlens_k: expected (B + 1,) offsets starting at 0, got none")
    check_index_tensor("block_table", table, (b, -1), q.device)
    if table.shape[1] < 1:
        raise ValueError(f"block_table: expected at least one page a row, got {tuple(table.shape)}")
    for name, t in (("k", k), ("v", v)):
        if not torch.is_tensor(t) or t.dim() != 4 or t.shape[:3] != k.shape[:3]:
            got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"{name}: expected pages (num_pages, page_size, Hkv, D) with "
                             f"block_table, k's {tuple(k.shape[:3])} first, got {got}")  # fmt: skip
    num_pages, page = k.shape[0], k.shape[1]
    cu = cu_seqlens_k.long()
    total = int(cu[-1])  # the packed size: one device-to-host copy
    if total <= 0 or b == 0:  # no keys (or offsets attention_varlen's checks refuse)
        return k.flatten(0, 1)[:0], v.flatten(0, 1)[:0]
    t, seq = _token_sequences(cu, total)  # (total_k,) each
    j = t - cu[seq]  # token index within its sequence
    if metadata_checks_enabled():
        lengths = cu[1:] - cu[:-1]
        if int(lengths.max()) > table.shape[1] * page:
            s = int(lengths.argmax())
            raise ValueError(
                f"cu_seqlens_k: expected sequences of at most {table.shape[1] * page} keys "
                f"(block_table's {table.shape[1]} pages of {page}), got {int(lengths[s])} for "
                f"sequence {s}"
            )
        used = table[seq, j // page]
        lo, hi = (int(x) for x in torch.aminmax(used))
        if lo < 0 or hi >= num_pages:
            bad = int(((used < 0) | (used >= num_pages)).nonzero()[0])
            raise ValueError(
                f"block_table: expected entries in [0, {num_pages}) (k's pages), got "
                f"block_table[{int(seq[bad])}, {int(j[bad]) // page}] = {int(used[bad])}"
            )
    col = (j // page).clamp(0, table.shape[1] - 1)
    flat = table[seq, col].long().clamp(0, max(num_pages - 1, 0)) * page + j % page
    return k.flatten(0, 1)[flat], v.flatten(0, 1)[flat]


def _capacity(k_cache, block_table) -> int:
    """Tokens a cache row can hold: N_max, or max_pages x page_size for a paged cache."""
    pages = 1 if block_table is None else block_table.shape[1]
    return int(k_cache.shape[1] * pages)


def _batch_idx_pages(q, k_cache, v_cache, index):
    """flash-attn's cache_batch_idx as a paged cache over the same memory: each cache row of
    N_max tokens viewed as pages of the largest multiple of 16 up to 256 that divides N_max,
    and block_table[b, j] = index[b] · (N_max / page) + j. (k_cache, v_cache, block_table):
    views of the caches, no copy; clear errors for an index that is not int32 (B,) on q's
    device (the check every index argument takes) or (value checks on) out of [0, B_cache),
    and for caches whose rows cannot be viewed as pages."""
    check_index_tensor("cache_batch_idx", index, (q.shape[0],), q.device)
    views = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not torch.is_tensor(cache) or cache.dim() != 4:
            got = tuple(cache.shape) if torch.is_tensor(cache) else type(cache).__name__
            raise ValueError(f"{name}: expected (B_cache, N_max, Hkv, D), got {got}")
        n_max = cache.shape[1]
        page = next((p for p in range(256, 0, -16) if n_max % p == 0), 0)
        if page == 0 or cache.stride(0) != n_max * cache.stride(1):
            raise ValueError(
                f"{name}: with cache_batch_idx, expected rows of N_max a multiple of 16 tokens, "
                f"each row's tokens one after another (stride(0) = N_max · stride(1)), got "
                f"shape {tuple(cache.shape)}, strides {cache.stride()}"
            )
        views.append(cache.view(cache.shape[0] * (n_max // page), page, *cache.shape[2:]))
    rows = k_cache.shape[0]
    if metadata_checks_enabled() and index.numel():
        lo, hi = (int(x) for x in torch.aminmax(index))
        if lo < 0 or hi >= rows:
            bad = int(((index < 0) | (index >= rows)).nonzero()[0])
            raise ValueError(f"cache_batch_idx: expected entries in [0, {rows}) (k_cache's "
                             f"rows), got cache_batch_idx[{bad}] = {int(index[bad])}")  # fmt: skip
    per_row = k_cache.shape[1] // views[0].shape[1]
    steps = torch.arange(per_row, device=index.device)
    table = (index.long()[:, None] * per_row + steps).to(torch.int32)  # (B, N_max / page)
    return views[0], views[1], table


def _rotate(q, k, v, cos, sin, cache_seqlens, capacity: int, local: bool, interleaved):
    """(q, k) rotated as flash_attn_with_kvcache's rotary tables say, after checking them: both
    tables, 2-D of one shape on q's device, a rotary_dim (2 · columns) that is a multiple of 16
    and at most q's head dim, k and v given, and a row for every position a query or new key
    can take in a cache of `capacity` tokens a row."""
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not torch.is_tensor(t):
            raise ValueError(f"{name}: expected a tensor (seqlen_ro, rotary_dim / 2) with the "
                             f"other rotary table, got {type(t).__name__}")  # fmt: skip
        if t.dim() != 2 or t.device != q.device or not t.is_floating_point():
            raise ValueError(
                f"{name}: expected a floating 2-D (seqlen_ro, rotary_dim / 2) tensor on "
                f"{q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if sin.shape != cos.shape:
        raise ValueError(f"rotary_sin: expected rotary_cos's shape {tuple(cos.shape)}, got "
                         f"{tuple(sin.shape)}")  # fmt: skip
    rd, d = 2 * cos.shape[1], q.shape[-1]
    if rd == 0 or rd % 16 or rd > d:
        raise ValueError(f"rotary_cos: expected rotary_dim (2 x its {cos.shape[1]} columns) a "
                         f"multiple of 16 in [16, {d}] (q's head dim), got {rd}")  # fmt: skip
    if k is None or v is None:
        raise ValueError("k: expected new keys and values with rotary tables (flash-attn "
                         "rotates only what it appends), got k, v = None")  # fmt: skip
    check_flag("rotary_interleaved", interleaved)
    if not torch.is_tensor(k) or k.dim() != 4 or q.dim() != 4 or k.shape[::3] != q.shape[::3]:
        got = tuple(k.shape) if torch.is_tensor(k) else type(k).__name__
        raise ValueError(f"k: expected (B, Nnew, Hkv, D) with q's B and D, q {tuple(q.shape)}, "
                         f"got {got}")  # fmt: skip
    if k.device != q.device:
        raise ValueError(f"k: expected q's device {q.device}, got {k.device}")
    nq, n_new = q.shape[1], k.shape[1]
    # Valid lengths (at most capacity - n_new) reach position capacity - n_new + nq - 1 with
    # causal or windowed queries, capacity - n_new without (every query at the length).
    need = max(capacity, capacity - n_new + (nq if local else 1))
    if cos.shape[0] < need:
        raise ValueError(
            f"rotary_cos: expected a row for every position a query or new key can take with "
            f"the cache's capacity {capacity} (at least {need} rows), got {cos.shape[0]}"
        )
    # Lengths are checked after this (attention_with_kvcache); a bad one must not index the
    # tables out of bounds before that error: rotate_qk clamps positions into the tables.
    from flashsuite.common.rotary_kernel import rotate_qk  # Triton: imported on first use

    return rotate_qk(q, k, cos, sin, cache_seqlens, local, interleaved)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    k_descale=None,
    v_descale=None,
):
    """flash-attn's `flash_attn_with_kvcache` (forward only): q (B, Nq, Hq, D) against
    k_cache, v_cache (B_cache, N_max, Hkv, D) or, with block_table (B, max_pages) int32, pages
    (num_pages, page_size, Hkv, D) with page_size a multiple of 16 in [16, 256]; k, v
    (B, Nnew, Hkv, D), when given, are written into the cache in place at cache_seqlens first.
    cache_seqlens: int32 (B,) or an int; None means every row's cache is full (only without
    new k, v). Returns out (B, Nq, Hq, Dv), or (out, softmax_lse (B, Hq, Nq)) with
    return_softmax_lse=True. rotary_cos, rotary_sin (seqlen_ro, rotary_dim / 2), with k and v:
    q and the new k rotated first (common.rotary; `rotary_interleaved`: GPT-J pairs, else
    GPT-NeoX halves), k at positions cache_seqlens + j, q at cache_seqlens + i when causal or
    windowed, else all at cache_seqlens. cache_batch_idx: int32 (B,), batch row b reads (and
    appends to) cache row cache_batch_idx[b] of a contiguous cache (not with block_table).
    cache_leftpad: int32 (B,), row b's keys start at slot cache_leftpad[b] <= cache_seqlens[b]
    of a contiguous cache (neither with block_table nor with cache_batch_idx): it attends
    slots cache_leftpad[b] .. cache_seqlens[b] + Nnew - 1, causal aligned to their end; the
    append and the rotary positions are the slots' own, as in flash-attn. A float8_e4m3fn cache
    under fp16 / bf16 q takes keyword-only `k_descale`, `v_descale` (flash-attn 3's names):
    float32 (B, Hkv), None for 1, indexed by q's batch row (as flash-attn 3's, also with
    cache_batch_idx); new k, v in e4m3, or in q's dtype rounded to e4m3 with them
    (`attention_with_kvcache`)."""
    _refuse(alibi_slopes=alibi_slopes)
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx: expected None with a paged cache (block_table "
                             "picks each row's pages), got a tensor")  # fmt: skip
        if cache_leftpad is not None:
            raise ValueError(
                "cache_leftpad: expected None with cache_batch_idx (its rows are read as pages, "
                "which start at their first slot), got a tensor"
            )
        k_cache, v_cache, block_table = _batch_idx_pages(q, k_cache, v_cache, cache_batch_idx)
    if cache_seqlens is None:
        if k is not None:
            raise ValueError(
                "cache_seqlens: expected the tokens already in each row (an int or int32 (B,) "
                "tensor) when k and v are appended, got None"
            )
        cache_seqlens = _capacity(k_cache, block_table)
    window_size = _window(window_size)
    if rotary_cos is not None or rotary_sin is not None:
        if k is not None and k.dtype == torch.float8_e4m3fn:
            raise ValueError(
                "rotary_cos: the new k must be in q's dtype to be rotated (then rounded into the "
                "float8 cache), got float8_e4m3fn"
            )
        local = causal or tuple(window_size) != (-1, -1)
        capacity = _capacity(k_cache, block_table)
        q, k = _rotate(q, k, v, rotary_cos, rotary_sin, cache_seqlens, capacity, local,
                       rotary_interleaved)  # fmt: skip
    return inference.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, num_splits=num_splits,
        return_lse=check_flag("return_softmax_lse", return_softmax_lse),
        cache_leftpad=cache_leftpad, descale_k=k_descale, descale_v=v_descale,
    )  # fmt: skip


def _unpack(name: str, packed, parts: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The `parts` views of `packed` along its stacking dim (the third from last), as flash-attn
    unpacks them; a clear error for a non-tensor or a shape other than `layout`."""
    ndim = layout.count(",") + 1
    if not torch.is_tensor(packed):
        raise TypeError(f"{name}: expected a tensor {layout}, got {type(packed).__name__}")
    if packed.dim() != ndim or packed.shape[-3] != parts:
        raise ValueError(f"{name}: expected shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(-3)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's `flash_attn_qkvpacked_func`: qkv (B, N, 3, H, D), q, k and v stacked on
    dim 2. flash_attn_func on its three views; the gradient comes back as one (B, N, 3, H, D)
    tensor (autograd through the views)."""
    q, k, v = _unpack("qkv", qkv, 3, "(B, N, 3, H, D)")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's `flash_attn_kvpacked_func`: q (B, Nq, Hq, D), kv (B, Nk, 2, Hkv, D), k and
    v stacked on dim 2 (Hq a multiple of Hkv). flash_attn_func on q and kv's two views."""
    k, v = _unpack("kv", kv, 2, "(B, Nk, 2, Hkv, D)")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's `flash_attn_varlen_qkvpacked_func`: packed sequences qkv (total, 3, H, D),
    one cu_seqlens int32 (B + 1,) and max_seqlen for queries and keys alike.
    flash_attn_varlen_func on its three views."""
    q, k, v = _unpack("qkv", qkv, 3, "(total, 3, H, D)")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's `flash_attn_varlen_kvpacked_func`: q (total_q, Hq, D), kv (total_k, 2,
    Hkv, D). flash_attn_varlen_func on q and kv's two views."""
    k, v = _unpack("kv", kv, 2, "(total_k, 2, Hkv, D)")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
