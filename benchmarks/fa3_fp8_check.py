"""fa3's fp8 forward: compile probe (no GPU) and the H200 check (correctness, then TFLOP/s).

    python -m benchmarks.fa3_fp8_check --probe [--json F] [--head-dim D]   # sm_90a, no GPU
    python -m benchmarks.fa3_fp8_check --out DIR [--smoke] [--skip-bench]   # on the H200
    python -m benchmarks.fa3_fp8_check --out DIR --ablate [--head-dim D]   # H200: the variants
    python -m benchmarks.fa3_fp8_check --out DIR --vt [--head-dim D]   # H200: Vᵀ host vs smem

--probe compiles every fp8 table entry (configs.FP8_CONFIGS; causal and not) and reports PTX
instruction counts, ptxas registers / spills / C75xx remarks and CuTe's fragment layouts that
the P exchange relies on (fp8_ops.quad_exchange). CUTE_DSL_* is read at import: this module sets it
before it imports the DSL, so run it in its own process.

The GPU run writes DIR/fa3_fp8.json:
1. correctness against common.reference (fp8 with descales; the tiny case first, a watchdog
   ends the run if a case hangs): D 64/96/128/192/256, causal or not, odd Nq/Nk, GQA/MQA,
   descales None or random in [0.5, 2], window, softcap, large scores. Yardstick (docs/design.md's
   rule with an fp8 "own error"): max|fa3 - ref| <= 2 max|emu - ref| + bf16 rounding for out,
   emu being the oracle with P rounded to e4m3 as the kernel does (row sums stay fp32); the
   LSE is held to the bf16-maths error of the same dequantised problem.
2. TFLOP/s at B·N = 16k, Hq·D = 2048, N 8192/16384, D 64/128/256, causal or not: fa3 fp8
   (with and without the Vᵀ copy), fa3 bf16 and SDPA cuDNN bf16 at the same shape, same run.

--vt (DIR/fa3_fp8_vt.json) compares who transposes V (Fa3Config.v_transpose): the table's
"host" build and its "smem" twin (configs.fp8_smem_transpose_config), each first on 3 small
oracle cases (a failing build is not timed), then TFLOP/s of the user's call,
fa3.interface.forward on an untransposed V (the host build's Vᵀ copy included), at N 4k/16k.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from flashsuite.common.testing import hang_watchdog

_HANG_S = 90  # seconds one correctness case may take (compiles included)


def _log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# compile probe (CPU)
# ------------------------------------------------------------------------------------------------
def _probe_env() -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ["CUTE_DSL_COMPILER_OPT"] = "remarks{ptx}"  # ptxas -v output on stderr
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"  # a cache hit would skip ptxas
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"  # the cubin for its highest register
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="fa3_fp8_probe_")
    atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], ignore_errors=True)


FP8_PTX_PATTERNS = {
    "wgmma_e4m3": r"wgmma\.mma_async[^\n]*\.e4m3\.e4m3",
    "shfl_idx": r"shfl\.sync\.idx",
    "prmt": r"prmt\.b32",
    "cvt_e4m3x2": r"cvt\.rn\.satfinite\.e4m3x2\.f32",
    # v_transpose="smem": the producer warpgroup's V -> Vᵀ (fp8_ops.transpose_block)
    "ldmatrix_trans": r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16",
    "stmatrix_b16x4": r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16",
    "fence_proxy_async": r"fence\.proxy\.async\.shared::cta",
    "mbarrier_arrive": r"mbarrier\.arrive(?!\.expect_tx)",
}


def fragment_layouts() -> dict[str, str]:
    """CuTe's thread-value layouts of the fp8 PV MMA (A, C) and a thread's A/C fragments."""
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass import Float8E4M3FN, Float32
    from cutlass.cute.nvgpu import warpgroup

    out: dict[str, str] = {}

    @cute.jit
    def trace():
        major = cute.nvgpu.OperandMajorMode
        mma = sm90.make_trivial_tiled_mma(
            Float8E4M3FN,
            Float8E4M3FN,
            major.K,
            major.K,
            Float32,
            (2, 1, 1),
            (64, 128),
            a_source=warpgroup.OperandSource.RMEM,
        )
        thr = mma.get_slice(0)
        out["tv_A"] = str(mma.tv_layout_A)
        out["tv_C"] = str(mma.tv_layout_C)
        out["frag_A"] = str(thr.make_fragment_A(thr.partition_shape_A((128, 128))).layout)
        out["frag_C"] = str(thr.make_fragment_C(thr.partition_shape_C((128, 128))).layout)

    trace()
    return out


def _cpu_call_error(
    compiled: Any, head_dim: int, causal: bool, cfg: Any, fp8_blocks: bool = False
) -> str:
    """The binary called with CPU tensors of a ragged problem (Nq 17, Nk 41, GQA 2/1), V as
    fa3.interface hands it over (Vᵀ from `transpose_v`, keys rounded up to 32 when permuted):
    the error it raises. Arguments the binary accepts leave only its device check to fail.
    `fp8_blocks`: the descales as the per-block build takes them (interface._block_descale:
    q per query head in blocks of 8 rows, k per head as one block, v per key tile)."""
    import torch

    from flashsuite.fa3.compile import kernel_scalars
    from flashsuite.fa3.configs import FP8_DTYPE
    from flashsuite.fa3.interface import transpose_v

    nq, nk, d = 17, 41, head_dim
    q = torch.zeros(1, nq, 2, d, dtype=FP8_DTYPE)
    k = torch.zeros(1, nk, 1, d, dtype=FP8_DTYPE)
    v = torch.zeros(1, nk, 1, d, dtype=FP8_DTYPE)
    if cfg.v_transpose == "host":
        v = transpose_v(v, cfg.permute_v_keys)
    out = torch.zeros(1, nq, 2, d, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, nq)
    descales = [torch.ones(1, 1) for _ in range(3)]
    if fp8_blocks:
        from flashsuite.common.fp8 import block_view
        from flashsuite.fa3.interface import _block_descale

        views = (
            block_view(torch.ones(1, 2, 3), 8),
            torch.ones(1, 1),
            block_view(torch.ones(1, 1, 1), cfg.tile_n),
        )
        descales = [_block_descale(t, 1, 1, "cpu") for t in views]
    scalars = kernel_scalars(d**-0.5, 0.0, (-1, -1), causal, nq, nk)
    try:
        compiled(q, k, v, out, lse, *descales, None, None, *scalars, 132)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def probe_one(
    head_dim: int,
    causal: bool,
    cfg: Any = None,
    local: bool = False,
    softcap: bool = False,
    fp8_blocks: bool = False,
    signature: bool = True,
) -> dict:
    """Compile one fp8 config (`fp8_blocks`: its per-block descale build); PTX counts, ptxas
    registers / spills / remarks, and with `signature` (and apache-tvm-ffi) what the binary's
    argument check says of the CPU tensors fa3.interface would hand it (about 1.3 s a build)."""
    from benchmarks.fa3_bwd_probe import max_register
    from benchmarks.fa3_probe import _capture_fd2, parse_ptxas, ptx_counts
    from flashsuite.fa3.compile import CompileKey, compile_forward
    from flashsuite.fa3.configs import FP8_DTYPE, get_config, smem_bytes

    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    cfg = cfg if cfg is not None else get_config(head_dim, FP8_DTYPE, causal)
    key = CompileKey(
        FP8_DTYPE, head_dim, causal, local, softcap, cfg, tvm_ffi=tvm, fp8_blocks=fp8_blocks
    )
    t0 = time.perf_counter()
    compiled, log = _capture_fd2(lambda: compile_forward(key))
    ptx = getattr(compiled, "__ptx__", None) or ""
    counts = ptx_counts(ptx)
    counts.update({k: len(re.findall(p, ptx)) for k, p in FP8_PTX_PATTERNS.items()})
    checked = None  # what the binary's argument check says of CPU tensors
    if tvm and signature:
        checked = _cpu_call_error(compiled, head_dim, causal, cfg, fp8_blocks)
    return {
        "signature": checked,
        "fp8_blocks": fp8_blocks,
        "head_dim": head_dim,
        "causal": causal,
        "local": local,
        "softcap": softcap,
        "config": asdict(cfg),
        "smem": smem_bytes(cfg, head_dim, FP8_DTYPE),
        "compile_s": round(time.perf_counter() - t0, 2),
        "max_reg": max_register(getattr(compiled, "__cubin__", None)),
        "ptx": counts,
        **parse_ptxas(log),
    }


def run_probe(head_dims: list[int] | None, json_path: str | None, variants: bool) -> int:
    _probe_env()
    from benchmarks.fa3_variants import fp8_variants
    from flashsuite.fa3.configs import (
        FP8_CAUSAL_SHORT,
        FP8_DTYPE,
        _plain,
        fp8_block_config,
        fp8_key_order_config,
        fp8_shipped_configs,
        fp8_smem_transpose_config,
        get_config,
    )

    cases = [("shipped", d, c, cfg) for d, _, c, cfg in fp8_shipped_configs()]
    # The left-window mask and softcap paths (descale_q·descale_k folds into tanh's argument).
    cases.append(("window_softcap", 128, False, get_config(128, FP8_DTYPE, False)))
    # V transposed in shared memory by the producer warpgroup (shipped for short keys).
    cases += [
        ("vt_smem", d, c, fp8_smem_transpose_config(d, c)) for d in (64, 128, 256) for c in (0, 1)
    ]
    cases.append(("vt_window_softcap", 128, False, fp8_smem_transpose_config(128, False)))
    # The host-Vᵀ builds of the persistent entries on the plain grid, what the smem builds are
    # compared with (the scheduler changes the barrier counts).
    cases += [
        ("host_plain", d, c, _plain(cfg))
        for d, _, c, cfg in fp8_shipped_configs()
        if cfg.persistent
    ]
    # V's keys permuted on the host at D = 64 (Fa3Config.permute_v_keys): Vᵀ runs past Nk.
    host64 = replace(get_config(64, FP8_DTYPE, False), v_transpose="host")
    cases.append(("host_permuted_keys", 64, False, replace(host64, permute_v_keys=True)))
    # What a keys-major V runs where the entry permutes V's keys (D = 128: the two-WG tile),
    # and the causal builds that replace the entry up to a key length (FP8_CAUSAL_SHORT).
    cases.append(("host_key_order", 128, False, fp8_key_order_config(128, False)))
    cases += [("causal_short", d, True, cfg) for d, (_, cfg) in FP8_CAUSAL_SHORT.items()]
    # Per-block descales (FP8_BLOCKS): the table's host-Vᵀ and shared-memory-Vᵀ builds, and
    # the window + softcap paths (k's descale joins tanh's argument per row).
    cases += [
        ("blocks", d, c, fp8_block_config(get_config(d, FP8_DTYPE, c), d, c, 0))
        for d in (64, 128, 256)
        for c in (0, 1)
    ]
    cases += [("blocks_vt_smem", d, 1, fp8_smem_transpose_config(d, True)) for d in (128, 256)]
    cases.append(("blocks_window_softcap", 128, False, get_config(128, FP8_DTYPE, False)))
    if variants:  # the ablation candidates, non-causal (the barrier protocol does not change)
        done = {(n, d) for n, d, _, _ in cases}
        cases += [
            (n, d, False, cfg)
            for n, d, cfg in fp8_variants()
            if n != "shipped" and (n, d) not in done
        ]
    results: dict[str, Any] = {"layouts": fragment_layouts(), "configs": []}
    for name, d, causal, cfg in cases:
        if head_dims and d not in head_dims:
            continue
        extra = name in ("window_softcap", "vt_window_softcap", "blocks_window_softcap")
        blocks = name.startswith("blocks")
        # The binaries' argument checks are read at D = 64, where every kind of build is.
        r = {"name": name, **probe_one(d, causal, cfg, extra, extra, blocks, signature=d == 64)}
        results["configs"].append(r)
        if not json_path:
            _log(
                f"{name:20s} D={d:3d} causal={causal!s:5s} regs={r['registers']} "
                f"spill={r['spill_stores']}/{r['spill_loads']} remarks={r['remarks']} "
                f"smem={r['smem']} {r['compile_s']}s {r['ptx']}"
            )
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    else:
        _log(json.dumps(results["layouts"]))
    return 0


# ------------------------------------------------------------------------------------------------
# GPU check
# ------------------------------------------------------------------------------------------------
F8 = torch.float8_e4m3fn
DEV = "cuda"


def _inputs(c: dict, seed: int = 0) -> tuple:
    """fp8 q, k, v (values spread over e4m3's range) and descales (B, Hkv) or None."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    b, nq, nk, hq, hkv, d = (c[x] for x in ("b", "nq", "nk", "hq", "hkv", "d"))
    amp = c.get("amp", 1.0)  # standard normal times amp: well inside e4m3's +-448

    def rnd(*shape):
        return (torch.randn(shape, generator=g, device=DEV) * amp).to(F8)

    q, k, v = rnd(b, nq, hq, d), rnd(b, nk, hkv, d), rnd(b, nk, hkv, d)  # (B, N, H, D)
    ds = [None, None, None]
    if c.get("descale", False):
        # log-uniform in [1/2, 2], per (batch, kv head), different for q, k and v
        ds = [2.0 ** (2 * torch.rand((b, hkv), generator=g, device=DEV) - 1) for _ in range(3)]
    return q, k, v, ds


def _emulated_out(q, k, v, ds, opts: dict) -> torch.Tensor:
    """The oracle with P rounded to e4m3 as the kernel rounds it (P <= 1 against the running
    max; here against the final max), the row sum in fp32: the fp8 path's own error."""
    from flashsuite.common.reference import visibility_mask

    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    one = torch.ones(b, hkv, device=q.device)
    dq, dk, dv = (x if x is not None else one for x in ds)
    qf = q.float() * dq.repeat_interleave(g, 1)[:, None, :, None]  # (B, Nq, Hq, D)
    kf = (k.float() * dk[:, None, :, None]).repeat_interleave(g, 2)  # (B, Nk, Hq, D)
    vf = (v.float() * dv[:, None, :, None]).repeat_interleave(g, 2)  # (B, Nk, Hq, D)
    scale = opts.get("softmax_scale") or 1.0 / d**0.5
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale  # (B, Hq, Nq, Nk)
    if opts.get("softcap", 0.0) > 0:
        s = opts["softcap"] * torch.tanh(s / opts["softcap"])
    vis = visibility_mask(
        nq, nk, causal=opts["causal"], window_size=opts["window_size"], device=q.device
    )
    s = s.masked_fill(~vis, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # (B, Hq, Nq, 1)
    p = torch.exp(s - m)  # (B, Hq, Nq, Nk)
    denom = p.sum(-1, keepdim=True)
    p8 = p.to(F8).float()  # P as the PV wgmma sees it
    out = torch.einsum("bhqk,bkhd->bqhd", p8, vf)  # (B, Nq, Hq, D)
    denom = torch.where(denom == 0, torch.ones_like(denom), denom).transpose(1, 2)  # (B,Nq,Hq,1)
    return out / denom


def check_case(c: dict, cfg: Any = None) -> dict:
    from flashsuite.common.reference import attention_reference
    from flashsuite.common.testing import compare
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface

    opts = {
        "causal": c.get("causal", False),
        "window_size": c.get("window", (-1, -1)),
        "softcap": c.get("softcap", 0.0),
        "softmax_scale": c.get("scale"),
    }
    q, k, v, ds = _inputs(c)
    dkw = dict(zip(("descale_q", "descale_k", "descale_v"), ds, strict=True))
    p = check_inputs(q, k, v, **opts, **dkw)
    ok, reason = interface.supports(p, 90)
    if not ok:
        return {"status": "UNSUPPORTED", "reason": reason}
    out, lse = interface.forward(q, k, v, p, *ds, cfg=cfg)
    if out.is_cuda:
        torch.cuda.synchronize()
    ref_out, ref_lse = attention_reference(q, k, v, **opts, **dkw)
    emu = _emulated_out(q, k, v, ds, opts)
    # The LSE's yardstick: the same dequantised problem in bf16 maths.
    one = torch.ones(p.batch, p.heads_kv, device=DEV)
    g = p.group_size
    deq = [
        (t.float() * (d if d is not None else one).repeat_interleave(r, 1)[:, None, :, None])
        for t, d, r in ((q, ds[0], g), (k, ds[1], 1), (v, ds[2], 1))
    ]
    _, pt_lse = attention_reference(
        *(t.to(torch.bfloat16) for t in deq), **opts, compute_dtype=None
    )
    c_out = compare("out", out, ref_out, emu, dtype=torch.bfloat16)
    c_lse = compare("lse", lse, ref_lse, pt_lse, dtype=torch.float32)
    # fp8's own max error is large (P keeps 3 mantissa bits), so a systematic error (a wrong
    # descale, a few % off everywhere) can hide under it: the mean error must match too.
    mean_err = (out.float() - ref_out).abs().mean().item()
    fin = ref_out.abs()  # (B, Nq, Hq, D): the bf16 output's own rounding is ~eps/2 of it
    mean_bound = (1.5 * (emu - ref_out).abs() + torch.finfo(torch.bfloat16).eps * fin).mean().item()
    ok = c_out.ok and c_lse.ok and mean_err <= mean_bound
    return {
        "status": "PASS" if ok else "FAIL",
        "out_mean_err": mean_err,
        "out_mean_bound": mean_bound,
        "out_err": c_out.err,
        "out_bound": c_out.bound,
        "lse_err": c_lse.err,
        "lse_bound": c_lse.bound,
        "out_dtype": str(out.dtype),
    }


def correctness_cases(smoke: bool = False) -> list[dict]:
    cases = [dict(b=1, nq=128, nk=128, hq=1, hkv=1, d=128)]  # tiny first: a hang shows at once
    if smoke:
        return [*cases, dict(b=2, nq=300, nk=513, hq=4, hkv=2, d=64, causal=True, descale=True)]
    for d in (64, 96, 128, 192, 256):
        for causal in (False, True):
            for nq, nk in ((1, 1), (17, 17), (1000, 1000), (17, 1000), (1000, 17), (128, 384)):
                for descale in (False, True):
                    cases.append(
                        dict(b=2, nq=nq, nk=nk, hq=4, hkv=2, d=d, causal=causal, descale=descale)
                    )
    for d in (64, 128, 256):
        base = dict(b=1, nq=777, nk=1000, hq=6, hkv=1, d=d, descale=True)  # MQA
        cases += [
            base,
            {**base, "window": (100, 50)},
            {**base, "window": (64, 0), "causal": True},
            {**base, "softcap": 30.0},
            {**base, "scale": 0.3, "causal": True},
            {**base, "nq": 2000, "nk": 300, "causal": True},  # rows that see no key
            {**base, "amp": 4.0},  # large scores: a peaked softmax, |v| up to ~20
            # causal past FP8_CAUSAL_SHORT's 1k keys (D = 128's three-WG causal entry)
            {**base, "nq": 1500, "nk": 2500, "causal": True},
            {**base, "nq": 2500, "nk": 2500, "causal": True, "window": (300, 0)},
        ]
    return cases


def _case_name(c: dict) -> str:
    keys = ("causal", "window", "softcap", "scale", "descale", "amp")
    extra = "".join(f" {k}={c[k]}" for k in keys if c.get(k))
    return f"B={c['b']} Nq={c['nq']} Nk={c['nk']} Hq={c['hq']}/{c['hkv']} D={c['d']}{extra}"


def run_correctness(
    smoke: bool, changes: dict | None = None, head_dims: list[int] | None = None
) -> list[dict]:
    """The oracle cases through the table's config for each, with `changes` (Fa3Config fields,
    --set) applied to it when given; `head_dims`: only the cases of these."""
    from flashsuite.fa3.configs import FP8_DTYPE, get_config

    rows = []
    for c in correctness_cases(smoke):
        if head_dims and c["d"] not in head_dims:
            continue
        with hang_watchdog(_HANG_S):  # a barrier bug hangs
            try:
                cfg = None
                if changes:  # the table's entry for the case (fp8: head dim, causal, Nk)
                    table = get_config(c["d"], FP8_DTYPE, c.get("causal", False), c["nk"])
                    cfg = replace(table, **changes)
                r = check_case(c, cfg=cfg)
            except Exception as e:
                r = {"status": "ERROR", "error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
        err = (
            f"out {r['out_err']:.3g} (<= {r['out_bound']:.3g}) "
            f"mean {r['out_mean_err']:.3g} (<= {r['out_mean_bound']:.3g}) "
            f"lse {r['lse_err']:.3g} (<= {r['lse_bound']:.3g})"
            if "out_err" in r
            else r.get("reason", r.get("error", ""))
        )
        _log(f"[correctness] {r['status']:5s} {_case_name(c)} {err}")
        rows.append({"case": _case_name(c), **r})
    return rows


def _ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_one(d: int, n: int, causal: bool, cfg: Any = None, peers: bool = True) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashsuite.common.flops import attention_flops
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.compile import CompileKey, get_forward, kernel_scalars
    from flashsuite.fa3.configs import FP8_DTYPE, get_config

    b, h = max(1, 16384 // n), 2048 // d
    q, k, v, ds = _inputs(dict(b=b, nq=n, nk=n, hq=h, hkv=h, d=d, descale=True))
    p8 = check_inputs(q, k, v, causal=causal)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    pb = check_inputs(qb, kb, vb, causal=causal)
    qt, kt, vt_ = (t.transpose(1, 2) for t in (qb, kb, vb))  # (B, H, N, D)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt_, is_causal=causal)

    cfg = cfg if cfg is not None else get_config(d, FP8_DTYPE, causal)
    vt = interface.transpose_v(v, cfg.permute_v_keys)
    kern = get_forward(CompileKey(FP8_DTYPE, d, causal, False, False, cfg))
    out = torch.empty((b, n, h, d), dtype=torch.bfloat16, device=DEV)
    lse = torch.empty((b, h, n), dtype=torch.float32, device=DEV)
    sc = kernel_scalars(p8.scale, 0.0, (p8.window_left, p8.window_right), causal, n, n)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count  # persistent grid
    timings = {
        "fa3_fp8": lambda: interface.forward(q, k, v, p8, *ds, cfg=cfg),  # with the Vᵀ copy
        "fa3_fp8_kernel": lambda: kern(q, k, vt, out, lse, *ds, None, None, *sc, sms),
    }
    if peers:
        timings["vt_copy"] = lambda: interface.transpose_v(v)
        timings["fa3_bf16"] = lambda: interface.forward(qb, kb, vb, pb)
        timings["cudnn_bf16"] = cudnn
    flops = attention_flops(b, h, n, n, d, causal=causal)
    row: dict[str, Any] = {"D": d, "N": n, "B": b, "H": h, "causal": causal}
    for name, fn in timings.items():
        try:
            ms = _ms(fn)
            row[f"{name}_ms"] = ms
            if name != "vt_copy":
                row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
        except Exception as e:
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"
    return row


def _describe(r: dict) -> str:
    tf = {k: round(v, 1) for k, v in r.items() if k.endswith(("_tflops", "_ms"))}
    return f"D={r['D']} N={r['N']} causal={r['causal']} {tf} {r.get('error', '')}"


def run_bench() -> list[dict]:
    from benchmarks.fa3_variants import bench_sweep

    return bench_sweep(bench_one, _describe)


def run_ablation(n: int = 8192, head_dims: list[int] | None = None) -> list[dict]:
    """Each fa3_variants.fp8_variants entry at D 64/128/256 (or `head_dims`): 3 small cases, then
    TFLOP/s (kernel alone and with the Vᵀ copy) at N = 8192, causal or not."""
    from benchmarks.fa3_variants import fp8_variants

    rows = []
    for name, d, cfg in fp8_variants():
        if d not in (head_dims or (64, 128, 256)):
            continue
        row: dict[str, Any] = {"variant": name, "D": d, "config": asdict(cfg)}
        statuses = []
        for c in _small_cases(d):
            with hang_watchdog(_HANG_S):
                try:
                    statuses.append(check_case(c, cfg=cfg)["status"])
                except Exception as e:
                    statuses.append(f"ERROR {type(e).__name__}: {e}")
        row["correct"] = statuses
        if all(st == "PASS" for st in statuses):
            for causal in (False, True):
                r = bench_one(d, n, causal, cfg=cfg, peers=False)
                for key in ("fa3_fp8_tflops", "fa3_fp8_kernel_tflops"):
                    row[f"{key}_causal_{causal}"] = r.get(key)
        _log(f"[ablation] D={d} {name:20s} {statuses} {row}")
        rows.append(row)
    return rows


def _small_cases(d: int) -> list[dict]:
    small = dict(b=2, nq=1000, nk=1000, hq=4, hkv=2, d=d, descale=True)
    return [small, {**small, "causal": True}, {**small, "nq": 17, "nk": 700}]


def run_vt_compare(head_dims: list[int] | None = None) -> list[dict]:
    """Vᵀ by the host vs in shared memory: correctness (3 cases each), then TFLOP/s of the
    whole call at B·N = 16k, Hq·D = 2048, N 4k / 16k, causal or not, D 64 / 128 / 256."""
    from flashsuite.common.flops import attention_flops
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import FP8_DTYPE, fp8_smem_transpose_config, get_config

    rows = []
    for d in head_dims or (64, 128, 256):
        for causal in (False, True):
            builds = {
                "host": replace(get_config(d, FP8_DTYPE, causal), v_transpose="host"),
                "smem": fp8_smem_transpose_config(d, causal),
            }
            ok = {}
            for name, cfg in builds.items():
                statuses = []
                small = dict(b=2, nq=1000, nk=1000, hq=4, hkv=2, d=d, descale=True, causal=causal)
                mqa = {**small, "b": 1, "nq": 777, "hq": 6, "hkv": 1}
                for c in (small, {**small, "nq": 17, "nk": 700}, mqa):
                    with hang_watchdog(_HANG_S):
                        try:
                            statuses.append(check_case(c, cfg=cfg)["status"])
                        except Exception as e:
                            statuses.append(f"ERROR {type(e).__name__}: {e}")
                ok[name] = all(st == "PASS" for st in statuses)
                _log(f"[vt] D={d} causal={causal} {name}: {statuses}")
                rows.append({"D": d, "causal": causal, "build": name, "correct": statuses})
            for n in (4096, 16384):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, ds = _inputs(dict(b=b, nq=n, nk=n, hq=h, hkv=h, d=d, descale=True))
                p8 = check_inputs(q, k, v, causal=causal)
                flops = attention_flops(b, h, n, n, d, causal=causal)
                row: dict[str, Any] = {"D": d, "N": n, "causal": causal}
                for name, cfg in builds.items():
                    row[f"{name}_config"] = asdict(cfg)
                    if not ok[name]:
                        row[f"{name}_error"] = "failed its oracle cases: not timed"
                        continue
                    with hang_watchdog(_HANG_S):
                        args = (q, k, v, p8, *ds)
                        ms = _ms(lambda a=args, c=cfg: interface.forward(*a, cfg=c))
                    row[f"{name}_ms"] = ms
                    row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
                if "host_ms" in row and "smem_ms" in row:
                    row["smem_speedup"] = row["host_ms"] / row["smem_ms"]
                _log(f"[vt] {_describe(row)} speedup={row.get('smem_speedup')}")
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--probe", action="store_true", help="compile for sm_90a only (no GPU)")
    ap.add_argument("--json", help="--probe: write the results here")
    ap.add_argument("--head-dim", type=int, action="append", help="only these head dims")
    ap.add_argument(
        "--variants", action="store_true", help="--probe: also fa3_variants.fp8_variants"
    )
    ap.add_argument(
        "--ablate",
        action="store_true",
        help="GPU run: only fa3_variants.fp8_variants (3 cases each, then TFLOP/s)",
    )
    ap.add_argument(
        "--vt", action="store_true", help="GPU run: Vᵀ by the host vs in shared memory only"
    )
    ap.add_argument("--out", help="GPU run: output folder")
    ap.add_argument("--smoke", action="store_true", help="GPU run: 3 small cases only")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="FIELD=VALUE: the correctness cases with this Fa3Config field changed (repeat)",
    )
    args = ap.parse_args(argv)
    if args.probe:
        return run_probe(args.head_dim, args.json, args.variants)
    if not args.out:
        ap.error("--out DIR is required for the GPU run")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name()}

    def save() -> None:
        (out / "fa3_fp8.json").write_text(json.dumps(res, indent=1, default=str))

    if args.vt:
        res["vt_compare"] = run_vt_compare(args.head_dim)
        (out / "fa3_fp8_vt.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    if args.ablate:  # the variants only, each checked on its own 3 small cases first
        res["ablation"] = run_ablation(head_dims=args.head_dim)
        save()
        return 0
    from benchmarks.fa3_fwd_ab import parse_variant

    try:
        _, changes = parse_variant("set:" + ",".join(args.set), table_ok=False)
    except ValueError as exc:
        ap.error(str(exc))
    res["changes"] = changes
    res["correctness"] = run_correctness(args.smoke, changes, args.head_dim)
    save()
    n_pass = sum(r["status"] == "PASS" for r in res["correctness"])
    _log(f"[correctness] {n_pass}/{len(res['correctness'])} PASS")
    if not args.skip_bench and not args.smoke:
        res["bench"] = run_bench()
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
