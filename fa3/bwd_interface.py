"""fa3's backward entry points: whether its own backward kernel takes a problem
(`supports_backward`, `supports_varlen_backward`, `backward_opt_in`), the config and compile key
it runs (`_bwd_config`, `_bwd_key`, memoised in `_table_bwd_key`), and the launches (`backward`,
`varlen_backward`, through bwd_host.py). `fa3.interface`, the version's contract, re-exports
them; dispatch reaches them there.

The forward's limits (`interface.supports`, `interface.supports_varlen`) bound every backward,
and inputs are made TMA-ready by the forward's `interface._tma_ready`. They are imported inside
the functions: `fa3.interface` imports this module when it is loaded, to re-export it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashsuite.common.validation import AttnParams, VarlenParams, remember
from flashsuite.fa3.bwd_configs import (
    BWD_HEAD_DIMS,
    BWD_UNVERIFIED,
    BwdConfig,
    bwd_can_implement,
    bwd_config_for,
)

# (p or vp, arch, deterministic algorithms on) -> supports_backward's or
# supports_varlen_backward's answer; (p or vp, deterministic) -> the backward's compile key of
# the table's config. Both are asked on every backward call.
_bwd_support: dict[tuple, tuple[bool, str]] = {}
_bwd_keys: dict[tuple, object] = {}


def supports_backward(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    """Whether fa3's own backward kernel takes problem `p` on `arch` (else fa2's runs);
    memoised per problem, architecture and deterministic-algorithms setting."""
    return _memoised_support(_supports_backward, p, arch)


def _memoised_support(check, params, arch: int | None) -> tuple[bool, str]:
    """`check(params, arch)`, memoised in _bwd_support per problem, architecture and
    deterministic-algorithms setting."""
    mkey = (params, arch, torch.are_deterministic_algorithms_enabled())
    answer = _bwd_support.get(mkey)
    if answer is None:
        answer = check(params, arch)
        remember(_bwd_support, mkey, answer)
    return answer


def _supports_backward(p: AttnParams, arch: int | None) -> tuple[bool, str]:
    from flashsuite.fa3.interface import _MAX_GRID_YZ, supports

    ok, reason = supports(p, arch)
    if not ok:
        return False, reason
    if p.is_fp8:
        return False, "fa3 backward: float8 is forward-only"
    if p.head_dim not in BWD_HEAD_DIMS:
        dims = ", ".join(map(str, BWD_HEAD_DIMS))
        return False, f"fa3 backward: head_dim {p.head_dim} not in {{{dims}}} yet"
    cfg = _bwd_config(p, None)
    n_blocks = -(-p.seqlen_k // cfg.tile_n)
    yz = (p.batch, n_blocks) if cfg.lpt else (p.heads_kv, p.batch)  # grid dims y and z
    ctas = n_blocks * p.heads_kv * p.batch  # head_section: one grid dimension
    if cfg.head_section and ctas > 2**31 - 1:
        return False, f"fa3 backward: {ctas} CTAs (key blocks x kv heads x batch) must be < 2^31"
    if not cfg.head_section and (n_blocks > 2**31 - 1 or max(yz) > _MAX_GRID_YZ):
        what = "batch and key blocks" if cfg.lpt else "kv heads and batch"
        return False, f"fa3 backward: {what} ({yz[0]}, {yz[1]}) must be <= {_MAX_GRID_YZ}"
    ok, reason = bwd_can_implement(cfg, p.head_dim, p.dtype)
    if not ok:
        return False, reason
    order = " in column-block order (deterministic)" if cfg.deterministic else ""
    route = {
        "warp": "a writer warp's bulk reduce",
        "atomic": "atomics",
        "red": "the MMA threads' vector reductions",
    }
    issue = ", overlapped issue" if cfg.overlap else ""
    layout = ", P and dS through smem, dK^T / dV^T with D on M" if cfg.layout == "dkv_t" else ""
    split = " (split by rows)" if cfg.dq_split == "m" else ""
    return True, (
        f"fa3 backward: {cfg.tile_m}x{cfg.tile_n} tiles, {cfg.stages} stages, "
        f"{cfg.num_mma_wgs} MMA WGs{layout}{issue}, dQ{split} by {route[cfg.dq_mode]}{order}"
    )


def backward_opt_in(params: AttnParams | VarlenParams) -> str:
    """Why dispatch takes fa3's own backward (its varlen one for VarlenParams) for a problem
    only when FLASHSUITE_FA3_BWD=1 (FLASHSUITE_FA3_VARLEN_BWD=1) asks, or "" when it takes it
    by default: builds that compile and pass the CPU checks but have not yet run on a GPU
    (bwd_configs.BWD_UNVERIFIED)."""
    varlen = isinstance(params, VarlenParams)
    p = params.attn if varlen else params
    features = []
    if p.softcap > 0:
        features.append("softcap")
    if torch.are_deterministic_algorithms_enabled():
        features.append("deterministic")
        if p.is_local:
            features.append("deterministic order and a window")
        if varlen:
            features.append("deterministic order on packed sequences")
    for feature in features:
        if (p.head_dim, feature) in BWD_UNVERIFIED:
            return (
                f"fa3 backward at head_dim {p.head_dim} with {feature} compiled but not yet run "
                "on a GPU"
            )
    return ""


def _bwd_config(p: AttnParams, cfg: BwdConfig | None, varlen: bool = False) -> BwdConfig:
    """`cfg` or the tile table's config for `p` (`varlen`: packed sequences). Under
    torch.use_deterministic_algorithms the dQ adds are ordered (BwdConfig.deterministic,
    docs/design.md): 64-row Q tiles, the same tiles, layout and rings, per-element atomics, one
    sdS buffer and the serial issue order, the deterministic build that has run on the H200
    (at D = 64 / 128)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    if cfg is None:
        cfg = bwd_config_for(
            p.head_dim, p.dtype, p.causal, p.softcap > 0, sdq=deterministic, local=p.is_local,
            varlen=varlen,
        )  # fmt: skip
    if deterministic and not cfg.deterministic:
        cfg = ordered_config(cfg)
    return cfg


def ordered_config(cfg: BwdConfig) -> BwdConfig:
    """`cfg` with its dQ adds ordered (the deterministic build): 64-row Q tiles, per-element
    atomics between the turn counter's wait and its release, one sdS buffer, the serial issue
    order, the default grid order, LSE and D read from shared memory with the -inf guard and
    the softmax scale on dS."""
    return replace(
        cfg,
        tile_m=64,  # per-element atomics: one m64 atom of dQ per warpgroup
        dq_mode="atomic",
        dq_split="d",
        dq_handoff="cta",
        ds_store="scalar",
        ds_stages=1,
        overlap=False,
        dv_before_fence=False,  # an overlapped-order option
        lpt=False,
        head_section=0,
        wg_slice=False,
        stats_shfl=False,  # D = 64's route (bwd_configs.D64_FA4_ROUTE): the build that ran
        scale_out=False,
        lse_guard=True,
        deterministic=True,
    )


def _bwd_key(p: AttnParams, cfg: BwdConfig, varlen: bool):
    """The backward's compile key for `p` and `cfg`, or a ValueError saying why `cfg` cannot
    run `p` (varlen: packed sequences, neither lpt nor head_section; a deterministic build
    orders its dQ by the MMA threads' atomics)."""
    from flashsuite.fa3.bwd_host import BwdCompileKey

    ok, reason = bwd_can_implement(
        cfg, p.head_dim, p.dtype, causal=p.causal, local=p.is_local, varlen=varlen
    )
    if ok and p.softcap > 0 and cfg.overlap:
        ok, reason = False, "softcap needs overlap False (dS takes tanh' in P's loop)"
    if ok and varlen and (cfg.lpt or cfg.head_section):
        ok, reason = False, "varlen builds take neither lpt nor head_section configs"
    if ok and varlen and cfg.deterministic and cfg.dq_mode != "atomic":
        ok, reason = False, "varlen deterministic builds need dq_mode 'atomic'"
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
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the input dtype, contiguous, for what `supports_backward` accepts; `dlse`
    (B, Hq, Nq) float32, the gradient reaching the LSE (None: 0).

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
    from flashsuite.fa3.interface import _tma_ready

    key = _table_bwd_key(p) if cfg is None else _bwd_key(p, _bwd_config(p, cfg), varlen=False)
    # The incoming gradient may be any view (e.g. expanded from a sum: strides 0).
    if dout.stride(-1) != 1 or 0 in dout.stride():
        dout = dout.contiguous()
    dout = _tma_ready(dout)
    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    out, lse = out.contiguous(), lse.contiguous()
    window = (p.window_left, p.window_right) if p.is_local else (-1, -1)
    return run_backward(key, dout, q, k, v, out, lse, p.scale, p.softcap, window, dlse)


def supports_varlen_backward(vp: VarlenParams, arch: int | None) -> tuple[bool, str]:
    """Whether fa3's own backward (bwd_varlen.py) takes packed sequences `vp` on `arch`: the
    varlen forward's limits, the dense backward's head dims and configs (under
    torch.use_deterministic_algorithms the ordered build, its turn counters per sequence), kv
    heads within grid dim y. Memoised per problem, architecture and deterministic-algorithms
    setting."""
    return _memoised_support(_supports_varlen_backward, vp, arch)


def _supports_varlen_backward(vp: VarlenParams, arch: int | None) -> tuple[bool, str]:
    from flashsuite.fa3.interface import _MAX_GRID_YZ, supports_varlen

    ok, reason = supports_varlen(vp, arch)
    if not ok:
        return False, reason
    p = vp.attn
    if p.head_dim not in BWD_HEAD_DIMS:
        dims = ", ".join(map(str, BWD_HEAD_DIMS))
        return False, f"fa3 varlen backward: head_dim {p.head_dim} not in {{{dims}}}"
    if p.heads_kv > _MAX_GRID_YZ:
        return False, f"fa3 varlen backward: heads_kv {p.heads_kv} must be <= {_MAX_GRID_YZ}"
    cfg = _bwd_config(p, None, varlen=True)
    ok, reason = bwd_can_implement(
        cfg, p.head_dim, p.dtype, causal=p.causal, local=p.is_local, varlen=True
    )
    if not ok:
        return False, reason
    order = ", dQ in column-block order (deterministic)" if cfg.deterministic else ""
    return True, (
        f"fa3 varlen backward: {cfg.tile_m}x{cfg.tile_n} tiles on a virtual column-block grid "
        f"(per-sequence TMA bounds){order}"
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
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv in the input dtype, contiguous, of `varlen_forward`, for what
    `supports_varlen_backward` accepts: dout, q, out (total_q, Hq, D), k, v (total_k, Hkv, D)
    last dim contiguous, lse (Hq, total_q) float32 (natural log), cu_seqlens_q/k (B + 1,) int32
    (validated by the caller). `cfg` overrides the table's config (neither lpt nor
    head_section);
    `grads` (contiguous dq, dk, dv: views into larger buffers, in tests that watch the memory
    around them) are written in place instead of new tensors. `dlse` (Hq, total_q) float32:
    the gradient reaching the LSE (None: 0)."""
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
    from flashsuite.fa3.interface import _tma_ready_packed

    if cfg is None:
        mkey = (vp, torch.are_deterministic_algorithms_enabled())
        key = _bwd_keys.get(mkey)
        if key is None:
            key = _bwd_key(p, _bwd_config(p, None, varlen=True), varlen=True)
            remember(_bwd_keys, mkey, key)
    else:
        key = _bwd_key(p, cfg, varlen=True)
    if dout.stride(-1) != 1 or 0 in dout.stride():
        dout = dout.contiguous()  # any view of the incoming gradient (e.g. expanded: strides 0)
    q, k, v, dout = (_tma_ready_packed(t) for t in (q, k, v, dout))
    out = out if out.stride(-1) == 1 else out.contiguous()
    lse, cu_seqlens_q, cu_seqlens_k = (t.contiguous() for t in (lse, cu_seqlens_q, cu_seqlens_k))
    window = (p.window_left, p.window_right) if p.is_local else (-1, -1)
    return run_varlen_backward(
        key, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, p.scale, p.softcap, window,
        grads, dlse,
    )  # fmt: skip
