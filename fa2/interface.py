"""fa2: FlashAttention-2 in Triton. The version contract of docs/versions.md.

Forward: `kernels._attn_fwd`. Backward: `_bwd_preprocess` (delta), `_bwd_dkdv` (dK, dV summed
over each GQA group in registers) and, by default, `_bwd_dq`, a second pass over Q blocks, so
gradients are bitwise reproducible run to run. A config with `dq_atomic=True` accumulates dQ
with fp32 TMA reduce-adds inside `_bwd_dkdv` instead (sm90+); it is never used while
`torch.are_deterministic_algorithms_enabled()`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from flashsuite.common.arch import device_arch, triton_available, triton_interpreter
from flashsuite.common.kvcache import dense_as_decode, length_tensor
from flashsuite.common.triton_launch import launch, launch_device, run_entry
from flashsuite.common.validation import AttnParams, KVCacheParams, remember

NAME = "fa2"
HAS_BACKWARD = True

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


def available() -> tuple[bool, str]:
    """Triton importable, and a CUDA GPU or the Triton interpreter."""
    return triton_available(NAME)


def supports(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    """Whether fa2 takes problem `p` on `arch` (None = no GPU: only under the interpreter),
    and which kernel runs it (the forward, or the decode kernel by `decode_route`)."""
    ok, reason = _takes(p, arch)
    if ok and decode_route(p) is not None:
        rows = p.seqlen_q * p.group_size
        return True, f"fa2: {rows} packed query rows: split-KV decode, k and v as full rows"
    if not ok or arch is None:
        return ok, reason
    from flashsuite.fa2 import configs

    cfg = configs.config_for(p, arch)
    return True, f"fa2: forward {cfg.block_m}x{cfg.block_n} tiles, {cfg.num_warps} warps"


def _takes(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    """The limits every fa2 entry point shares: dtype, head dims, the architecture."""
    if p.is_fp8:
        return False, f"fa2: dtype {_dt(p.dtype)} not supported (fp8 is fa3 only)"
    if p.dtype not in DTYPES:
        return False, f"fa2: dtype {_dt(p.dtype)} not in (float16, bfloat16, float32)"
    if p.head_dim not in HEAD_DIMS:
        return False, f"fa2: head_dim {p.head_dim} not in {{32, 64, 96, 128, 192, 256}}"
    if p.head_dim_v not in HEAD_DIMS:
        return False, f"fa2: head_dim_v {p.head_dim_v} not in {{32, 64, 96, 128, 192, 256}}"
    if arch is None:
        if not triton_interpreter():
            return False, "fa2: needs a CUDA GPU (sm80+) or TRITON_INTERPRET=1"
    elif arch < 80:
        # bf16 tl.dot needs sm80 in Triton, and the FA2 tiles assume sm80+ shared memory.
        return False, f"fa2: needs sm80+ (got sm{arch}); fa1 covers older GPUs"
    return True, "fa2: ok (Triton interpreter)" if arch is None else f"fa2: ok (sm{arch})"


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pad(d: int, dtype: torch.dtype) -> int:
    """configs.padded_head_dim for this launch (the wgmma floor applies off the interpreter)."""
    from flashsuite.fa2.configs import padded_head_dim

    return padded_head_dim(d, dtype, wgmma=not triton_interpreter())


def _arch(t: torch.Tensor) -> int | None:
    """Config key: None under the interpreter (small tiles), else the device's sm."""
    if triton_interpreter() or t.device.type != "cuda":
        return None
    return device_arch(t.device) or 90


def _tma_dq_ok(q: torch.Tensor, rows: int) -> bool:
    """dQ through TMA reduce-adds: not under torch.use_deterministic_algorithms (the order of
    the fp32 adds varies run to run), sm90+ only (TMA; triton 3.6's interpreter has no
    descriptor reduce either), and int32 TMA row coordinates."""
    if torch.are_deterministic_algorithms_enabled() or rows >= 2**31 or triton_interpreter():
        return False
    return q.is_cuda and (device_arch(q.device) or 0) >= 90


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _common(p: AttnParams) -> dict:
    """Scalar arguments and constexprs shared by every kernel of one problem."""
    softcap = p.softcap > 0
    qk_scale = p.scale / p.softcap if softcap else p.scale * LOG2E
    return dict(
        seqlen_q=p.seqlen_q,
        seqlen_k=p.seqlen_k,
        group=p.group_size,
        shift=p.shift,
        window_left=max(p.window_left, 0),
        window_right=max(p.window_right, 0),
        qk_scale=qk_scale,
        softcap_log2=p.softcap * LOG2E if softcap else 1.0,
        HAS_LEFT=p.window_left >= 0,
        HAS_RIGHT=p.window_right >= 0,
        SOFTCAP=softcap,
        HEAD_DIM=p.head_dim,
        HEAD_DIM_V=p.head_dim_v,
        D_PAD=_pad(p.head_dim, p.dtype),
        DV_PAD=_pad(p.head_dim_v, p.dtype),
        DOT_PRECISION="ieee" if p.dtype == torch.float32 else "tf32",
    )


# Dense 16-bit problems of few query rows run on fa2's split-KV decode kernel (`decode_route`):
# a decode step or a short chunk against a long K/V that arrives through `attention`,
# flash_attn_func or the SDPA plug-in rather than through attention_with_kvcache. The forward
# kernel's tiles hold Nq of their rows per (batch, query head), read K/V once per query head and
# stream every key in one program; the decode kernel packs a K/V head's query heads into one
# tile (K/V read once) and splits long keys over the SMs. k and v are read as the cache (every
# row full), so out and the LSE are the forward's within rounding (another split of the keys).
# The policy and limits are fa3's (common.kvcache.dense_as_decode; fa3.interface's), where the
# same two kernels' shapes were timed: at most DECODE_ROUTE_MAX_NQ queries and
# DECODE_ROUTE_MAX_ROWS packed rows (one 64-row tile), and without GQA fewer than
# DECODE_ROUTE_MHA_MAX_CTAS (batch x heads) tiles. fa2's own A/B is
# `benchmarks/decode_route_ab.py --version fa2` (not run on a GPU yet; docs/inference.md).
# DECODE_ROUTE_MAX_ROWS = 0 turns the route off.
DECODE_ROUTE_MAX_ROWS = 64
DECODE_ROUTE_MAX_NQ = 16
DECODE_ROUTE_MHA_MAX_CTAS = 64
_routes: dict[tuple, KVCacheParams | None] = {}


def decode_route(p: AttnParams) -> KVCacheParams | None:
    """The KV-cache problem (k, v as a full contiguous cache of seqlen_k tokens a row) that
    `forward` runs dense problem `p` as, or None where the forward kernel runs it: not fp16 /
    bf16, Dv != D, no keys, more than DECODE_ROUTE_MAX_NQ queries or DECODE_ROUTE_MAX_ROWS
    packed rows, or no GQA and at least DECODE_ROUTE_MHA_MAX_CTAS (batch x heads) tiles.
    Memoised per problem and limits."""
    limits = (DECODE_ROUTE_MAX_ROWS, DECODE_ROUTE_MAX_NQ, DECODE_ROUTE_MHA_MAX_CTAS)
    key = (p, limits)
    if key in _routes:
        return _routes[key]
    kp = dense_as_decode(p, *limits)
    if len(_routes) >= 1024:  # many distinct problems: start over rather than grow
        _routes.clear()
    _routes[key] = kp
    return kp


def _decode_forward(q, k, v, kp: KVCacheParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward` of a problem `decode_route` sends to the split-KV decode kernel: out
    (B, Nq, Hq, D) and lse (B, Hq, Nq), contiguous."""
    lens = length_tensor(kp.attn.batch, kp.attn.seqlen_k, q.device)
    return kvcache_forward(q, _last_contig(k), _last_contig(v), None, None, lens, None, kp)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: AttnParams,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv), fp16/bf16/fp32, any strides with
    a contiguous last dim. Returns out (B, Nq, Hq, Dv) in q's dtype and lse (B, Hq, Nq) fp32
    (natural log, -inf for rows that see no key), both contiguous. `config` overrides the
    table (tuning only)."""
    from flashsuite.fa2 import kernels

    if descale_q is not None or descale_k is not None or descale_v is not None:
        raise ValueError("fa2: descale factors are for fp8 inputs, which fa2 does not take")
    if config is None and (kp := decode_route(p)) is not None:
        return _decode_forward(q, k, v, kp)
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    b, nq, hq, _ = q.shape
    out = torch.empty(b, nq, hq, p.head_dim_v, dtype=p.out_dtype, device=q.device)  # (B,Nq,Hq,Dv)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)  # (B, Hq, Nq)
    if out.numel() == 0 or p.seqlen_k == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    grid, kwargs, token = _fwd_plan(p, config, _arch(q))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
    args = (q, k, v, out, lse, *strides, *lse.stride()[:2])
    launch(kernels._attn_fwd, grid, args, kwargs, plan=token)
    return out, lse


def bind_forward(p: AttnParams, need_lse: bool = True):
    """`forward(q, k, v, p)` as a function of (q, k, v) alone, for callers that run one problem
    many times (dispatch's memoised plans): the launch plan (grid, keyword arguments, token) is
    found on the first call and kept. None for empty problems, which `forward` fills itself.
    Without `need_lse` the function returns (out, None): the kernel build that stores no LSE
    runs, and nothing is allocated for it."""
    from flashsuite.fa2 import kernels

    if p.seqlen_k == 0 or 0 in (p.batch, p.seqlen_q, p.heads_q, p.head_dim_v):
        return None
    if (kp := decode_route(p)) is not None:
        if need_lse:
            return lambda q, k, v: _decode_forward(q, k, v, kp)
        return lambda q, k, v: (_decode_forward(q, k, v, kp)[0], None)
    kernel, dtype, f32 = kernels._attn_fwd, p.out_dtype, torch.float32
    out_shape = (p.batch, p.seqlen_q, p.heads_q, p.head_dim_v)  # (B, Nq, Hq, Dv)
    lse_shape = (p.batch, p.heads_q, p.seqlen_q)  # (B, Hq, Nq)
    # Both outputs are new contiguous tensors: their strides follow from the shapes.
    out_strides = (out_shape[1] * out_shape[2] * out_shape[3], out_shape[2] * out_shape[3],
                   out_shape[3], lse_shape[1] * lse_shape[2], lse_shape[2])  # fmt: skip
    plan = None
    # (memo entry, device, q / k / v strides) of a launch with every pointer 16-byte aligned:
    # a call that matches it in those has the same memo key (the dtypes, the plan's keywords
    # and the outputs' strides are the plan's), so it launches the entry without building the
    # key (common.triton_launch.launch's per-argument pass).
    fast = None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        nonlocal plan, fast
        if plan is None:
            plan = _fwd_plan(p, None, _arch(q), need_lse)
        grid, kwargs, token = plan
        qs, ks, vs = q.stride(), k.stride(), v.stride()
        if qs[3] != 1 or ks[3] != 1 or vs[3] != 1:  # _last_contig's copy, rarely needed
            q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
            qs, ks, vs = q.stride(), k.stride(), v.stride()
        # Sizes as separate ints: torch.empty parses them faster than one tuple.
        out = torch.empty(*out_shape, dtype=dtype, device=q.device)
        # Without need_lse the kernel's Lse argument is `out`, never written through.
        lse = torch.empty(*lse_shape, dtype=f32, device=q.device) if need_lse else None
        args = (q, k, v, out, out if lse is None else lse, *qs[:3], *ks[:3], *vs[:3], *out_strides)
        ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()
        aligned = (ptrs if lse is None else ptrs | lse.data_ptr()) & 15 == 0
        if (
            fast is not None
            and aligned
            and fast[2:] == (qs, ks, vs)
            and fast[1] == launch_device(q)
            and not triton_interpreter()
        ):
            run_entry(fast[0], grid, fast[1], args)
        else:
            entry = launch(kernel, grid, args, kwargs, plan=token)
            if entry is not None and aligned:
                fast = (entry, launch_device(q), qs, ks, vs)
        return out, lse

    return run


# (problem, config override, arch, interpreter, LSE stored) -> (grid, scalar and constexpr
# kwargs, the plan's token for common.triton_launch): the config lookup, padding and scalar
# arithmetic of the forward, once per static problem.
_fwd_plans: dict[tuple, tuple] = {}


def _fwd_plan(
    p: AttnParams, config, arch: int | None, store_lse: bool = True
) -> tuple[tuple, dict, object]:
    key = (p, config, arch, triton_interpreter(), store_lse)
    plan = _fwd_plans.get(key)
    if plan is None:
        from flashsuite.fa2 import configs

        cfg = config or configs.config_for(p, arch)
        grid = (math.ceil(p.seqlen_q / cfg.block_m), p.heads_q, p.batch)
        kwargs = dict(
            **_common(p),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            STORE_LSE=store_lse,
        )
        if len(_fwd_plans) >= 4096:  # many distinct shapes: start over rather than grow
            _fwd_plans.clear()
        _fwd_plans[key] = plan = (grid, kwargs, object())
    return plan


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    config=None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute backward. Returns dq, dk, dv (contiguous, the shapes and dtypes of q, k, v;
    dk/dv summed over each GQA group). `dlse` (B, Hq, Nq) float32, the gradient reaching the
    LSE (None: 0), is taken off the preprocess's delta. Rows with lse == -inf contribute
    nothing. Bitwise deterministic unless the config asks for dQ atomics (TMA reduce-adds,
    sm90+; never under torch.use_deterministic_algorithms: the separate dQ pass runs
    instead)."""
    from flashsuite.fa2 import configs, kernels

    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    out, dout = _last_contig(out), _last_contig(dout)
    b, nq, hq, d = q.shape
    _, nk, hkv, dv_ = v.shape
    dq = torch.empty(b, nq, hq, d, dtype=q.dtype, device=q.device)  # (B, Nq, Hq, D)
    dk = torch.empty(b, nk, hkv, d, dtype=k.dtype, device=q.device)  # (B, Nk, Hkv, D)
    dv = torch.empty(b, nk, hkv, dv_, dtype=v.dtype, device=q.device)  # (B, Nk, Hkv, Dv)
    if nq == 0 or nk == 0 or b == 0 or hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    cfg = config or configs.bwd_config_for(p, _arch(q))
    common = _common(p)
    dv_pad = common["DV_PAD"]

    # delta and lse2 padded to whole blocks so the main kernels load them without masks.
    pad = configs.ROW_PAD * math.ceil(nq / configs.ROW_PAD)
    # The reduce-add dQ path is only right without masking: on the H200 its causal variant
    # (16x64 s1) gave max error 31 against SDPA (2026-11-29) while non-causal ones matched.
    # Until that is found, masked problems always take the deterministic dQ pass.
    masked = p.causal or p.is_local
    if cfg.dq_atomic and (masked or not _tma_dq_ok(q, b * hq * pad)):
        cfg = replace(cfg, dq_atomic=False)
    delta = torch.empty(b, hq, pad, dtype=torch.float32, device=q.device)  # (B, Hq, Nq_pad)
    lse2 = torch.empty(b, hq, pad, dtype=torch.float32, device=q.device)  # (B, Hq, Nq_pad)
    bm = configs.PREPROCESS_BLOCK_M
    # Every parameter given (the accumulator's zeroing off): a launch that leaves one to its
    # default is not memoised (common.triton_launch) and pays Triton's launcher on every call.
    launch(kernels._bwd_preprocess, (pad // bm, hq, b), (
        out, dout, lse, delta, lse2, *out.stride()[:3], *dout.stride()[:3], *lse.stride(),
        nq, pad, hq,
    ), dict(
        HEAD_DIM_V=p.head_dim_v, DV_PAD=dv_pad, BLOCK_M=bm, DqAcc=None, ZERO_D=0, ZERO_PAD=1,
    ))  # fmt: skip
    if dlse is not None:  # D = rowsum(dO ∘ O) - dlse: d lse_i / d s_ij = P_ij
        delta[:, :, :nq] -= dlse

    dq_arg, dq_strides = dq, (dq.stride(0), dq.stride(2), dq.stride(1))  # unused w/o DQ_ATOMIC
    if cfg.dq_atomic:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # Rows padded per (b, h) like lse2, so a tile never reaches the next head's rows.
        dq_acc = torch.zeros(b, hq, pad, d, dtype=torch.float32, device=q.device)  # (B,Hq,Np,D)
        dq_arg = TensorDescriptor(
            dq_acc.view(b * hq * pad, d),
            shape=[b * hq * pad, d],
            strides=[d, 1],
            block_shape=[cfg.block_m1, common["D_PAD"]],
        )
        dq_strides = dq_acc.stride()[:3]  # (b, h, n)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    for _, want_dk, want_dv in configs.dkdv_launches(cfg):  # one launch, or dV then dK
        launch(kernels._bwd_dkdv, (math.ceil(nk / cfg.block_n1), hkv, b), (
            q, k, v, dout, lse2, delta, dk, dv, dq_arg,
            *strides, *dk.stride()[:3], *dv.stride()[:3], *dq_strides,
        ), dict(
            seqlen_pad=pad, num_heads=hq, scale=p.scale, DQ_ATOMIC=cfg.dq_atomic and want_dk,
            **common, TAIL_STAGES=None if cfg.tail_pipelined else 1,
            BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1, WANT_DK=want_dk, WANT_DV=want_dv,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ))  # fmt: skip
    if cfg.dq_atomic:
        dq.copy_(dq_acc[:, :, :nq].transpose(1, 2))
    else:
        launch(kernels._bwd_dq, (math.ceil(nq / cfg.block_m2), hq, b), (
            q, k, v, dout, lse2, delta, dq, *strides, *dq.stride()[:3],
        ), dict(
            seqlen_pad=pad, num_heads=hq, scale=p.scale, **common,
            BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2,
            num_warps=cfg.num_warps_dq, num_stages=cfg.num_stages_dq,
        ))  # fmt: skip
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Inference entry points (docs/inference.md): packed sequences and KV-cache decode
# ----------------------------------------------------------------------------------------------


def supports_varlen(vp, arch: int | None) -> tuple[bool, str]:
    """Packed sequences: the dense limits (dtype, head dims, arch) apply."""
    ok, reason = _takes(vp.attn, arch)
    if not ok or arch is None:
        return ok, reason
    from flashsuite.fa2 import configs

    p = vp.attn
    cfg = configs.varlen_fwd_config(max(p.head_dim, p.head_dim_v), p.dtype, p.causal, arch)
    return True, f"fa2: varlen, per-sequence {cfg.block_m}x{cfg.block_n} tiles"


def supports_kvcache(kp, arch: int | None) -> tuple[bool, str]:
    """KV cache: the dense limits apply; paged pages of 16..256 tokens (validated upstream); a
    float8_e4m3fn cache on sm89+ (Triton's e4m3 conversion) or under the interpreter."""
    ok, reason = _takes(kp.attn, arch)
    if not ok:
        return ok, reason
    if kp.fp8_cache and arch is not None and arch < 89:
        return False, f"fa2: a float8_e4m3fn cache needs sm89+ (e4m3 conversion), got sm{arch}"
    how = f"paged, {kp.page_size}-token pages" if kp.paged else "contiguous cache"
    if kp.fp8_cache:
        how += ", float8_e4m3fn converted as loaded"
    return True, f"fa2: split-KV decode with GQA packing, {how}"


def _num_sms(t: torch.Tensor) -> int:
    from flashsuite.fa2 import decode

    if t.is_cuda and not triton_interpreter():
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    return decode.H100_SMS


def kvcache_forward(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp, *, leftpad=None, descales=None
):
    """q (B, Nq, Hq, D) against each row's first cache_seqlens[b] + Nnew cache tokens (from
    slot leftpad[b] on, when given: a contiguous cache), after writing k, v (B, Nnew, Hkv, D)
    into the cache in place (common.append_kernel.append). Returns out (B, Nq, Hq, Dv) in q's
    dtype and lse (B, Hq, Nq) fp32, contiguous. A float8 cache (kp.fp8_cache) takes
    `descales` = (descale_k, descale_v), each None (1) or float32 (B, Hkv)."""
    from flashsuite.common.append_kernel import append
    from flashsuite.fa2 import decode

    p = kp.attn
    if k is not None:
        append(k_cache, v_cache, k, v, cache_seqlens, block_table)
    q = _last_contig(q)
    b, nq, hq, _ = q.shape
    out = torch.empty(b, nq, hq, p.head_dim_v, dtype=q.dtype, device=q.device)  # (B,Nq,Hq,Dv)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)  # (B, Hq, Nq)
    if out.numel() == 0:
        return out, lse
    rows = nq * p.group_size
    cfg = decode.decode_config(rows, max(p.head_dim, p.head_dim_v), _arch(q) is None)
    m_blocks = math.ceil(rows / cfg.block_m)
    tiles = b * p.heads_kv * m_blocks
    splits = kp.num_splits or decode.num_splits_heuristic(
        tiles, math.ceil(p.seqlen_k / cfg.block_n), _num_sms(q)
    )
    splits = max(1, min(splits, decode.MAX_SPLITS))
    o_part = lse_part = lse  # unused with one split
    if splits > 1:
        o_part = torch.empty(splits, b * nq * hq, p.head_dim_v, dtype=torch.float32,
                             device=q.device)  # fmt: skip  # (S, B*Nq*Hq, Dv)
        lse_part = torch.empty(splits, b * nq * hq, dtype=torch.float32, device=q.device)
    table = block_table if block_table is not None else cache_seqlens  # unused when contiguous
    common = _common(p)
    pads = cache_seqlens if leftpad is None else leftpad.contiguous()  # unused without leftpad
    dk, dv = descales if kp.fp8_cache and descales is not None else (None, None)
    dk, dv = (lse if t is None else t.contiguous() for t in (dk, dv))  # lse: an unread stand-in
    launch(decode._decode_split, (splits, p.heads_kv * m_blocks, b), (
        q, k_cache, v_cache, table, cache_seqlens, pads, dk, dv, out, lse, o_part, lse_part,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        table.stride(0), *out.stride()[:3], *lse.stride()[:2],
        kp.seqlen_new, nq, hq, p.group_size, m_blocks, splits, max(kp.page_size, 1),
        common["window_left"], common["window_right"], common["qk_scale"],
        common["softcap_log2"],
    ), dict(
        SPLIT=splits > 1, PAGED=kp.paged,
        PAGE_PER_TILE=kp.paged and kp.page_size % cfg.block_n == 0, LEFTPAD=leftpad is not None,
        KV_FP8=kp.fp8_cache, DESCALE_K=dk is not lse, DESCALE_V=dv is not lse,
        HAS_LEFT=common["HAS_LEFT"], HAS_RIGHT=common["HAS_RIGHT"], SOFTCAP=common["SOFTCAP"],
        HEAD_DIM=p.head_dim, HEAD_DIM_V=p.head_dim_v, D_PAD=common["D_PAD"],
        DV_PAD=common["DV_PAD"], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_PRECISION=common["DOT_PRECISION"], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    ))  # fmt: skip
    if splits > 1:
        block_r = 16
        launch(
            decode._combine, (math.ceil(b * nq * hq / block_r),),
            (o_part, lse_part, out, lse, b * nq * hq, nq, hq, splits),
            dict(HEAD_DIM_V=p.head_dim_v, DV_PAD=common["DV_PAD"], BLOCK_R=block_r, num_warps=4),
        )  # fmt: skip
    return out, lse


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, vp):
    """q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) packed by cu_seqlens.
    Returns out (total_q, Hq, Dv) in q's dtype and lse (Hq, total_q) fp32, contiguous."""
    from flashsuite.fa2 import varlen

    p = vp.attn
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    out = torch.zeros(vp.total_q, p.heads_q, p.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.full((p.heads_q, vp.total_q), float("-inf"), dtype=torch.float32, device=q.device)
    if vp.total_q == 0 or vp.total_k == 0 or p.seqlen_q == 0:
        return out, lse
    grid, kwargs, token = _varlen_plan(vp, _arch(q), None)["fwd"]
    launch(varlen._varlen_fwd, grid, (
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2], lse.stride(0),
    ), kwargs, plan=token)  # fmt: skip
    return out, lse


# (packed problem, arch, interpreter, backward config) -> the varlen launches' (grid, keyword
# arguments, plan token): what a model's layers repeat within a step (common.triton_launch
# then keys each launch on its positional arguments and the token).
_varlen_plans: dict[tuple, dict] = {}


def _varlen_plan(vp, arch: int | None, config) -> dict:
    """The launch plans of `varlen_forward` ("fwd") and `varlen_backward` ("pre", "dkdv": one
    per dkdv launch, "dq"), with the backward's config ("cfg") and padded rows ("row_pad")."""
    key = (vp, arch, triton_interpreter(), config)
    plan = _varlen_plans.get(key)
    if plan is not None:
        return plan
    from flashsuite.fa2 import configs

    p = vp.attn
    d = max(p.head_dim, p.head_dim_v)
    common = _common(p)
    for name in ("seqlen_q", "seqlen_k", "shift"):
        del common[name]
    f = configs.varlen_fwd_config(d, p.dtype, p.causal, arch)
    plan = {"fwd": (
        (math.ceil(p.seqlen_q / f.block_m), p.heads_q, p.batch),
        dict(**common, BLOCK_M=f.block_m, BLOCK_N=f.block_n, num_warps=f.num_warps,
             num_stages=f.num_stages),
        object(),
    )}  # fmt: skip
    if p.seqlen_k > 0:
        cfg = config or configs.varlen_bwd_config(d, p.dtype, p.causal, arch)
        bm = configs.PREPROCESS_BLOCK_M
        plan["cfg"], plan["row_pad"] = cfg, configs.ROW_PAD
        plan["pre"] = (
            (math.ceil(p.seqlen_q / bm), p.heads_q, p.batch),
            dict(HEAD_DIM_V=p.head_dim_v, DV_PAD=common["DV_PAD"], BLOCK_M=bm),
            object(),
        )
        plan["dkdv"] = [(
            (math.ceil(p.seqlen_k / cfg.block_n1), p.heads_kv, p.batch),
            dict(**common, scale=p.scale, TAIL_STAGES=None if cfg.tail_pipelined else 1,
                 BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1, WANT_DK=want_dk, WANT_DV=want_dv,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            object(),
        ) for _, want_dk, want_dv in configs.dkdv_launches(cfg)]  # fmt: skip
        plan["dq"] = (
            (math.ceil(p.seqlen_q / cfg.block_m2), p.heads_q, p.batch),
            dict(**common, scale=p.scale, BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2,
                 num_warps=cfg.num_warps_dq, num_stages=cfg.num_stages_dq),
            object(),
        )  # fmt: skip
    remember(_varlen_plans, key, plan)
    return plan


def varlen_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, vp, config=None, dlse=None
):
    """Recompute backward over packed sequences: dq, dk, dv like q, k, v (contiguous), dk/dv
    summed over each GQA group; deterministic (no atomics). `config` overrides the table
    (tuning and tests only). `dlse` (Hq, total_q) float32, the gradient reaching the LSE (None:
    0), is taken off delta."""
    from flashsuite.fa2 import varlen

    p = vp.attn
    q, k, v = _last_contig(q), _last_contig(k), _last_contig(v)
    out, dout = _last_contig(out), _last_contig(dout)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if vp.total_q == 0 or vp.total_k == 0 or p.seqlen_q == 0 or p.seqlen_k == 0:
        return dq, dk, dv
    plan = _varlen_plan(vp, _arch(q), config)
    row_pad = plan["row_pad"]
    rows = vp.total_q + p.batch * row_pad
    delta = torch.zeros(p.heads_q, rows, dtype=torch.float32, device=q.device)  # (Hq, rows)
    lse2 = torch.full((p.heads_q, rows), float("inf"), dtype=torch.float32, device=q.device)
    grid, kwargs, token = plan["pre"]
    launch(varlen._varlen_bwd_preprocess, grid, (
        out, dout, lse, delta, lse2, cu_seqlens_q, *out.stride()[:2], *dout.stride()[:2],
        lse.stride(0), delta.stride(0), row_pad,
    ), kwargs, plan=token)  # fmt: skip
    if dlse is not None:  # D = rowsum(dO ∘ O) - dlse; token t of sequence b at row t + b·row_pad
        tokens = torch.arange(vp.total_q, device=q.device)
        seq = torch.searchsorted(cu_seqlens_q[1:].contiguous().long(), tokens, right=True)
        delta[:, tokens + seq * row_pad] -= dlse
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *dout.stride()[:2])
    for grid, kwargs, token in plan["dkdv"]:
        launch(varlen._varlen_bwd_dkdv, grid, (
            q, k, v, dout, lse2, delta, dk, dv, cu_seqlens_q, cu_seqlens_k,
            *strides, *dk.stride()[:2], *dv.stride()[:2], delta.stride(0), row_pad,
        ), kwargs, plan=token)  # fmt: skip
    grid, kwargs, token = plan["dq"]
    launch(varlen._varlen_bwd_dq, grid, (
        q, k, v, dout, lse2, delta, dq, cu_seqlens_q, cu_seqlens_k,
        *strides, *dq.stride()[:2], delta.stride(0), row_pad,
    ), kwargs, plan=token)  # fmt: skip
    return dq, dk, dv
