"""KV-cache addressing shared by every version: where token t of batch row b lives.

A contiguous cache is (B_cache, N_max, Hkv, D): row b's token t is `cache[b, t]`. A paged cache
is (num_pages, page_size, Hkv, D) with block_table (B, max_pages) int32: row b's token t is
`cache[block_table[b, t // page_size], t % page_size]`. Both the append of new tokens and the
per-row gather below are plain PyTorch indexing (no Python loop over tokens), so they run on
any device and inside a custom op.
"""

from __future__ import annotations

import torch

from .arch import cuda_stream_capturing


def token_slots(
    cache_seqlens: torch.Tensor,  # (B,) int32: tokens already in each row
    n_new: int,
    block_table: torch.Tensor | None,  # (B, max_pages) int32, or None for a contiguous cache
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first index, second index) into the cache of the tokens cache_seqlens[b] + j,
    j < n_new, of every row: both (B, n_new) int64."""
    b = cache_seqlens.shape[0]
    pos = cache_seqlens.long()[:, None] + torch.arange(n_new, device=cache_seqlens.device)
    if block_table is None:
        rows = torch.arange(b, device=cache_seqlens.device)[:, None].expand(b, n_new)
        return rows, pos  # (B, n_new), (B, n_new)
    page = torch.gather(block_table.long(), 1, pos // page_size)  # (B, n_new)
    return page, pos % page_size


def append_kv(
    k_cache: torch.Tensor,  # (B_cache, N_max, Hkv, D) or (num_pages, page_size, Hkv, D)
    v_cache: torch.Tensor,  # like k_cache, head dim Dv
    k: torch.Tensor,  # (B, Nnew, Hkv, D)
    v: torch.Tensor,  # (B, Nnew, Hkv, Dv)
    cache_seqlens: torch.Tensor,  # (B,) int32
    block_table: torch.Tensor | None,  # (B, max_pages) int32
) -> None:
    """Write k, v into the cache in place at positions cache_seqlens[b] .. + Nnew of each row."""
    if k.shape[1] == 0:
        return
    first, second = token_slots(cache_seqlens, k.shape[1], block_table, k_cache.shape[1])
    k_cache[first, second] = k  # (B, Nnew) slots of (Hkv, D)
    v_cache[first, second] = v  # (B, Nnew) slots of (Hkv, Dv)


def row_kv(
    cache: torch.Tensor,  # (B_cache, N_max, Hkv, D) or (num_pages, page_size, Hkv, D)
    b: int,
    n: int,
    block_table: torch.Tensor | None,  # (B, max_pages) int32
) -> torch.Tensor:
    """The first n tokens of row b, (n, Hkv, D): a view for a contiguous cache, a gather of
    ceil(n / page_size) pages for a paged one."""
    if block_table is None:
        return cache[b, :n]  # (n, Hkv, D)
    page_size = cache.shape[1]
    pages = block_table[b, : -(-n // page_size)].long()  # (ceil(n / page_size),)
    return cache[pages].flatten(0, 1)[:n]  # (n, Hkv, D)


# (device, raw stream, batch, length) -> the int32 (batch,) tensor of `length` that stands for an
# int cache_seqlens in an eager call (`length_tensor`).
_length_tensors: dict[tuple, torch.Tensor] = {}
LENGTH_TENSORS_MAX = 64


def length_tensor(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """An int cache_seqlens as the kernels take it: int32 (batch,) filled with `length`. Every
    layer of a decode step passes the same int (transformers' decode), so one tensor serves
    the step's layers: one fill a step instead of one a layer (a kernel launch on a GPU). The
    tensors are only read (the append and the kernels index by them) and never reach the
    caller. Keyed by the current stream, so a tensor dropped from the cache is reused by the
    allocator in that stream's order only; under CUDA-graph capture a fresh tensor, which the
    graph fills at each replay and keeps alive itself (a cached one could be dropped while a
    graph still reads it)."""
    if device.type == "cuda":
        if cuda_stream_capturing():
            return torch.full((batch,), length, dtype=torch.int32, device=device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, torch._C._cuda_getCurrentRawStream(index), batch, length)
    else:
        key = (device, None, batch, length)
    t = _length_tensors.get(key)
    if t is None:
        if len(_length_tensors) >= LENGTH_TENSORS_MAX:  # a new step's length: start over
            _length_tensors.clear()
        t = _length_tensors[key] = torch.full((batch,), length, dtype=torch.int32, device=device)
    return t


def dense_as_decode(p, max_rows: int, max_nq: int, mha_max_ctas: int):
    """The KV-cache problem (KVCacheParams: k, v as a full contiguous cache of seqlen_k tokens a
    row, no new tokens, the heuristic's splits) that dense problem `p` (AttnParams) is when a
    split-KV decode kernel should run it, or None: not fp16 / bf16, Dv != D, an empty side,
    more than `max_nq` queries or `max_rows` packed rows (Nq x Hq / Hkv), or no GQA and at
    least `mha_max_ctas` (batch x heads) tiles. The policy of fa2's and fa3's decode routes
    (their interface.decode_route); the kernel's own limits are the version's to add."""
    from .validation import KVCacheParams

    if (
        p.dtype in (torch.float16, torch.bfloat16)
        and p.head_dim_v == p.head_dim
        and min(p.batch, p.seqlen_q, p.seqlen_k, p.heads_q) > 0
        and p.seqlen_q <= max_nq
        and p.seqlen_q * p.group_size <= max_rows
        and (p.group_size > 1 or p.batch * p.heads_q < mha_max_ctas)
    ):
        return KVCacheParams(p, seqlen_new=0, page_size=0, num_pages=0, num_splits=0)
    return None
