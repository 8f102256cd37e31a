"""fa3: FlashAttention-3-style forward and backward for Hopper in the CuTe DSL. The contract of
docs/versions.md.

The backward (`bwd_kernel.Fa3Backward`, launched by `bwd_host`) covers part of what the forward
takes: `supports_backward` says which; the dispatcher pairs the forward with fa2's backward on
the saved (q, k, v, out, lse) for the rest (`HAS_BACKWARD = False`: not every problem), and
FLASHSUITE_FA3_BWD=0 sends every backward there. The forward kernel (`kernels.Fa3Forward`) is
compiled once per `compile.CompileKey` (dtype, head_dim, causal/local/softcap flags, tile
config) and launched through TVM-FFI on torch's current stream; batch, sequence lengths, head
counts and strides are runtime values. float8_e4m3fn inputs take the same path and the same
kernel class (its fp8 branch: bf16 out, (B, Hkv) descales, V transposed here first, or in the
kernel's shared memory with Fa3Config.v_transpose = "smem").
KV-cache attention (`supports_kvcache` / `kvcache_forward`) runs the split-KV decode kernel
(`decode.Fa3Decode`, host side in `decode_host`, compiled per `compile.DecodeKey`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import torch

from flashsuite.common.arch import arch_name, device_arch, is_overridden
from flashsuite.common.validation import AttnParams, VarlenParams, remember
from flashsuite.fa3.bwd_configs import (
    BWD_DEFAULT_ON,
    BWD_HEAD_DIMS,
    BWD_UNVERIFIED,
    VARLEN_BWD_AUTO,
    BwdConfig,
    bwd_can_implement,
    bwd_config_for,
)
from flashsuite.fa3.configs import (
    DTYPES,
    FP8_DTYPE,
    HEAD_DIMS,
    KVCACHE_AUTO,
    VARLEN_AUTO,
    Fa3Config,
    can_implement,
    can_implement_varlen,
    config_for,
    varlen_config_for,
)

NAME = "fa3"
HAS_BACKWARD = False
# Own backward without FLASHSUITE_FA3_BWD=1: bwd_configs.BWD_DEFAULT_ON holds the measurement.
OWN_BACKWARD_DEFAULT = BWD_DEFAULT_ON
# Whether auto selection takes fa3 for packed sequences (configs.VARLEN_AUTO: the measurement).
# Its backward is fa3's own where `supports_varlen_backward` says yes and dispatch is asked
# (FLASHSUITE_FA3_VARLEN_BWD=1) or OWN_VARLEN_BACKWARD_DEFAULT (bwd_configs.VARLEN_BWD_AUTO:
# off until run on a GPU), else the partner's (dispatch's registry.BACKWARD_PARTNER: fa2's).
VARLEN_AUTO_SELECT = VARLEN_AUTO
OWN_VARLEN_BACKWARD_DEFAULT = VARLEN_BWD_AUTO
# Whether auto selection takes fa3 for KV-cache attention (configs.KVCACHE_AUTO: off until the
# H200 has run it; version="fa3" runs it).
KVCACHE_AUTO_SELECT = KVCACHE_AUTO

_MAX_GRID_YZ = 65_535  # heads and batch are grid dims y and z


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def available() -> tuple[bool, str]:
    """The CuTe DSL installed, TVM-FFI importable, and a real sm90 GPU (sm_90a kernels only).

    The DSL is looked up, not imported: importing it takes longer than loading a binary from
    the on-disk cache (compile.py), which needs TVM-FFI alone; it is imported to compile.
    """
    if importlib.util.find_spec("cutlass") is None:
        return False, "fa3: nvidia-cutlass-dsl not installed (no module cutlass)"
    try:
        import tvm_ffi  # noqa: F401
    except ImportError as e:
        return False, f"fa3: apache-tvm-ffi not importable ({e}); the launcher needs it"
    if is_overridden():
        # Planning for another machine (tests of the dispatch table): the toolchain suffices.
        return True, f"fa3: CuTe DSL (planning for {arch_name(device_arch())})"
    if not torch.cuda.is_available():
        return False, "fa3: needs a CUDA GPU (sm90)"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return False, f"fa3: needs an sm90 GPU (H100/H200), got sm{cap[0]}{cap[1]}"
    return True, "fa3: CuTe DSL on sm90"


def supports(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    """Whether fa3 takes problem `p` on `arch` (90 only).

    fp8 descales are taken as positive (amax / 448 by construction): the kernel folds
    descale_q·descale_k into the softmax scale after the row max, which a negative product
    would flip. Checking their values would cost a device sync per call, so it is not done.
    """
    if arch != 90:
        where = "no GPU" if arch is None else f"sm{arch}"
        return False, f"fa3: needs sm90 (Hopper wgmma/TMA), got {where}"
    if p.dtype not in DTYPES and p.dtype != FP8_DTYPE:
        return False, f"fa3: dtype {_dt(p.dtype)} not in (float16, bfloat16, float8_e4m3fn)"
    if p.head_dim not in HEAD_DIMS:
        return False, f"fa3: head_dim {p.head_dim} not in {{{', '.join(map(str, HEAD_DIMS))}}}"
    if p.head_dim_v != p.head_dim:
        return False, f"fa3: head_dim_v {p.head_dim_v} != head_dim {p.head_dim}"
    if p.scale <= 0 and p.softcap == 0:
        # The running max is taken on raw scores and the scale folded in afterwards (a negative
        # scale flips the max; 0 makes -inf * 0 = NaN for rows that have seen no key yet).
        return False, f"fa3: softmax_scale must be > 0 (got {p.scale:g})"
    if p.heads_q > _MAX_GRID_YZ or p.batch > _MAX_GRID_YZ:
        return False, f"fa3: heads ({p.heads_q}) and batch ({p.batch}) must be <= {_MAX_GRID_YZ}"
    if max(p.seqlen_q, p.seqlen_k) >= 2**31 // 2:
        return False, "fa3: sequence lengths must be < 2^30 (32-bit TMA coordinates)"
    cfg = config_for(p)
    ok, reason = can_implement(cfg, p.head_dim, p.dtype)
    if not ok:
        return False, reason
    features = [f"{cfg.num_consumer_wgs} consumer WGs"]
    features += [
        name
        for name, on in (
            ("ping-pong", cfg.pingpong),
            ("intra-WG overlap", cfg.intra_wg_overlap),
            (
                "persistent, overlapped balanced tiles" if cfg.overlap_tiles else "persistent",
                cfg.persistent,
            ),
        )
        if on
    ]
    vt = "in shared memory" if cfg.v_transpose == "smem" else "copied on the host"
    what = f"fp8 e4m3 forward (bf16 out, Vᵀ {vt}), " if p.is_fp8 else ""
    tiles = f"{cfg.tile_m}x{cfg.tile_n} tiles, {cfg.stages} stages"
    return True, f"fa3: {what}{tiles}, {', '.join(features)}"


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """A view of `t` whose base and outer strides are 16-byte aligned, as TMA requires.

    Strides of size-1 dims are never stepped, so they are replaced by aligned ones (no copy).
    Anything else misaligned (rare: an odd slice of a bigger buffer) is copied once, which is
    slower but exact; aligned inputs, the common case, are never copied.
    """
    s0, s1, s2, _ = t.stride()
    if t.data_ptr() % 16 == 0 and (s0 | s1 | s2) % (16 // t.element_size()) == 0:
        return t  # the common case (any contiguous input: head_dim is a multiple of 8)
    esize = t.element_size()
    if t.data_ptr() % 16 != 0:
        return t.contiguous() if not t.is_contiguous() else t.clone()
    strides = list(t.stride())
    inner = t.size(3)  # compact extent below dim d, in elements
    for d in (2, 1, 0):
        if t.size(d) == 1:
            strides[d] = -(-inner // 8) * 8
        elif strides[d] * esize % 16 != 0:
            return t.contiguous()
        inner *= t.size(d)
    if strides != list(t.stride()):
        t = t.as_strided(t.shape, strides)
    return t


def transpose_v(v: torch.Tensor) -> torch.Tensor:
    """fp8 V (B, Nk, Hkv, D) -> Vᵀ (B, Hkv, D, Nk) with the keys contiguous: PV's B operand
    must be K-major for fp8 wgmma (it takes no MN-major operand), so the kernel loads Vᵀ blocks.

    One extra read and write of V (2·B·Nk·Hkv·D bytes, 64 MiB at B·N = 16k, Hkv·D = 2048):
    0.18-0.19 ms on the H200 there, 4-22 % of the fp8 forward at N = 8k-16k (commit 8867277,
    docs/results/fa3-fp8-ablation-8867277.json `bench`). The key stride is padded to 16 bytes
    (TMA); the view stops at Nk, so TMA zero-fills the tail block and the padding is never
    read. Copied through uint8 views (a byte permutation).
    """
    b, nk, hkv, d = v.shape
    nk_pad = (nk + 15) // 16 * 16
    vt = torch.empty((b, hkv, d, nk_pad), dtype=torch.uint8, device=v.device)  # (B, Hkv, D, Nk')
    vt = vt[..., :nk]  # (B, Hkv, D, Nk)
    vt.copy_(v.view(torch.uint8).permute(0, 2, 3, 1))
    return vt.view(v.dtype)


_ones: dict[tuple, torch.Tensor] = {}


def _descale(t: torch.Tensor | None, b: int, hkv: int, device: torch.device) -> torch.Tensor:
    """A (B, Hkv) contiguous fp32 descale; None -> a cached tensor of ones."""
    if t is not None:
        return t.contiguous()
    key = (device, b, hkv)
    ones = _ones.get(key)
    if ones is None:
        if len(_ones) > 256:
            _ones.clear()
        ones = _ones[key] = torch.ones((b, hkv), dtype=torch.float32, device=device)
    return ones


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: AttnParams,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    *,
    cfg: Fa3Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D) fp16, bf16 or float8_e4m3fn on an sm90 GPU, last
    dim contiguous; descales (B, Hkv) fp32 or None (1.0) for float8_e4m3fn inputs only.

    `cfg` overrides the tile config from configs.py (the ablation scripts use it).

    Returns out (B, Nq, Hq, D) contiguous in q's dtype (bf16 for float8_e4m3fn) and lse
    (B, Hq, Nq) float32 (natural log, -inf for rows that see no key).
    """
    descales = (descale_q, descale_k, descale_v)
    if not p.is_fp8 and (descale_q is not None or descale_k is not None or descale_v is not None):
        raise ValueError("fa3: descale factors are for fp8 inputs only")
    out = torch.empty(
        (p.batch, p.seqlen_q, p.heads_q, p.head_dim), dtype=p.out_dtype, device=q.device
    )  # (B, Nq, Hq, D)
    lse = torch.empty(
        (p.batch, p.heads_q, p.seqlen_q), dtype=torch.float32, device=q.device
    )  # (B, Hq, Nq)
    if out.numel() == 0:
        return out, lse
    if p.seqlen_k == 0:
        # No key at all: every row is empty (TMA cannot describe a zero-length tensor).
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    q, k = _tma_ready(q), _tma_ready(k)
    fn, scalars, cfg = _launch_plan(p, cfg, q.device)
    if p.is_fp8:
        if cfg.v_transpose == "host":
            v = transpose_v(v)  # (B, Hkv, D, Nk), keys contiguous
        else:
            v = _tma_ready(v)  # (B, Nk, Hkv, D): the kernel transposes each block in smem
        descales = tuple(_descale(t, p.batch, p.heads_kv, q.device) for t in descales)
    else:
        v = _tma_ready(v)
    fn(q, k, v, out, lse, *descales, None, None, *scalars)
    return out, lse


# (problem fields that pick the binary and its scalars, cfg, device) -> (binary, scalars).
# Saves the config lookup, CompileKey hashing and scalar arithmetic on every repeated call.
_plans: dict[tuple, tuple] = {}


def _launch_plan(
    p: AttnParams, cfg: Fa3Config | None, device: torch.device, vp: VarlenParams | None = None
) -> tuple:
    """(compiled forward, runtime scalars, config) for `p`, memoised per static problem.

    With `vp` (packed sequences, p = vp.attn): the varlen build, and an unbounded window side
    becomes total_q + total_k + 1, beyond every sequence's rows and keys whatever max_seqlen
    says.
    """
    nq, nk = (p.seqlen_q, p.seqlen_k) if vp is None else (vp.total_q, vp.total_k)
    pkey = (
        p.dtype,
        p.head_dim,
        p.causal,
        p.is_local,
        p.softcap,
        p.scale,
        p.window_left,
        p.window_right,
        nq,
        nk,
        cfg,
        device,
        vp is not None,
    )
    plan = _plans.get(pkey)
    if plan is None:
        from flashsuite.fa3.compile import CompileKey, get_forward, kernel_scalars

        if cfg is None:
            cfg = config_for(p) if vp is None else varlen_config_for(p)
        key = CompileKey(
            dtype=p.dtype,
            head_dim=p.head_dim,
            causal=p.causal,
            local=p.is_local,
            softcap=p.softcap > 0,
            cfg=cfg,
            varlen=vp is not None,
        )
        scalars = kernel_scalars(
            p.scale, p.softcap, (p.window_left, p.window_right), p.causal, nq, nk
        )
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        plan = (get_forward(key), (*scalars, sms), cfg)  # sms: the persistent grid's CTA count
        if len(_plans) > 4096:  # many distinct seqlens: start over rather than grow forever
            _plans.clear()
        _plans[pkey] = plan
    return plan


# (p, arch, deterministic algorithms on) -> supports_backward's answer; (p, deterministic)
# -> the backward's compile key of the table's config. Both are asked on every backward call.
_bwd_support: dict[tuple, tuple[bool, str]] = {}
_bwd_keys: dict[tuple, object] = {}


def supports_backward(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    """Whether fa3's own backward kernel takes problem `p` on `arch` (else fa2's runs);
    memoised per problem, architecture and deterministic-algorithms setting."""
    mkey = (p, arch, torch.are_deterministic_algorithms_enabled())
    answer = _bwd_support.get(mkey)
    if answer is None:
        answer = _supports_backward(p, arch)
        remember(_bwd_support, mkey, answer)
    return answer


def _supports_backward(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    ok, reason = supports(p, arch)
    if not ok:
        return False, reason
    if p.is_fp8:
        return False, "fa3 backward: float8 is forward-only"
    if p.head_dim not in BWD_HEAD_DIMS:
        dims = ", ".join(map(str, BWD_HEAD_DIMS))
        return False, f"fa3 backward: head_dim {p.head_dim} not in {{{dims}}} yet"
    cfg = _bwd_config(p, None)
    if p.is_local and cfg.deterministic:
        return False, "fa3 backward: the deterministic dQ order is not built for sliding windows"
    n_blocks = -(-p.seqlen_k // cfg.tile_n)
    yz = (p.batch, n_blocks) if cfg.lpt else (p.heads_kv, p.batch)  # grid dims y and z
    if n_blocks > 2**31 - 1 or max(yz) > _MAX_GRID_YZ:
        what = "batch and key blocks" if cfg.lpt else "kv heads and batch"
        return False, f"fa3 backward: {what} ({yz[0]}, {yz[1]}) must be <= {_MAX_GRID_YZ}"
    ok, reason = bwd_can_implement(cfg, p.head_dim, p.dtype)
    if not ok:
        return False, reason
    order = " in column-block order (deterministic)" if cfg.deterministic else ""
    route = {"warp": "a writer warp's bulk reduce", "atomic": "atomics"}
    issue = ", overlapped issue" if cfg.overlap else ""
    layout = ", P and dS through smem, dK^T / dV^T with D on M" if cfg.layout == "dkv_t" else ""
    split = " (split by rows)" if cfg.dq_split == "m" else ""
    return True, (
        f"fa3 backward: {cfg.tile_m}x{cfg.tile_n} tiles, {cfg.stages} stages, "
        f"{cfg.num_mma_wgs} MMA WGs{layout}{issue}, dQ{split} by {route[cfg.dq_mode]}{order}"
    )


def backward_opt_in(p: AttnParams) -> str:
    """Why dispatch takes fa3's own backward for `p` only when FLASHSUITE_FA3_BWD=1 asks, or ""
    when it takes it by default: builds that compile and pass the CPU checks but have not yet
    run on a GPU (bwd_configs.BWD_UNVERIFIED; empty while every build has run)."""
    features = []
    if p.softcap > 0:
        features.append("softcap")
    if torch.are_deterministic_algorithms_enabled():
        features.append("deterministic")
    for feature in features:
        if (p.head_dim, feature) in BWD_UNVERIFIED:
            return (
                f"fa3 backward at head_dim {p.head_dim} with {feature} compiled but not yet run "
                "on a GPU"
            )
    return ""


def _bwd_config(p: AttnParams, cfg: BwdConfig | None) -> BwdConfig:
    """`cfg` or the tile table's config for `p`. Under torch.use_deterministic_algorithms the
    dQ adds are ordered (BwdConfig.deterministic, docs/design.md): 64-row Q tiles, the same
    tiles, layout and rings, per-element atomics, one sdS buffer and the serial issue order,
    the deterministic build that has run on the H200 (at D = 64 / 128)."""
    if cfg is None:
        cfg = bwd_config_for(p.head_dim, p.dtype, p.causal, p.softcap > 0)
    if torch.are_deterministic_algorithms_enabled() and not cfg.deterministic:
        cfg = replace(
            cfg,
            tile_m=64,  # per-element atomics: one m64 atom of dQ per warpgroup
            dq_mode="atomic",
            dq_split="d",
            dq_handoff="cta",
            ds_store="scalar",
            ds_stages=1,
            overlap=False,
            lpt=False,
            deterministic=True,
        )
    return cfg


def _bwd_key(p: AttnParams, cfg: BwdConfig, varlen: bool):
    """The backward's compile key for `p` and `cfg`, or a ValueError saying why `cfg` cannot
    run `p` (varlen: packed sequences, neither deterministic nor lpt)."""
    from flashsuite.fa3.bwd_host import BwdCompileKey

    ok, reason = bwd_can_implement(
        cfg, p.head_dim, p.dtype, causal=p.causal, local=p.is_local, varlen=varlen
    )
    if ok and p.softcap > 0 and cfg.overlap:
        ok, reason = False, "softcap needs overlap False (dS takes tanh' in P's loop)"
    if ok and p.is_local and cfg.deterministic:
        ok, reason = False, "the deterministic dQ order is not built for sliding windows"
    if ok and varlen and (cfg.deterministic or cfg.lpt):
        ok, reason = False, "varlen builds take neither deterministic nor lpt configs"
    if not ok:
        what = "varlen backward" if varlen else "backward"
        raise ValueError(f"fa3 {what}: config {cfg} cannot run: {reason}")
    return BwdCompileKey(
        dtype=p.dtype,
        head_dim=p.head_dim,
        causal=p.causal,
        cfg=cfg,
        local=p.is_local,
        softcap=p.softcap > 0,
        varlen=varlen,
    )


def _table_bwd_key(p: AttnParams):
    """The dense backward's compile key of the table's config for `p`, memoised per problem
    and deterministic-algorithms setting."""
    mkey = (p, torch.are_deterministic_algorithms_enabled())
    key = _bwd_keys.get(mkey)
    if key is None:
        key = _bwd_key(p, _bwd_config(p, None), varlen=False)
        remember(_bwd_keys, mkey, key)
    return key


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    p: AttnParams,
    *,
    cfg: BwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the input dtype, contiguous, for what `supports_backward` accepts.

    dout, q, out (B, Nq, Hq, D); k, v (B, Nk, Hkv, D), fp16/bf16 on an sm90 GPU, last dim
    contiguous; lse (B, Hq, Nq) float32 (natural log, -inf for rows that see no key). `cfg`
    overrides the tile config from bwd_configs.bwd_config_for.
    """
    ok, reason = supports_backward(p, 90)
    if not ok:
        raise ValueError(f"fa3 backward: cannot take {p.describe()}: {reason}")
    if q.numel() == 0 or k.numel() == 0:
        # No row or no key: every gradient is 0 (TMA cannot describe a zero-length tensor).
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    from flashsuite.fa3.bwd_host import run_backward

    key = _table_bwd_key(p) if cfg is None else _bwd_key(p, _bwd_config(p, cfg), varlen=False)
    # The incoming gradient may be any view (e.g. expanded from a sum: strides 0).
    if dout.stride(-1) != 1 or 0 in dout.stride():
        dout = dout.contiguous()
    dout = _tma_ready(dout)
    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    out, lse = out.contiguous(), lse.contiguous()
    window = (p.window_left, p.window_right) if p.is_local else (-1, -1)
    return run_backward(key, dout, q, k, v, out, lse, p.scale, p.softcap, window)


def supports_varlen(vp: VarlenParams, arch: int | None) -> tuple[bool, str]:
    """Packed sequences: the dense limits (sm90, dtype, head dims, scale), 16-bit inputs only
    (attention_varlen refuses fp8 before any version is asked), token totals within 32-bit TMA
    coordinates and the (Hq, total_q) LSE's 32-bit offsets, heads within grid dim y."""
    p = vp.attn
    ok, reason = supports(p, arch)
    if not ok:
        return False, reason
    if p.dtype not in DTYPES:
        return False, f"fa3 varlen: dtype {_dt(p.dtype)} not in (float16, bfloat16)"
    if max(vp.total_q, vp.total_k) >= 2**29:
        # Window bounds reach total_q + total_k + 1 (an unbounded side) and are added to row and
        # shift in 32 bits; the ragged TMA coordinates stay below 2^30 + TILE_M.
        return False, "fa3 varlen: token totals must be < 2^29 (32-bit coordinates and bounds)"
    if p.heads_q * vp.total_q >= 2**31:
        return False, "fa3 varlen: heads_q x total_q must be < 2^31 (32-bit LSE offsets)"
    cfg = varlen_config_for(p)
    ok, reason = can_implement_varlen(cfg, p.dtype)
    if not ok:
        return False, reason
    what = "intra-WG overlap" if cfg.intra_wg_overlap else "no intra-WG overlap"
    return True, (
        f"fa3: varlen, {cfg.tile_m}x{cfg.tile_n} tiles, {cfg.stages} stages, one tile per CTA "
        f"(per-sequence TMA bounds), {what}"
    )


def varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    vp: VarlenParams,
    *,
    cfg: Fa3Config | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (total_q, Hq, D), k/v (total_k, Hkv, D) fp16/bf16 packed by cu_seqlens_q/k (int32
    (B + 1,), validated by the caller) on an sm90 GPU, last dim contiguous.

    Returns out (total_q, Hq, D) in q's dtype and lse (Hq, total_q) float32 (natural log):
    0 and -inf for the rows of a sequence without keys. `cfg` overrides varlen_config_for;
    `out` and `lse` (views into larger buffers, in tests that watch the memory around them)
    are written in place instead of new tensors.
    """
    p = vp.attn
    if out is None:
        out = torch.empty((vp.total_q, p.heads_q, p.head_dim), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((p.heads_q, vp.total_q), dtype=torch.float32, device=q.device)
    if vp.total_q == 0:
        return out, lse
    if vp.total_k == 0 or p.seqlen_k == 0:
        # No key in any sequence (TMA cannot describe a zero-length tensor): every row empty.
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    q, k, v = (_tma_ready(t[None])[0] for t in (q, k, v))
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    fn, scalars, _ = _launch_plan(p, cfg, q.device, vp)
    fn(q, k, v, out, lse, None, None, None, cu_seqlens_q, cu_seqlens_k, *scalars)
    return out, lse


def supports_varlen_backward(vp: VarlenParams, arch: int | None) -> tuple[bool, str]:
    """Whether fa3's own backward (bwd_varlen.py) takes packed sequences `vp` on `arch`: the
    varlen forward's limits, the dense backward's head dims and configs, not deterministic
    (fa2's varlen backward, the partner, is), kv heads within grid dim y."""
    ok, reason = supports_varlen(vp, arch)
    if not ok:
        return False, reason
    p = vp.attn
    if p.head_dim not in BWD_HEAD_DIMS:
        dims = ", ".join(map(str, BWD_HEAD_DIMS))
        return False, f"fa3 varlen backward: head_dim {p.head_dim} not in {{{dims}}}"
    if torch.are_deterministic_algorithms_enabled():
        return False, "fa3 varlen backward: no deterministic build (fa2's varlen backward is)"
    if p.heads_kv > _MAX_GRID_YZ:
        return False, f"fa3 varlen backward: heads_kv {p.heads_kv} must be <= {_MAX_GRID_YZ}"
    cfg = bwd_config_for(p.head_dim, p.dtype, p.causal, p.softcap > 0)
    ok, reason = bwd_can_implement(cfg, p.head_dim, p.dtype)
    if not ok:
        return False, reason
    return True, (
        f"fa3 varlen backward: {cfg.tile_m}x{cfg.tile_n} tiles on a virtual column-block grid "
        "(per-sequence TMA bounds)"
    )


def varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    vp: VarlenParams,
    *,
    cfg: BwdConfig | None = None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the input dtype, contiguous, of `varlen_forward`, for what
    `supports_varlen_backward` accepts: dout, q, out (total_q, Hq, D), k, v (total_k, Hkv, D)
    last dim contiguous, lse (Hq, total_q) float32 (natural log), cu_seqlens_q/k (B + 1,) int32
    (validated by the caller). `cfg` overrides bwd_config_for (neither deterministic nor lpt);
    `grads` (contiguous dq, dk, dv: views into larger buffers, in tests that watch the memory
    around them) are written in place instead of new tensors."""
    ok, reason = supports_varlen_backward(vp, 90)
    if not ok:
        raise ValueError(f"fa3 varlen backward: cannot take {vp.describe()}: {reason}")
    p = vp.attn
    if vp.total_q == 0 or vp.total_k == 0:
        # No row or no key: every gradient is 0 (TMA cannot describe a zero-length tensor).
        if grads is None:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return tuple(g.zero_() for g in grads)
    from flashsuite.fa3.bwd_host import run_varlen_backward

    if cfg is None:
        cfg = bwd_config_for(p.head_dim, p.dtype, p.causal, p.softcap > 0)
    key = _bwd_key(p, cfg, varlen=True)
    if dout.stride(-1) != 1 or 0 in dout.stride():
        dout = dout.contiguous()  # any view of the incoming gradient (e.g. expanded: strides 0)
    q, k, v, dout = (_tma_ready(t[None])[0] for t in (q, k, v, dout))
    out = out if out.stride(-1) == 1 else out.contiguous()
    lse, cu_seqlens_q, cu_seqlens_k = (t.contiguous() for t in (lse, cu_seqlens_q, cu_seqlens_k))
    window = (p.window_left, p.window_right) if p.is_local else (-1, -1)
    return run_varlen_backward(
        key, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, p.scale, p.softcap, window,
        grads,
    )  # fmt: skip


def supports_kvcache(kp, arch: int | None) -> tuple[bool, str]:
    """KV-cache attention (decode.Fa3Decode): the dense limits (sm90, dtype, head dims, scale)
    and the decode kernel's own (16-bit inputs, 32-bit offsets; decode_host.supports)."""
    ok, reason = supports(kp.attn, arch)
    if not ok:
        return False, reason
    from flashsuite.fa3 import decode_host

    return decode_host.supports(kp)


def kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp):
    """Split-KV decode against a contiguous or paged cache, after appending k, v
    (decode_host.kvcache_forward). Returns out (B, Nq, Hq, D) and lse (B, Hq, Nq) fp32."""
    from flashsuite.fa3 import decode_host

    return decode_host.kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp)
