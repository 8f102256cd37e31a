"""Value checks of the inference entry points' metadata: cu_seqlens, cache_seqlens,
cache_leftpad and block_table are copied to the host and checked (`check_varlen_metadata`,
`check_kvcache_metadata`), once per set of tensors while PyTorch sees no write to them (the
`_once` forms), and not at all with FLASHSUITE_CHECK_METADATA=0 or while a CUDA graph is
captured (`metadata_checks_enabled`). The shape, dtype and device checks that need no values
are `common.validation`'s.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from flashsuite.common.arch import cuda_stream_capturing, env_key, env_table
from flashsuite.common.validation import KVCacheParams, VarlenParams, remember


def check_varlen_metadata(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    vp: VarlenParams,
) -> None:
    """The values of cu_seqlens (one device-to-host copy): start at 0, non-decreasing, end at
    the total, every length within max_seqlen."""
    rows = torch.stack([cu_seqlens_q, cu_seqlens_k]).cpu().tolist()
    for name, cu, total, max_len in (
        ("cu_seqlens_q", rows[0], vp.total_q, vp.attn.seqlen_q),
        ("cu_seqlens_k", rows[1], vp.total_k, vp.attn.seqlen_k),
    ):
        if cu[0] != 0:
            raise ValueError(f"{name}: expected cu_seqlens[0] == 0, got {cu[0]}")
        for i in range(len(cu) - 1):
            if cu[i + 1] < cu[i]:
                raise ValueError(
                    f"{name}: expected non-decreasing values, got {name}[{i}] = {cu[i]} > "
                    f"{name}[{i + 1}] = {cu[i + 1]}"
                )
        if cu[-1] != total:
            side = "q" if name.endswith("q") else "k"
            raise ValueError(
                f"{name}: expected the last value to be the total {total} ({side}.shape[0]), "
                f"got {cu[-1]}"
            )
        longest = max(b - a for a, b in itertools.pairwise(cu))
        if longest > max_len:
            which = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
            raise ValueError(
                f"{which}: expected >= the longest sequence in {name} ({longest}), got {max_len}"
            )


def check_kvcache_metadata(
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kp: KVCacheParams,
    cache_leftpad: torch.Tensor | None = None,
) -> None:
    """The values of cache_seqlens, cache_leftpad and block_table (one device-to-host copy
    each): every row's cache_seqlens + Nnew within the capacity, its cache_leftpad in
    [0, cache_seqlens], every block_table entry that row uses in [0, num_pages). A few
    whole-table operations whatever the batch (a loop over rows cost ~20 us a row); the first
    offending row (and entry) is named."""
    if cache_leftpad is None:
        lens, pads = cache_seqlens.tolist(), None
    else:
        lens, pads = torch.stack([cache_seqlens, cache_leftpad]).tolist()
    capacity, new = kp.attn.seqlen_k, kp.seqlen_new
    if lens and (min(lens) < 0 or max(lens) + new > capacity):
        b = next(i for i, n in enumerate(lens) if n < 0 or n + new > capacity)
        raise ValueError(
            f"cache_seqlens: expected 0 <= cache_seqlens[{b}] + Nnew <= {capacity} (the "
            f"cache capacity), got {lens[b]} + {new}"
        )
    if pads is not None and any(not 0 <= lp <= n for lp, n in zip(pads, lens, strict=True)):
        b = next(i for i, (lp, n) in enumerate(zip(pads, lens, strict=True)) if not 0 <= lp <= n)
        raise ValueError(
            f"cache_leftpad: expected 0 <= cache_leftpad[{b}] <= cache_seqlens[{b}] = "
            f"{lens[b]} (the row's first key), got {pads[b]}"
        )
    if block_table is None or not lens:
        return
    used = [-(-(n + new) // kp.page_size) for n in lens]  # pages each row's keys occupy
    width = max(used)
    if width == 0:
        return
    table = block_table[:, :width].cpu()  # (B, width): every entry a row can use
    # None when every row uses all `width` entries; else which ones each row uses.
    in_use = None if min(used) == width else torch.arange(width) < torch.tensor(used)[:, None]
    lo, hi = torch.aminmax(table if in_use is None else torch.where(in_use, table, 0))
    if int(lo) < 0 or int(hi) >= kp.num_pages:
        bad = (table < 0) | (table >= kp.num_pages)
        if in_use is not None:
            bad &= in_use
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table: expected entries in [0, {kp.num_pages}) (k_cache.shape[0]), got "
            f"block_table[{b}, {j}] = {int(table[b, j])}"
        )


def metadata_checks_enabled() -> bool:
    """Value checks of cu_seqlens / cache_seqlens / block_table copy them to the host.
    FLASHSUITE_CHECK_METADATA=0 turns them off (timing, hot decode loops); the kernels then
    trust the metadata, as flash-attn's do. They are skipped while the current stream captures
    a CUDA graph: a copy to the host cannot be captured, and a replay's values are not known
    at capture time."""
    if env_table.get(_CHECK_KEY) in _CHECKS_OFF:
        return False
    return not cuda_stream_capturing()


_CHECK_KEY = env_key("FLASHSUITE_CHECK_METADATA")
_CHECKS_OFF = tuple(env_key(v) for v in ("", "0"))  # the values that turn the checks off


# Metadata tensors that passed their value check (`_once`): the tensors' ids -> (weak
# references to them, what the check saw of them and of the problem). A model's layers pass
# one set to every layer of a step; the first layer's call checks it and the others find it
# here.
_checked: dict[tuple, tuple] = {}


def check_varlen_metadata_once(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, vp: VarlenParams
) -> None:
    """`check_varlen_metadata`, skipped for a pair of tensors that passed it before for the same
    totals and max_seqlen and that PyTorch has not seen written since (the same tensor objects
    at the same addresses, their version counters unchanged: every in-place op, copy_ and out=
    write advances them). A write PyTorch does not see (a kernel of one's own on the raw memory)
    is not noticed: call `check_varlen_metadata` after one. Tensors without a version counter
    (made under torch.inference_mode) are checked on every call."""
    problem = (vp.total_q, vp.total_k, vp.attn.seqlen_q, vp.attn.seqlen_k)
    _once(
        _checked, (cu_seqlens_q, cu_seqlens_k), problem,
        lambda: check_varlen_metadata(cu_seqlens_q, cu_seqlens_k, vp),
    )  # fmt: skip


def check_kvcache_metadata_once(
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kp: KVCacheParams,
    length: int | None = None,
    cache_leftpad: torch.Tensor | None = None,
) -> None:
    """`check_kvcache_metadata`, skipped as `check_varlen_metadata_once` skips: for
    cache_seqlens and block_table (the tensors given) that passed it before for the same
    capacity, Nnew, page size and page count, unchanged since. A decode step passes one pair to
    every layer, so the first layer's call checks it. `length`: the int every row's
    cache_seqlens was made from, checked on the host by the caller; the block table alone is
    then remembered, with that length."""
    problem = (kp.attn.seqlen_k, kp.seqlen_new, kp.page_size, kp.num_pages, length)
    tensors = (cache_seqlens,) if length is None else ()
    if cache_leftpad is not None:  # checked against the lengths: both are remembered
        tensors = (cache_seqlens, cache_leftpad)
    if block_table is not None:
        tensors = (*tensors, block_table)
    _once(
        _checked, tensors, problem,
        lambda: check_kvcache_metadata(cache_seqlens, block_table, kp, cache_leftpad),
    )  # fmt: skip


def _once(memo: dict, tensors: tuple, problem: tuple, check) -> None:
    """Run `check()` unless `tensors` (the same objects at the same addresses, their version
    counters unchanged) passed it before for `problem`; remember them when it passes. Tensors
    without a version counter (made under torch.inference_mode) are checked every time."""
    if not tensors:
        check()
        return
    try:
        state = (
            *(t._version for t in tensors), *(t.data_ptr() for t in tensors), *problem
        )  # fmt: skip
    except RuntimeError:  # an inference tensor: no version counter
        check()
        return
    key = tuple(id(t) for t in tensors)
    seen = memo.get(key)
    if (
        seen is not None
        and all(ref() is t for ref, t in zip(seen[0], tensors, strict=True))
        and seen[1] == state
    ):
        return
    check()
    remember(memo, key, (tuple(weakref.ref(t) for t in tensors), state))
