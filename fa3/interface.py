"""fa3: FlashAttention-3-style forward and backward for Hopper in the CuTe DSL. The contract of
docs/versions.md.

The backward (`bwd_kernel.Fa3Backward`, launched by `bwd_host`; its entry points are
`bwd_interface`'s, re-exported here) covers part of what the forward takes: `supports_backward`
says which; the dispatcher pairs the forward with fa2's backward on the saved (q, k, v, out,
lse) for the rest (`HAS_BACKWARD = False`: not every problem), and FLASHSUITE_FA3_BWD=0 sends
every backward there. The forward kernel (`kernels.Fa3Forward`) is
compiled once per `compile.CompileKey` (dtype, head_dim, causal/local/softcap flags, tile
config) and launched through TVM-FFI on torch's current stream; batch, sequence lengths, head
counts and strides are runtime values. float8_e4m3fn inputs take the same path and the same
kernel class (its fp8 branch: bf16 out, (B, Hkv) descales, V transposed here first, or in the
kernel's shared memory with Fa3Config.v_transpose = "smem").
KV-cache attention (`supports_kvcache` / `kvcache_forward`) runs the split-KV decode kernel
(`decode.Fa3Decode`, host side in `decode_host`, compiled per `compile.DecodeKey`).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import replace

import torch

from flashsuite.common.arch import arch_name, device_arch, is_overridden
from flashsuite.common.kvcache import dense_as_decode, length_tensor
from flashsuite.common.validation import AttnParams, KVCacheParams, VarlenParams
from flashsuite.fa3.bwd_configs import BWD_DEFAULT_ON, VARLEN_BWD_AUTO

# The backward's entry points (bwd_interface.py), part of this contract, and the config and
# compile-key lookups the benchmarks and tests reach through this module.
from flashsuite.fa3.bwd_interface import (  # noqa: F401 (re-exported)
    _bwd_config,
    _bwd_key,
    backward,
    backward_opt_in,
    supports_backward,
    supports_varlen_backward,
    varlen_backward,
)
from flashsuite.fa3.configs import (
    DTYPES,
    FP8_DTYPE,
    HEAD_DIMS,
    Fa3Config,
    can_implement,
    config_for,
    fp8_block_tiles,
)
from flashsuite.fa3.decode_configs import DECODE_TILE_M, KVCACHE_AUTO
from flashsuite.fa3.trace import FIELDS as TRACE_FIELDS
from flashsuite.fa3.varlen_configs import VARLEN_AUTO, can_implement_varlen, varlen_config_for

NAME = "fa3"
HAS_BACKWARD = False
# Own backward without FLASHSUITE_FA3_BWD=1: bwd_configs.BWD_DEFAULT_ON holds the measurement.
OWN_BACKWARD_DEFAULT = BWD_DEFAULT_ON
# Whether auto selection takes fa3 for packed sequences (varlen_configs.VARLEN_AUTO: measured).
# Its backward is fa3's own where `supports_varlen_backward` says yes and dispatch is asked
# (FLASHSUITE_FA3_VARLEN_BWD=1) or OWN_VARLEN_BACKWARD_DEFAULT (bwd_configs.VARLEN_BWD_AUTO:
# off until run on a GPU), else the partner's (dispatch's registry.BACKWARD_PARTNER: fa2's).
VARLEN_AUTO_SELECT = VARLEN_AUTO
OWN_VARLEN_BACKWARD_DEFAULT = VARLEN_BWD_AUTO
# Whether auto selection takes fa3 for KV-cache attention (decode_configs.KVCACHE_AUTO, with the
# measurement that set it; version="fa3" runs it either way).
KVCACHE_AUTO_SELECT = KVCACHE_AUTO

_MAX_GRID_YZ = 65_535  # heads and batch are grid dims y and z


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache  # a module search on every call costs more than a decode step's launch
def _toolchain() -> tuple[bool, str]:
    """The CuTe DSL installed and TVM-FFI importable (what a process has does not change)."""
    if importlib.util.find_spec("cutlass") is None:
        return False, "fa3: nvidia-cutlass-dsl not installed (no module cutlass)"
    try:
        import tvm_ffi  # noqa: F401
    except ImportError as e:
        return False, f"fa3: apache-tvm-ffi not importable ({e}); the launcher needs it"
    return True, ""


def available() -> tuple[bool, str]:
    """The CuTe DSL installed, TVM-FFI importable, and a real sm90 GPU (sm_90a kernels only).

    The DSL is looked up, not imported: importing it takes longer than loading a binary from
    the on-disk cache (compile.py), which needs TVM-FFI alone; it is imported to compile.
    """
    ok, reason = _toolchain()
    if not ok:
        return False, reason
    if is_overridden():
        # Planning for another machine (tests of the dispatch table): the toolchain suffices.
        return True, f"fa3: CuTe DSL (planning for {arch_name(device_arch())})"
    if not torch.cuda.is_available():
        return False, "fa3: needs a CUDA GPU (sm90)"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return False, f"fa3: needs an sm90 GPU (H100/H200), got sm{cap[0]}{cap[1]}"
    return True, "fa3: CuTe DSL on sm90"


# Dense 16-bit problems of few query rows run on the split-KV decode kernel (`decode_route`):
# a decode step or a short chunk against a long K/V, reached through `attention`,
# flash_attn_func or the SDPA plug-in rather than through attention_with_kvcache. The forward
# kernel's 128-row tiles hold Nq of their rows per (batch, query head), read K/V once per query
# head and run one CTA per tile however long the keys are; the decode kernel packs a K/V head's
# query heads into one tile, reads K/V once and splits long keys over the SMs. k and v are the
# cache (every row full), so out and the LSE are the forward's (within rounding: another split
# of the keys). Measured on an H100 (benchmarks/decode_route_ab.py, docs/inference.md): with
# GQA the decode kernel is 1.3-5.2x the forward at Nq 1-16 (up to 64 packed rows), level at
# 512 keys; without GQA it is 1.7x where the forward's grid holds 32 CTAs (B x Hq, Nq <= 16)
# and 0.96-0.99x from 64 CTAs on, 0.78-0.85x at Nq 32-64. So: at most DECODE_ROUTE_MAX_NQ
# queries and DECODE_ROUTE_MAX_ROWS packed rows, and without GQA fewer than
# DECODE_ROUTE_MHA_MAX_CTAS (B x Hq) tiles. DECODE_ROUTE_MAX_ROWS = 0 turns the route off.
DECODE_ROUTE_MAX_ROWS = DECODE_TILE_M
DECODE_ROUTE_MAX_NQ = 16
DECODE_ROUTE_MHA_MAX_CTAS = 64
_routes: dict[tuple, KVCacheParams | None] = {}


def decode_route(p: AttnParams) -> KVCacheParams | None:
    """The KV-cache problem (k, v as a full contiguous cache of seqlen_k tokens a row) that
    `forward` runs dense problem `p` as, or None where the forward kernel runs it: float8,
    Dv != D, no keys, more than DECODE_ROUTE_MAX_NQ queries or DECODE_ROUTE_MAX_ROWS packed
    rows, no GQA and at least DECODE_ROUTE_MHA_MAX_CTAS (batch x heads) tiles, or what the
    decode kernel does not take (decode_host.supports). Memoised per problem and thresholds."""
    limits = (DECODE_ROUTE_MAX_ROWS, DECODE_ROUTE_MAX_NQ, DECODE_ROUTE_MHA_MAX_CTAS)
    key = (p, limits)
    if key in _routes:
        return _routes[key]
    kp = dense_as_decode(p, *limits)
    if kp is not None:
        from flashsuite.fa3 import decode_host

        kp = kp if decode_host.supports(kp)[0] else None
    if len(_routes) >= 1024:  # many distinct problems: start over rather than grow
        _routes.clear()
    _routes[key] = kp
    return kp


def _decode_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kp: KVCacheParams):
    """`forward` of a problem `decode_route` sends to the split-KV decode kernel: out
    (B, Nq, Hq, D) and lse (B, Hq, Nq), contiguous."""
    from flashsuite.fa3 import decode_host

    lens = length_tensor(kp.attn.batch, kp.attn.seqlen_k, q.device)
    return decode_host.kvcache_forward(q, k, v, None, None, lens, None, kp)


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
    if decode_route(p) is not None:
        from flashsuite.fa3 import decode_host

        rows = p.seqlen_q * p.group_size
        how = decode_host.supports(decode_route(p))[1].removeprefix("fa3: ")
        return True, f"fa3: {rows} packed query rows: {how}, k and v as full rows"
    cfg = config_for(p)
    ok, reason = can_implement(cfg, p.head_dim, p.dtype)
    if not ok:
        return False, reason
    if p.is_fp8 and p.fp8_block_kv % cfg.tile_n:
        tiles = " or ".join(map(str, fp8_block_tiles(p.head_dim)))
        return False, (
            f"fa3: fp8 k/v descales every {p.fp8_block_kv} keys need a multiple of the key "
            f"tile ({tiles} at head_dim {p.head_dim})"
        )
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
            ("two Q buffers", cfg.q_stages == 2),
            ("Q in registers", cfg.q_in_regs),
            (
                f"{cfg.l2_section_mib} MiB L2 sections",
                cfg.persistent and cfg.l2_section_mib != Fa3Config.l2_section_mib,
            ),
            ("tiles from a global counter", cfg.tile_counter),
        )
        if on
    ]
    vt = "in shared memory"
    if cfg.v_transpose == "host" and cfg.permute_v_keys:
        vt = "copied on the host, its keys permuted within 32-key blocks"
    elif cfg.v_transpose == "host" and p.v_keys_major:
        vt = "read from V laid out keys-major, no copy"
    elif cfg.v_transpose == "host":
        vt = "copied on the host unless V is keys-major (common.fp8.keys_major)"
    what = f"fp8 e4m3 forward (bf16 out, Vᵀ {vt}), " if p.is_fp8 else ""
    tiles = f"{cfg.tile_m}x{cfg.tile_n} tiles, {cfg.stages} stages"
    return True, f"fa3: {what}{tiles}, {', '.join(features)}"


def _strides_aligned(t: torch.Tensor) -> bool:
    """Whether the outer strides of the 4-D `t` are 16-byte multiples (what _tma_ready checks
    beside the base address)."""
    s0, s1, s2, _ = t.stride()
    return (s0 | s1 | s2) % (16 // t.element_size()) == 0


def _tma_ready_packed(t: torch.Tensor) -> torch.Tensor:
    """`_tma_ready` for a packed (total, H, D) tensor: the tensor itself where its base and
    outer strides are already aligned (no view made), else `_tma_ready` of its 4-D view."""
    s0, s1, _ = t.stride()
    if t.data_ptr() % 16 == 0 and (s0 | s1) % (16 // t.element_size()) == 0:
        return t
    return _tma_ready(t[None])[0]


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """A view of `t` whose base and outer strides are 16-byte aligned, as TMA requires.

    Strides of size-1 dims are never stepped, so they are replaced by aligned ones (no copy).
    Anything else misaligned (rare: an odd slice of a bigger buffer) is copied once, which is
    slower but exact; aligned inputs, the common case, are never copied.
    """
    if t.data_ptr() % 16 == 0 and _strides_aligned(t):
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


def transpose_v(v: torch.Tensor, permute_keys: bool = False) -> torch.Tensor:
    """fp8 V (B, Nk, Hkv, D) -> Vᵀ (B, Hkv, D, Nk) with the keys contiguous: PV's B operand
    must be K-major for fp8 wgmma (it takes no MN-major operand), so the kernel loads Vᵀ blocks.

    One extra read and write of V (2·B·Nk·Hkv·D bytes, 64 MiB at B·N = 16k, Hkv·D = 2048),
    by `common.transpose.keys_major_copy` (one Triton launch: 29-32 us there on an H100, where
    PyTorch's strided copy, its path where Triton cannot run, takes 215-229 us; docs/fp8.md).
    The key stride is padded to 16 bytes (TMA); the view stops at Nk, so TMA zero-fills the
    tail block and the padding is never read.

    `permute_keys` (Fa3Config.permute_v_keys): within each 32-key block the keys go in
    `fp8_ops.slot_key` order (`common.transpose.transpose_keys_permuted`, the same launch with
    the columns permuted). Vᵀ then runs to Nk rounded up to 32, the keys past Nk zero (a
    permuted block mixes them with real ones, so TMA's zero fill past Nk cannot stand in for
    them; the kernel masks those keys by K's length).
    """
    from flashsuite.common.transpose import keys_major_copy, transpose_keys_permuted

    if permute_keys:
        return transpose_keys_permuted(v)
    b, nk, hkv, d = v.shape
    nk_pad = (nk + 15) // 16 * 16
    vt = torch.empty((b, hkv, d, nk_pad), dtype=v.dtype, device=v.device)  # (B, Hkv, D, Nk')
    vt = vt[..., :nk]  # (B, Hkv, D, Nk)
    keys_major_copy(v, vt.permute(0, 3, 1, 2))
    return vt


def _vt_of(v: torch.Tensor) -> torch.Tensor:
    """Vᵀ (B, Hkv, D, Nk) of a keys-major fp8 V (stride(1) == 1, common.fp8.keys_major): a view,
    no copy, where its base and strides suit TMA; else `transpose_v`'s copy."""
    vt = v.permute(0, 2, 3, 1)
    if vt.stride(-1) == 1 and vt.data_ptr() % 16 == 0 and _strides_aligned(vt):
        return vt
    return transpose_v(v)


_ones: dict[tuple, torch.Tensor] = {}


def _fp8_blocks(p: AttnParams) -> bool:
    """Whether `p` takes the per-block fp8 build (some descale is a block view)."""
    return p.is_fp8 and (p.fp8_block_q > 0 or p.fp8_block_kv > 0)


def _block_size(ds: torch.Tensor | None) -> int:
    """Rows per descale of an fp8 descale: its block view's last extent; 0 for (B, Hkv) or
    None."""
    return ds.shape[3] if ds is not None and ds.dim() == 4 else 0


# The rows of the one block that a (B, Hkv) descale becomes in the per-block build: more than
# any sequence has (< 2^30, `supports`), so every row and K/V block of the kernel reads block 0.
_ONE_BLOCK = 1 << 30


def _block_descale(
    t: torch.Tensor | None, b: int, hkv: int, device, rows: int = 1, block: int = _ONE_BLOCK
) -> torch.Tensor:
    """A descale as the per-block build takes it: a (B, H, nblocks, block) fp32 view with the
    last stride 0. A block view passes as it is (its last stride set to 0, which changes
    nothing where block is 1); (B, Hkv) and None (ones) become blocks of `block` rows that all
    read the one value (stride 0 over blocks too): one block of _ONE_BLOCK rows, or for k or v
    beside a per-block partner the partner's block size, since the kernel finds k's and v's
    descales of a K/V block with one block index (`block_scales`)."""
    if t is not None and t.dim() == 4:
        return t.as_strided(t.shape, (*t.stride()[:3], 0))
    t = _descale(t, b, hkv, device)  # (B, Hkv)
    nblocks = -(-rows // block)  # of `rows` (the keys)
    return t.as_strided((b, hkv, nblocks, block), (*t.stride(), 0, 0))


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
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D) fp16, bf16 or float8_e4m3fn on an sm90 GPU, last
    dim contiguous; descales (B, Hkv) fp32 or None (1.0) for float8_e4m3fn inputs only.

    `cfg` overrides the tile config from configs.py (the ablation scripts use it). `trace`,
    with cfg.trace only: the int64 (tiles x consumer WGs, len(trace.FIELDS)) tensor of its stamps.

    Returns out (B, Nq, Hq, D) contiguous in q's dtype (bf16 for float8_e4m3fn) and lse
    (B, Hq, Nq) float32 (natural log, -inf for rows that see no key).
    """
    descales = (descale_q, descale_k, descale_v)
    if not p.is_fp8 and (descale_q is not None or descale_k is not None or descale_v is not None):
        raise ValueError("fa3: descale factors are for fp8 inputs only")
    if p.is_fp8 and any(t is not None and t.dim() == 4 for t in descales):
        # Block views (common.fp8.block_view), validated by check_inputs: the rows per
        # descale choose the build and its key tile (configs.fp8_block_config).
        block_kv = max(_block_size(descale_k), _block_size(descale_v))
        p = replace(p, fp8_block_q=_block_size(descale_q), fp8_block_kv=block_kv)
        if cfg is None:
            ok, reason = supports(p, 90)
            if not ok:
                raise ValueError(reason)
    if cfg is None and trace is None and (kp := decode_route(p)) is not None:
        return _decode_forward(q, k, v, kp)
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
        keys_major = v.size(-1) > 1 and v.stride(-1) != 1  # check_inputs: then stride(1) == 1
        if cfg.v_transpose == "host":
            # (B, Hkv, D, Nk), keys contiguous: a keys-major V is that already (but for the
            # key order of permute_v_keys)
            if keys_major and not cfg.permute_v_keys:
                v = _vt_of(v)
            else:
                v = transpose_v(v, cfg.permute_v_keys)
        else:
            # (B, Nk, Hkv, D): the kernel transposes each block in smem
            v = _tma_ready(v.contiguous() if keys_major else v)
        if _fp8_blocks(p):
            b, hkv, nk = p.batch, p.heads_kv, p.seqlen_k
            kv_block = p.fp8_block_kv or _ONE_BLOCK
            descales = (
                _block_descale(descale_q, b, hkv, q.device),
                _block_descale(descale_k, b, hkv, q.device, nk, kv_block),
                _block_descale(descale_v, b, hkv, q.device, nk, kv_block),
            )
        else:
            descales = tuple(_descale(t, p.batch, p.heads_kv, q.device) for t in descales)
    else:
        v = _tma_ready(v)
    if (trace is not None) != cfg.trace:
        raise ValueError(f"fa3: trace tensor given: {trace is not None}, cfg.trace: {cfg.trace}")
    if trace is not None:
        shape = (p.batch * p.heads_q * -(-p.seqlen_q // cfg.tile_m) * cfg.num_consumer_wgs,)
        shape += (len(TRACE_FIELDS),)
        if (trace.dtype, tuple(trace.shape)) != (torch.int64, shape) or not (
            trace.is_cuda and trace.is_contiguous()
        ):
            raise ValueError(
                f"fa3: trace expected a contiguous CUDA int64 {shape} tensor, got "
                f"{trace.dtype} {tuple(trace.shape)} on {trace.device}"
            )
        descales = (trace, None, None)
    counters = _tile_counters(q.device) if cfg.tile_counter else None
    fn(q, k, v, out, lse, *descales, None, counters, *scalars)
    return out, lse


def _tile_counters(device: torch.device) -> torch.Tensor:
    """The (next tile, CTAs done) int32 pair of a Fa3Config.tile_counter build: zero at every
    launch (the last CTA of each launch sets them back to 0), the decode combine's counters
    (`decode_host.split_counters`: one buffer per stream, so launches that may run at once
    never share a pair; inside CUDA-graph capture a slice of the capture pool no other
    captured call gets). The module is looked up once, not imported per call (about 1 µs)."""
    global _decode_host
    if _decode_host is None:
        from flashsuite.fa3 import decode_host

        _decode_host = decode_host
    return _decode_host.split_counters(2, device)


_decode_host = None  # fa3.decode_host once a tile-counter build has run (it imports Triton)


def bind_forward(p: AttnParams, need_lse: bool = True):
    """`forward(q, k, v, p)` as a function of (q, k, v) alone, for callers that run one problem
    many times (dispatch's memoised plans): the launch plan is found on the first call and
    kept, so a repeat call only allocates the outputs, checks TMA alignment and launches.
    None where `forward` does more than that (fp8: descales and V's layout; empty problems).
    The kernel always writes the LSE (`need_lse`, which fa2's build uses, changes nothing
    here: a second compiled kernel would cost a cold start more than the allocation saves)."""
    if p.is_fp8 or p.seqlen_k == 0 or 0 in (p.batch, p.seqlen_q, p.heads_q, p.head_dim):
        return None
    if (kp := decode_route(p)) is not None:
        return lambda q, k, v: _decode_forward(q, k, v, kp)
    counted = config_for(p).tile_counter  # the launch takes its tile counters
    out_shape = (p.batch, p.seqlen_q, p.heads_q, p.head_dim)  # (B, Nq, Hq, D)
    lse_shape = (p.batch, p.heads_q, p.seqlen_q)  # (B, Hq, Nq)
    dtype, f32 = p.out_dtype, torch.float32
    plan = None
    aligned = None  # the (q, k, v) strides of the first call, where _tma_ready keeps them

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        nonlocal plan, aligned
        device = q.device
        if plan is None:
            fn, scalars, _ = _launch_plan(p, None, device)
            plan = fn, scalars
            strides = (q.stride(), k.stride(), v.stride())
            if all(_strides_aligned(t) for t in (q, k, v)):
                aligned = strides
        fn, scalars = plan
        # Sizes as separate ints: torch.empty parses them faster than one tuple (~1.5 against
        # ~2.2 µs a call on a CPU).
        out = torch.empty(*out_shape, dtype=dtype, device=device)
        lse = torch.empty(*lse_shape, dtype=f32, device=device)
        # The strides a plan sees repeat (dispatch keys its plans on them): a repeat call
        # checks that and the base addresses, and _tma_ready runs only when either differs.
        if (
            (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16
            or aligned is None
            or aligned != (q.stride(), k.stride(), v.stride())
        ):
            q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
        counters = _tile_counters(device) if counted else None
        fn(q, k, v, out, lse, None, None, None, None, counters, *scalars)
        return out, lse

    return run


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
        p.fp8_block_q,
        p.fp8_block_kv,
    )
    plan = _plans.get(pkey)
    if plan is None:
        from flashsuite.fa3.compile import CompileKey, get_forward, kernel_scalars

        if cfg is None:
            cfg = config_for(p) if vp is None else varlen_config_for(p)
        if cfg.lse_tma and nq % 4:
            raise ValueError(
                f"fa3: cfg.lse_tma needs seqlen_q % 4 == 0 (the LSE rows' 16-byte TMA stride), "
                f"got seqlen_q={nq}"
            )
        key = CompileKey(
            dtype=p.dtype,
            head_dim=p.head_dim,
            causal=p.causal,
            local=p.is_local,
            softcap=p.softcap > 0,
            cfg=cfg,
            varlen=vp is not None,
            fp8_blocks=_fp8_blocks(p),
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
    q, k, v = _tma_ready_packed(q), _tma_ready_packed(k), _tma_ready_packed(v)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    fn, scalars, _ = _launch_plan(p, cfg, q.device, vp)
    fn(q, k, v, out, lse, None, None, None, cu_seqlens_q, cu_seqlens_k, *scalars)
    return out, lse


def supports_kvcache(kp, arch: int | None) -> tuple[bool, str]:
    """KV-cache attention (decode.Fa3Decode): the dense limits (sm90, dtype, head dims, scale)
    and the decode kernel's own (16-bit inputs, 32-bit offsets; decode_host.supports)."""
    if kp.fp8_cache:
        return False, (
            "fa3: its decode kernel reads 16-bit caches only (a float8_e4m3fn cache runs on "
            "fa2's decode kernel)"
        )
    ok, reason = supports(kp.attn, arch)
    if not ok:
        return False, reason
    from flashsuite.fa3 import decode_host

    return decode_host.supports(kp)


def kvcache_forward(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp, *, leftpad=None, descales=None
):
    """Split-KV decode against a contiguous or paged cache, after appending k, v
    (decode_host.kvcache_forward; `leftpad`: each contiguous row's first key slot). Returns out
    (B, Nq, Hq, D) and lse (B, Hq, Nq) fp32. `descales` (a float8 cache's) is always None here:
    supports_kvcache refuses such a cache."""
    from flashsuite.fa3 import decode_host

    if descales is not None or kp.fp8_cache:
        raise ValueError("fa3: a float8_e4m3fn KV cache is not supported (fa2 reads one)")
    return decode_host.kvcache_forward(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, kp, leftpad=leftpad
    )
