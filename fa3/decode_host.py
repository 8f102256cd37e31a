"""Host side of fa3's KV-cache decode (decode.Fa3Decode): what it takes, the split count, the
launch and the combine.

The new k, v are appended into the cache first (common.append_kernel.append, shared with
fa2); the kernel then reads each row's first cache_seqlens[b] + Nnew keys. With one split
it writes out and lse itself; with more, each split writes its fp32 partial O and LSE, merged
into out and lse by the last split of each tile inside the kernel
(decode_configs.DECODE_FUSED_COMBINE, on) or else by the shared Triton combine
(common.split_combine).
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch

from flashsuite.common.append_kernel import append
from flashsuite.common.arch import cuda_stream_capturing
from flashsuite.common.split_combine import combine_splits, split_count
from flashsuite.common.validation import KVCacheParams
from flashsuite.fa3 import decode_configs
from flashsuite.fa3.configs import DTYPES, Fa3Config
from flashsuite.fa3.decode_configs import (
    DECODE_CTAS_PER_SM,
    DECODE_MAX_SPLITS,
    DECODE_MIN_BLOCKS_PER_SPLIT,
    DECODE_TILE_M,
    decode_can_implement,
    decode_config,
)

H100_SMS = 132  # the split heuristic's SM count where there is no GPU (planning, tests)
_MAX_GRID_YZ = 65_535


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def num_splits_heuristic(tiles: int, key_blocks: int, num_sms: int) -> int:
    """Split count for `tiles` = B · Hkv · m_blocks CTAs over rows of `key_blocks` key tiles:
    enough CTAs for DECODE_CTAS_PER_SM per SM (one: a CTA's K/V rings fill shared memory, and
    its STAGES tiles in flight are what keeps HBM busy), no split shorter than
    DECODE_MIN_BLOCKS_PER_SPLIT tiles (common.split_combine.split_count)."""
    return split_count(
        tiles, key_blocks, DECODE_CTAS_PER_SM * num_sms, DECODE_MIN_BLOCKS_PER_SPLIT,
        DECODE_MAX_SPLITS,
    )  # fmt: skip


class DecodePlan(NamedTuple):
    cfg: Fa3Config  # the tiles and stages
    m_blocks: int  # 64-row tiles of packed (token, head) rows per (batch, kv head)
    splits: int
    ctas_per_sm: int  # 2: the two-CTA build
    page_box: int  # paged: keys per TMA box when a stage spans pages (0: one box a stage)


def _tiles(head_dim: int, page_size: int, ctas_per_sm: int) -> tuple[Fa3Config | None, int]:
    """(config, page_box) for a cache of page_size-token pages (0: contiguous), with
    decode_configs.DECODE_LOOP_MASK_TEST's loop_mask_test. With
    decode_configs.DECODE_PAGED_BOXES a paged cache keeps the contiguous cache's key tiles, each
    stage loaded as tile_n / page_box boxes of page_box keys (the largest multiple of 16 dividing
    both); otherwise its tiles are cut to a size that divides the page."""
    if page_size and decode_configs.DECODE_PAGED_BOXES:
        cfg = decode_config(head_dim, 0, ctas_per_sm, decode_configs.DECODE_LOOP_MASK_TEST)
        if cfg is None:
            return None, 0
        box = next(
            n for n in range(cfg.tile_n, 0, -16) if page_size % n == 0 and cfg.tile_n % n == 0
        )
        return cfg, (0 if box == cfg.tile_n else box)
    return decode_config(head_dim, page_size, ctas_per_sm, decode_configs.DECODE_LOOP_MASK_TEST), 0


def plan(kp: KVCacheParams, num_sms: int) -> DecodePlan:
    """The DecodePlan of problem `kp` on a GPU with num_sms SMs: num_splits = 0 takes the
    heuristic, whose key-block count comes from the cache capacity (no device-to-host copy of
    the lengths; each row divides its own length among the splits). A call of one split with
    at least decode_configs.DECODE_TWO_CTAS_MIN_TILES tiles, at a head dim of
    decode_configs.DECODE_TWO_CTAS_HEAD_DIMS, runs the build two CTAs of which share an SM; so
    does a split call whose one-CTA plan would leave more than half the SMs idle
    (decode_configs.DECODE_TWO_CTAS_SPLITS), its split count aimed at two CTAs per SM."""
    p = kp.attn
    cfg, box = _tiles(p.head_dim, kp.page_size, 1)
    m_blocks = math.ceil(p.seqlen_q * p.group_size / DECODE_TILE_M)
    tiles = p.batch * p.heads_kv * m_blocks
    splits = kp.num_splits or num_splits_heuristic(
        tiles, math.ceil(p.seqlen_k / cfg.tile_n), num_sms
    )
    splits = max(1, min(splits, DECODE_MAX_SPLITS))
    if (
        splits > 1
        and decode_configs.DECODE_TWO_CTAS_SPLITS
        and tiles * splits < decode_configs.DECODE_TWO_CTAS_SPLITS_FILL * num_sms
        and p.head_dim in decode_configs.DECODE_TWO_CTAS_HEAD_DIMS
    ):
        two, two_box = _tiles(p.head_dim, kp.page_size, 2)
        if two is not None:
            two_splits = kp.num_splits or split_count(
                tiles, math.ceil(p.seqlen_k / two.tile_n), 2 * num_sms,
                DECODE_MIN_BLOCKS_PER_SPLIT, DECODE_MAX_SPLITS,
            )  # fmt: skip
            return DecodePlan(two, m_blocks, max(1, min(two_splits, DECODE_MAX_SPLITS)), 2, two_box)
    least = decode_configs.DECODE_TWO_CTAS_MIN_TILES
    if (
        splits == 1
        and least is not None
        and tiles >= least
        and p.head_dim in decode_configs.DECODE_TWO_CTAS_HEAD_DIMS
    ):
        two, two_box = _tiles(p.head_dim, kp.page_size, 2)
        if two is not None:
            return DecodePlan(two, m_blocks, 1, 2, two_box)
    return DecodePlan(cfg, m_blocks, splits, 1, box)


def supports(kp: KVCacheParams) -> tuple[bool, str]:
    """What the decode kernel takes beyond fa3's dense limits (checked by the caller)."""
    p = kp.attn
    if p.dtype not in DTYPES:
        return False, f"fa3 kvcache: dtype {_dt(p.dtype)} not in (float16, bfloat16)"
    if p.seqlen_k >= 2**29:
        # The ragged K/V views address a page's tokens below 2^30 (decode.kv_view).
        return False, f"fa3 kvcache: cache capacity {p.seqlen_k} must be < 2^29 tokens per row"
    cfg, m_blocks = plan(kp, H100_SMS)[:2]
    if p.heads_kv * m_blocks > _MAX_GRID_YZ:
        return False, f"fa3 kvcache: Hkv x m_blocks = {p.heads_kv * m_blocks} > {_MAX_GRID_YZ}"
    rows = p.batch * p.seqlen_q * p.heads_q
    if rows * DECODE_MAX_SPLITS * p.head_dim >= 2**31:
        return False, "fa3 kvcache: B x Nq x Hq x D x 128 splits must be < 2^31 (32-bit offsets)"
    ok, reason = decode_can_implement(cfg, p.head_dim, p.dtype)
    if not ok:
        return False, reason
    how = f"paged, {kp.page_size}-token pages" if kp.paged else "contiguous cache"
    return True, (
        f"fa3: split-KV decode with GQA packing ({DECODE_TILE_M} packed rows x {cfg.tile_n} "
        f"keys, {cfg.stages} TMA stages), {how}"
    )


# (device index, raw stream) -> int32 zeros: the fused combine's per-tile split counters. The
# kernel sets each counter back to 0 when its tile is merged, so one buffer serves every later
# launch on the same stream (launches on one stream run in order).
_counters: dict[tuple, torch.Tensor] = {}

# Counters for calls captured into CUDA graphs: per device, a buffer zeroed once, outside any
# capture (at the first split call that is not captured), and handed out in disjoint slices, one
# per captured call. A graph's kernel leaves its slice zeroed like any launch, so the slice is
# zero at every replay and the graph needs no memset node (a node costs about 1.5 us of a
# replay: B 1, 4k keys on the H200, 17.4 against 15.9 us). Slices are never taken back (a
# graph may be replayed as long as it lives), and disjoint slices keep graphs replayed on
# different streams apart. A split call has fewer tiles than the SMs' CTA target (one counter
# per tile: under 132 on an H100 / H200 unless num_splits is forced; the forward's tile counter
# takes 2, interface._tile_counters), so the pool's 2^18 counters (1 MB) last for about 2,000
# captured split calls; past them, or when a call is captured before any eager split call on
# its device, the call gets a fresh buffer that the graph zeroes itself (a memset node).
CAPTURE_POOL_COUNTERS = 1 << 18
_capture_pool: dict[torch.device, list] = {}  # device -> [buffer, counters handed out]
_capture_lock = threading.Lock()


def _ensure_capture_pool(device: torch.device) -> None:
    """Allocate and zero `device`'s capture pool (never while a graph is being captured)."""
    if device not in _capture_pool:
        buf = torch.zeros(CAPTURE_POOL_COUNTERS, dtype=torch.int32, device=device)
        if device.type == "cuda":  # the zeros land before a graph on any stream reads them
            torch.cuda.current_stream(device).synchronize()
        _capture_pool[device] = [buf, 0]


def _captured_counters(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int32 zeros for one captured call: a slice of the capture pool no other call gets,
    or a fresh buffer (zeroed by the graph at each replay) when the pool is absent or spent."""
    with _capture_lock:
        pool = _capture_pool.get(device)
        if pool is not None and pool[1] + n <= pool[0].numel():
            start = pool[1]
            pool[1] = start + n
            return pool[0][start : start + n]
    return _zeros(n, device)


def split_counters(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int32 zeros for the fused combine's counters on the current stream: a view of a
    cached buffer, a slice of the capture pool where the call is captured into a CUDA graph, or
    a fresh buffer where the device is not a GPU. A repeat call (same device, stream and n:
    every decode step, every forward of a tile-counter build) costs two calls into torch's C
    API and a dict lookup."""
    if device.type != "cuda":
        return _zeros(n, device)
    if cuda_stream_capturing():
        return _captured_counters(n, device)
    key = (*_stream_key(device), n)
    view = _counter_views.get(key)
    return view if view is not None else _new_counter_view(key, device)


# (device index, raw stream, n) -> the (n,) view of that stream's buffer that split_counters
# hands out (the view object made once, not a slice per call).
_counter_views: dict[tuple, torch.Tensor] = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


def _raw_stream(index: int) -> int:
    """The handle of device `index`'s current CUDA stream (no torch.cuda.Stream object)."""
    return torch._C._cuda_getCurrentRawStream(index)


def _stream_key(device: torch.device) -> tuple[int, int]:
    """(device index, raw handle of its current stream) of a CUDA device: what the per-stream
    buffers below are keyed by."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, _raw_stream(index)


def _stream_buffer(bufs: dict, views: dict, stream: tuple, size: int, make) -> torch.Tensor:
    """`bufs`' buffer for `stream` (a key's first two fields) of at least `size` elements:
    made by make() where absent or too small, and then the views in `views` of the buffer it
    replaces are dropped, not handed out again (launches already queued keep their own)."""
    buf = bufs.get(stream)
    if buf is None or buf.numel() < size:
        buf = bufs[stream] = make()
        for stale in [k for k in list(views) if k[:2] == stream]:
            views.pop(stale, None)  # list(): a copy taken at once, safe beside threads
    return buf


def _new_counter_view(key: tuple, device: torch.device) -> torch.Tensor:
    """split_counters' view for `key` = (device index, stream, n), made on a first call: the
    capture pool set up, the stream's buffer made or grown (views of a buffer it replaces are
    dropped; launches already queued keep their own)."""
    n = key[2]
    _ensure_capture_pool(device)
    make = lambda: _zeros(max(n, 1024), device)
    buf = _stream_buffer(_counters, _counter_views, key[:2], n, make)
    view = _counter_views[key] = buf[:n]
    return view


# (device index, raw stream, n, d) -> the (o_part (n, d), lse_part (n,)) views of that stream's
# scratch buffer that fused split calls take their partials in (`split_partials`); CPU devices
# key by the device, with no stream.
_partial_views: dict[tuple, tuple] = {}
_partial_bufs: dict[tuple, torch.Tensor] = {}  # (device index, raw stream) -> float32 buffer
PARTIALS_CACHE_BYTES = 16 << 20  # larger partials are allocated per call, not kept
PARTIALS_STREAMS = 8  # buffers kept at once (a new stream past them drops the others)


def split_partials(n: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (n, d) and (n,) for a fused split call's partial O and LSE (n = splits x rows):
    views of one scratch buffer per stream, made once per (stream, n, d), where a call
    allocated both each time (two allocations a decode step and layer). The kernel that
    writes them merges them itself (DECODE_FUSED_COMBINE) before the stream's next launch
    starts, so consecutive calls on a stream can share them. Fresh tensors under CUDA-graph
    capture (the graph keeps its own) and past PARTIALS_CACHE_BYTES (not held for good); at
    most PARTIALS_STREAMS buffers kept."""
    if 4 * n * (d + 1) > PARTIALS_CACHE_BYTES or (
        device.type == "cuda" and cuda_stream_capturing()
    ):
        buf = _scratch(n * (d + 1), device)
        return buf[: n * d].view(n, d), buf[n * d :]
    key = (*_stream_key(device), n, d) if device.type == "cuda" else (device, None, n, d)
    views = _partial_views.get(key)
    return views if views is not None else _new_partial_views(key, device)


def _new_partial_views(key: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """split_partials' views for `key` = (device, stream, n, d), made on a first call: the
    stream's buffer made or grown (views of a buffer it replaces are dropped; launches already
    queued keep their own). lse_part starts n * d floats in: 128-byte aligned at every head
    dim (d * 4 is a multiple of 128)."""
    n, d = key[2:]
    size = n * (d + 1)
    if key[:2] not in _partial_bufs and len(_partial_bufs) >= PARTIALS_STREAMS:
        _partial_bufs.clear()  # many streams: start over (each buffer's blocks go back to its
        _partial_views.clear()  # own stream's pool)
    make = lambda: _scratch(size, device)
    buf = _stream_buffer(_partial_bufs, _partial_views, key[:2], size, make)
    views = _partial_views[key] = (buf[: n * d].view(n, d), buf[n * d : size])
    return views


def _scratch(size: int, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=torch.float32, device=device)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` (4-D, last dim contiguous) with a 16-byte-aligned base and outer strides, as the
    kernel's 16-byte Q loads and the cache's TMA views need: itself in the common case, else a
    contiguous copy (exact, read-only use)."""
    e, (s0, s1, s2, s3) = 16 // t.element_size(), t.stride()  # one stride call, no generator
    if s3 == 1 and not (t.data_ptr() % 16 or s0 % e or s1 % e or s2 % e):
        return t
    return t.contiguous()


# (problem, device, the switches plan() reads) -> the launch plan of `launch_plan`.
_launch_plans: dict[tuple, tuple] = {}


def launch_plan(kp: KVCacheParams, device: torch.device) -> tuple:
    """(binary, m_blocks, splits, fused combine, kernel scalars) of problem `kp` on `device`:
    the split plan, the compile key, the binary and the scalars, decided once per problem
    (a decode loop repeats the same one every step)."""
    key = (
        kp, device, decode_configs.DECODE_FUSED_COMBINE, decode_configs.DECODE_TWO_CTAS_MIN_TILES,
        decode_configs.DECODE_TWO_CTAS_HEAD_DIMS, decode_configs.DECODE_PAGED_BOXES,
        decode_configs.DECODE_KV_EVICT_FIRST, decode_configs.DECODE_LOOP_MASK_TEST,
        decode_configs.DECODE_TWO_CTAS_SPLITS, decode_configs.DECODE_TWO_CTAS_SPLITS_FILL,
    )  # fmt: skip
    hit = _launch_plans.get(key)
    if hit is not None:
        return hit
    from flashsuite.fa3.compile import DecodeKey, get_decode, kernel_scalars

    p = kp.attn
    sms = H100_SMS
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    cfg, m_blocks, splits, ctas_per_sm, page_box = plan(kp, sms)
    fused = splits > 1 and decode_configs.DECODE_FUSED_COMBINE
    dkey = DecodeKey(
        dtype=p.dtype, head_dim=p.head_dim, causal=p.causal, local=p.is_local,
        softcap=p.softcap > 0, paged=kp.paged, split=splits > 1, cfg=cfg, fused_combine=fused,
        ctas_per_sm=ctas_per_sm, page_box=page_box,
        kv_evict_first=decode_configs.DECODE_KV_EVICT_FIRST, leftpad=kp.leftpad,
    )  # fmt: skip
    scalars = kernel_scalars(
        p.scale, p.softcap, (p.window_left, p.window_right), p.causal, p.seqlen_q, p.seqlen_k
    )
    hit = (get_decode(dkey), m_blocks, splits, fused, scalars)
    if len(_launch_plans) >= 1024:  # many distinct problems: start over rather than grow
        _launch_plans.clear()
    _launch_plans[key] = hit
    return hit


def kvcache_forward(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp: KVCacheParams, *, out=None,
    lse=None, leftpad=None,
):  # fmt: skip
    """q (B, Nq, Hq, D) against each row's first cache_seqlens[b] + Nnew cache tokens (from
    slot leftpad[b] on, when given: a contiguous cache, kp.leftpad), after writing k, v
    (B, Nnew, Hkv, D) into the cache in place. Returns out (B, Nq, Hq, D) in q's dtype and lse
    (B, Hq, Nq) float32, contiguous. `out` and `lse` (contiguous views into larger buffers, in
    tests that watch the memory around them) are written in place."""
    p = kp.attn
    if k is not None:
        append(k_cache, v_cache, k, v, cache_seqlens, block_table)
    b, nq, hq, d = q.shape
    if out is None:
        out = torch.empty(b, nq, hq, d, dtype=q.dtype, device=q.device)  # (B, Nq, Hq, D)
    if lse is None:
        lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)  # (B, Hq, Nq)
    assert out.is_contiguous() and lse.is_contiguous(), "out and lse must be contiguous"
    if out.numel() == 0:
        return out, lse
    fn, m_blocks, splits, fused, scalars = launch_plan(kp, q.device)
    q, k_cache, v_cache = _aligned(q), _aligned(k_cache), _aligned(v_cache)
    table = block_table.contiguous() if kp.paged else None
    if (leftpad is not None) != kp.leftpad:
        raise ValueError(f"fa3 kvcache: leftpad given: {leftpad is not None}, kp.leftpad: "
                         f"{kp.leftpad}")  # fmt: skip
    # The kernel reads (2B,) with a left padding: the lengths, then each row's first key slot.
    seqlens = cache_seqlens.contiguous() if leftpad is None else torch.cat([cache_seqlens, leftpad])
    if splits == 1:
        fn(q, k_cache, v_cache, out.view(-1, d), lse.view(-1), table, seqlens, None, None, None,
           kp.seqlen_new, 1, *scalars)  # fmt: skip
        return out, lse
    rows = b * nq * hq
    # The partials as the kernel takes them, (S * R, D) and (S * R,): no views per call. A
    # fused call merges them in the same launch, so it takes the stream's scratch views; the
    # Triton combine reads them in a launch of its own, which another thread's call on the
    # stream could precede, so those are the call's own.
    if fused:
        o_part, lse_part = split_partials(splits * rows, d, q.device)
    else:
        o_part = torch.empty(splits * rows, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(splits * rows, dtype=torch.float32, device=q.device)
    final = (None, None, None)
    if fused:  # out, lse and one counter per (batch, kv head, m_block) tile
        final = (out.view(-1, d), lse.view(-1), split_counters(b * p.heads_kv * m_blocks, q.device))
    fn(q, k_cache, v_cache, o_part, lse_part, table, seqlens, *final, kp.seqlen_new, splits,
       *scalars)  # fmt: skip
    if not fused:
        combine_splits(o_part.view(splits, rows, d), lse_part.view(splits, rows), out, lse)
    return out, lse
