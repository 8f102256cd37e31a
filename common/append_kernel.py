"""The append of new keys and values into a KV cache in one Triton launch: what fa2 and fa3 run
before attending (`append`), on a GPU or under the Triton interpreter.

`common.kvcache.append_kv` does the same with PyTorch indexing: it is the reference (the
portable version runs it, and the tests hold this kernel to it bit for bit), and the path
taken where Triton cannot run. On a GPU its index arithmetic and two index_put_ calls are
about eight kernel launches' worth of host time per decode step; this is one.

Program (row b, new token j) of the grid (B * Nnew, Hkv) copies k[b, j, h] and v[b, j, h] to
the token's slot: row b, position cache_seqlens[b] + j of a contiguous cache, or page
block_table[b, pos // page_size], slot pos % page_size of a paged one. A row of negative
length, a position past the capacity (lengths the value checks refuse; they are off with
FLASHSUITE_CHECK_METADATA=0) or a page index outside [0, num_pages) writes nothing: no store
lands outside the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arch import triton_interpreter
from .kvcache import append_kv
from .triton_launch import launch, next_power_of_2


@triton.jit
def _append_kv(
    K,  # (B, Nnew, Hkv, D)
    V,  # (B, Nnew, Hkv, Dv)
    Kc,  # (B_cache, N_max, Hkv, D) or (num_pages, page_size, Hkv, D)
    Vc,  # like Kc, head dim Dv
    Lens,  # (B,) int32: tokens already in each row
    Table,  # (B, max_pages) int32 when PAGED, else unused
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_kcp,
    stride_kcn,
    stride_kch,
    stride_vcp,
    stride_vcn,
    stride_vch,
    stride_tb,
    n_new,
    page_size,  # tokens per page (PAGED)
    num_pages,  # pages (PAGED), rows of the cache otherwise
    capacity,  # tokens a row can hold: N_max, or max_pages * page_size
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM
    DV_PAD: tl.constexpr,
    PAGED: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = pid // n_new
    j = pid - b * n_new
    n = tl.load(Lens + b)
    pos = n + j
    ok = (n >= 0) & (pos < capacity)
    if PAGED:
        index = tl.where(ok, pos, 0) // page_size
        page = tl.load(Table + b.to(tl.int64) * stride_tb + index, mask=ok, other=-1)
        slot = pos - index * page_size
        ok = ok & (page >= 0) & (page < num_pages)
    else:
        page = b
        slot = pos
        ok = ok & (b < num_pages)
    page = page.to(tl.int64)
    slot = slot.to(tl.int64)
    d = tl.arange(0, D_PAD)
    src = K + b.to(tl.int64) * stride_kb + j.to(tl.int64) * stride_kn + h * stride_kh + d
    dst = Kc + page * stride_kcp + slot * stride_kcn + h * stride_kch + d
    tl.store(dst, tl.load(src, mask=d < HEAD_DIM), mask=(d < HEAD_DIM) & ok)
    dv = tl.arange(0, DV_PAD)
    src = V + b.to(tl.int64) * stride_vb + j.to(tl.int64) * stride_vn + h * stride_vh + dv
    dst = Vc + page * stride_vcp + slot * stride_vcn + h * stride_vch + dv
    tl.store(dst, tl.load(src, mask=dv < HEAD_DIM_V), mask=(dv < HEAD_DIM_V) & ok)


def append(
    k_cache: torch.Tensor,  # (B_cache, N_max, Hkv, D) or (num_pages, page_size, Hkv, D)
    v_cache: torch.Tensor,  # like k_cache, head dim Dv
    k: torch.Tensor,  # (B, Nnew, Hkv, D)
    v: torch.Tensor,  # (B, Nnew, Hkv, Dv)
    cache_seqlens: torch.Tensor,  # (B,) int32
    block_table: torch.Tensor | None,  # (B, max_pages) int32
) -> None:
    """Write k, v into the cache in place at positions cache_seqlens[b] .. + Nnew of each row
    (`common.kvcache.append_kv`'s result), by `_append_kv` where Triton can run it (CUDA
    tensors, or the interpreter) and every tensor has a unit last stride; else by
    append_kv."""
    b, n_new, hkv, d = k.shape
    if n_new == 0 or b == 0 or hkv == 0:
        return
    tensors = (k, v, k_cache, v_cache)
    if not (k.is_cuda or triton_interpreter()) or any(t.stride(-1) != 1 for t in tensors):
        append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
        return
    dv = v.shape[3]
    lens = cache_seqlens.contiguous()
    paged = block_table is not None
    table = block_table if paged else lens
    if paged:
        page_size, capacity = k_cache.shape[1], block_table.shape[1] * k_cache.shape[1]
    else:
        page_size, capacity = 0, k_cache.shape[1]
    launch(_append_kv, (b * n_new, hkv), (
        k, v, k_cache, v_cache, lens, table, *k.stride()[:3], *v.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3], table.stride(0), n_new, page_size,
        k_cache.shape[0], capacity,
    ), dict(
        HEAD_DIM=d, HEAD_DIM_V=dv, D_PAD=next_power_of_2(d),
        DV_PAD=next_power_of_2(dv), PAGED=paged, num_warps=1,
    ))  # fmt: skip
