"""fa2 tile tuning: an sm_90a compile probe (runs on CPU) and an H200 timing sweep.

    python -m benchmarks.fa2_tune --probe            # every shipped config: regs/spills/smem/wgmma
    python -m benchmarks.fa2_tune --out DIR          # on the GPU: time candidates, write DIR/*.json
    python -m benchmarks.fa2_tune --quick-bwd --out DIR   # GPU, < 90 s: the D128/D256 backward

The sweep: bf16, B·N = 16k tokens, Hq·D = 2048, N in {2048, 8192}, D in {64, 128, 256}, causal
and not, forward and backward. Every candidate is first compiled for sm_90a and dropped if it
spills or its shared memory is over 232,448 B; the survivors are timed with
`triton.testing.do_bench(return_mode="median")` and checked against PyTorch SDPA (max abs error
printed), next to SDPA's flash (FA2 CUDA) and cuDNN backends in the same run.

`--quick-bwd` times only the backward, only N = 8192, D in {128, 256}, causal and not: the
shipped config and the few alternatives in QUICK_BWD_CANDIDATES, against SDPA-flash.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import torch

from flashsuite.fa2.configs import (
    KNOWN_SPILL_BYTES,
    SMEM_LIMIT,
    BwdConfig,
    FwdConfig,
    bwd_config,
    dkdv_launches,
    fwd_config,
    padded_head_dim,
    table,
)

# ----------------------------------------------------------------------------------------------
# Compile probe (no GPU needed)
# ----------------------------------------------------------------------------------------------

_FP32_PTRS = {"Lse", "Lse2", "Delta", "dQacc"}
_FP32_SCALARS = {"qk_scale", "softcap_log2", "scale"}
_TL_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _is_ptr(name: str) -> bool:
    return name[0].isupper() or (name[0] == "d" and name[1].isupper())


def _compile_one(fn, dtype: torch.dtype, constexprs: dict, num_warps: int, num_stages: int):
    """Compile `fn` for sm_90a as the launcher would specialise it (16-aligned pointers and
    strides, lse contiguous) and return (registers, spill bytes, shared bytes, wgmma, mma.sync)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    if "stride_lm" in fn.arg_names:
        constexprs["stride_lm"] = 1  # lse is (B, Hq, Nq) contiguous: Triton specialises 1
    sig, attrs = {}, {}
    for i, prm in enumerate(fn.params):
        name = prm.name
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name == "dQacc" and constexprs.get("DQ_ATOMIC"):
            # TMA reduce-add target: the host TensorDescriptor of interface.backward
            block = f"{constexprs['BLOCK_M']}, {constexprs['D_PAD']}"
            sig[name] = f"tensordesc<fp32[{block}]>"
        elif _is_ptr(name):
            sig[name] = "*fp32" if name in _FP32_PTRS else f"*{_TL_DTYPE[dtype]}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FP32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and not name.startswith("stride_l"):
                attrs[(i,)] = [["tt.divisibility", 16]]  # (B, N, H, D) strides of 16-B rows
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = kernel.asm["ptx"]
    ptxas = get_ptxas(90).path
    with open(os.devnull, "w") as null:
        path = f"/tmp/fa2_probe_{os.getpid()}_{fn.__name__}.ptx"
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
            capture_output=True,
            text=True,
            stdin=null,
        ).stderr
        os.remove(path)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return {
        "regs": regs,
        "spill": spill,
        "smem": int(kernel.metadata.shared),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "tma_reduce": ptx.count("cp.reduce.async.bulk"),
    }


def _flags(head_dim: int, causal: bool, dtype: torch.dtype, head_dim_v: int | None = None):
    dv = head_dim_v or head_dim
    return dict(
        HAS_LEFT=False,
        HAS_RIGHT=causal,
        SOFTCAP=False,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=dv,
        D_PAD=padded_head_dim(head_dim, dtype, wgmma=True),
        DV_PAD=padded_head_dim(dv, dtype, wgmma=True),
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def probe(
    kind: str,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    cfg: FwdConfig | BwdConfig,
    extra_flags: dict | None = None,
) -> dict:
    """Compile one config for sm_90a. Returns per-kernel resources and `ok` (0 spills, shared
    memory within SMEM_LIMIT). kind: "fwd" or "bwd" (dK/dV kernel, plus dQ unless atomic).
    `extra_flags` overrides mask / score flags (HAS_LEFT, SOFTCAP) of the default build."""
    from flashsuite.fa2 import kernels

    flags = dict(_flags(head_dim, causal, dtype), **(extra_flags or {}))
    res: dict[str, dict] = {}
    if kind == "fwd":
        assert isinstance(cfg, FwdConfig)
        res["fwd"] = _compile_one(
            kernels._attn_fwd,
            dtype,
            dict(flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STORE_LSE=True),
            cfg.num_warps,
            cfg.num_stages,
        )
    else:
        assert isinstance(cfg, BwdConfig)
        for name, want_dk, want_dv in dkdv_launches(cfg):  # as interface.backward launches
            res[name] = _compile_one(
                kernels._bwd_dkdv,
                dtype,
                dict(
                    flags,
                    BLOCK_M=cfg.block_m1,
                    BLOCK_N=cfg.block_n1,
                    DQ_ATOMIC=cfg.dq_atomic and want_dk,
                    TAIL_STAGES=None if cfg.tail_pipelined else 1,
                    WANT_DK=want_dk,
                    WANT_DV=want_dv,
                ),
                cfg.num_warps,
                cfg.num_stages,
            )
        if not cfg.dq_atomic:
            res["dq"] = _compile_one(
                kernels._bwd_dq,
                dtype,
                dict(flags, BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2),
                cfg.num_warps_dq,
                cfg.num_stages_dq,
            )
    return {"ok": _fits(res, int(os.environ.get(_SPILL_ENV, "0"))), "kernels": res}


def _fits(kernels: dict[str, dict], spill_bytes: int) -> bool:
    """Every kernel within the shared-memory limit and spilling at most `spill_bytes`."""
    return bool(kernels) and all(
        k["spill"] <= spill_bytes and k["smem"] <= SMEM_LIMIT for k in kernels.values()
    )


def _probe_job(args):
    try:
        return probe(*args)
    except Exception as e:  # a config that does not compile is a failed probe, not a crash
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300], "kernels": {}}


def probe_many(jobs: list[tuple], workers: int | None = None) -> list[dict]:
    """Probe several (kind, head_dim, dtype, causal, cfg) in parallel processes."""
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    if workers == 1:
        return [_probe_job(j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_probe_job, jobs))


def _fmt_probe(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"]
    parts = [
        f"{k}: {v['regs']} regs, {v['spill']} B spill, {v['smem'] / 1024:.0f} KB, "
        f"{v['wgmma']} wgmma"
        + (f", {v['mma_sync']} mma.sync" if v["mma_sync"] else "")
        + (f", {v['tma_reduce']} TMA reduce" if v.get("tma_reduce") else "")
        for k, v in r["kernels"].items()
    ]
    return ("ok   " if r["ok"] else "FAIL ") + " | ".join(parts)


def probe_table(dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> bool:
    """Probe every shipped table entry (configs.table()); print one line each. True if all ok."""
    rows = [r for r in table() if r[2] in dtypes]
    results = probe_many(rows)
    all_ok = True
    for (kind, d, dtype, causal, cfg), r in zip(rows, results, strict=True):
        # Shipped entries: no spill, except the pinned KNOWN_SPILL_BYTES ones.
        r["ok"] = _fits(r["kernels"], KNOWN_SPILL_BYTES.get((kind, d, dtype, causal), 0))
        all_ok &= r["ok"]
        name = _TL_DTYPE[dtype]
        print(f"{kind} D{d:<3} {name} causal={causal!s:5} {_cfg_str(cfg):28} {_fmt_probe(r)}")
    return all_ok


def _cfg_str(cfg: FwdConfig | BwdConfig) -> str:
    if isinstance(cfg, FwdConfig):
        return f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
    dq = (
        "dq-atomic"
        if cfg.dq_atomic
        else f"dq {cfg.block_m2}x{cfg.block_n2} w{cfg.num_warps_dq} s{cfg.num_stages_dq}"
    )
    tail = " tail-pipe" if cfg.tail_pipelined else ""
    split = " split" if cfg.split_dkdv else ""
    return f"{cfg.block_m1}x{cfg.block_n1} w{cfg.num_warps} s{cfg.num_stages}{tail}{split} {dq}"


# ----------------------------------------------------------------------------------------------
# Timing sweep (GPU)
# ----------------------------------------------------------------------------------------------


# Spill bytes a candidate may have and still be timed (--allow-spill sets it; an environment
# variable so that the probe's worker processes see it whatever their start method).
_SPILL_ENV = "FLASHSUITE_FA2_TUNE_ALLOW_SPILL"
DEVICE = "cuda"  # a smoke test of the sweep's plumbing may set "cpu" under the interpreter


def _bwd(m1, n1, m2, n2, w, s, wq, sq, atomic=False, tail=False, split=False):
    return BwdConfig(
        m1, n1, m2, n2, w, s, wq, sq, dq_atomic=atomic, tail_pipelined=tail, split_dkdv=split
    )


# The shipped config (configs.fwd_config / bwd_config) is always timed first; these are the
# alternatives. Spilling or over-budget ones are dropped by the probe before any timing.
FWD_CANDIDATES: dict[int, list[FwdConfig]] = {
    64: [
        FwdConfig(128, 64, 8, 3),
        FwdConfig(128, 128, 8, 2),
        FwdConfig(128, 64, 4, 3),
        FwdConfig(64, 64, 4, 3),
    ],
    128: [
        FwdConfig(128, 64, 8, 4),
        FwdConfig(128, 64, 8, 2),
        FwdConfig(128, 32, 8, 3),
        FwdConfig(64, 64, 4, 3),
    ],
    256: [
        FwdConfig(128, 32, 8, 2),
        FwdConfig(128, 32, 8, 4),
        FwdConfig(64, 32, 4, 3),
    ],
}
BWD_CANDIDATES: dict[int, list[BwdConfig]] = {
    64: [
        _bwd(32, 128, 128, 64, 8, 3, 8, 3, atomic=True, tail=True),
        _bwd(32, 128, 128, 64, 8, 3, 8, 3, atomic=True),
        _bwd(64, 128, 128, 64, 8, 3, 8, 3, atomic=True),
        _bwd(32, 128, 128, 64, 8, 3, 8, 3),
        _bwd(64, 64, 128, 64, 8, 3, 8, 3),
        _bwd(64, 128, 128, 32, 8, 2, 8, 3),
    ],
    128: [
        _bwd(32, 128, 128, 64, 8, 2, 8, 3),
        _bwd(32, 128, 128, 64, 8, 2, 8, 3, tail=True),
        _bwd(32, 128, 128, 64, 8, 3, 8, 3, tail=True),
        _bwd(32, 64, 128, 64, 8, 2, 8, 3, atomic=True, tail=True),
        _bwd(16, 128, 128, 64, 8, 2, 8, 3, atomic=True, tail=True),
        _bwd(16, 64, 128, 64, 8, 1, 8, 3, atomic=True),
        _bwd(32, 64, 128, 64, 8, 2, 8, 3),
        _bwd(32, 64, 128, 64, 8, 1, 8, 3),
        _bwd(32, 128, 128, 64, 8, 2, 8, 3, atomic=True),
        _bwd(32, 64, 128, 64, 8, 2, 8, 3, atomic=True),
        _bwd(64, 32, 128, 32, 8, 2, 8, 3),
    ],
    256: [
        _bwd(64, 32, 128, 32, 8, 2, 8, 3),
        _bwd(16, 64, 128, 32, 8, 2, 8, 3, tail=True),
        _bwd(64, 32, 32, 32, 8, 2, 4, 2),
        _bwd(32, 32, 32, 32, 8, 2, 4, 2),
        _bwd(64, 32, 32, 32, 8, 2, 4, 2, atomic=True),
        _bwd(16, 128, 128, 32, 8, 2, 8, 3, split=True),
        _bwd(32, 64, 128, 32, 8, 2, 8, 3, tail=True, split=True),
        _bwd(16, 128, 32, 32, 8, 2, 4, 2, split=True),
    ],
}


# `--quick-bwd`: the alternatives worth one short GPU run, per (D, causal), next to the
# shipped config; every one compiles spill-free for sm_90a. Few distinct dQ kernels, so the
# run stays under ~90 s of compiling and timing. "atomic": dQ by TMA reduce-adds inside the
# dK/dV kernel (5 GEMMs per block pair instead of 7; no dQ pass).
QUICK_BWD_CANDIDATES: dict[tuple[int, bool], list[BwdConfig]] = {
    (64, False): [_bwd(32, 128, 128, 64, 8, 3, 8, 3, atomic=True, tail=True)],  # 227 regs
    (64, True): [_bwd(32, 128, 128, 64, 8, 3, 8, 3, atomic=True)],  # 236 regs
    (128, False): [
        _bwd(32, 128, 128, 64, 8, 3, 8, 3, tail=True),  # 255 regs, 113 KB
        _bwd(32, 64, 128, 64, 8, 2, 8, 3, atomic=True, tail=True),  # 254 regs
        _bwd(16, 128, 128, 64, 8, 2, 8, 3, atomic=True, tail=True),  # 250 regs
    ],
    (128, True): [
        _bwd(16, 64, 128, 64, 8, 1, 8, 3, atomic=True),  # 238 regs; s2 44 B spill
        _bwd(32, 128, 128, 64, 8, 3, 8, 3),  # 255 regs, 24 B spill (with --allow-spill)
        _bwd(16, 128, 128, 64, 8, 3, 8, 3, tail=True),  # 255 regs, 24 B spill
    ],
    # wgmma dK/dV (16 queries x 64 keys) against the shipped mma.sync 64x32; the split
    # dK/dV launches (dV, then dK) are the only spill-free wgmma tiles with 64+ keys
    # (probe 2026-11-29, regs dV / dK; 32x64 and 64x64 without tail-pipe spill 60-970 B).
    (256, False): [
        _bwd(16, 64, 128, 32, 8, 2, 8, 3, tail=True),  # 255 regs
        _bwd(16, 128, 128, 32, 8, 2, 8, 3, split=True),  # 248 / 255 regs, 96 / 160 KB
        _bwd(32, 64, 128, 32, 8, 2, 8, 3, tail=True, split=True),  # 235 / 255, 96 / 128 KB
    ],
    # Causal, unsplit, every wgmma dK/dV tile spills 0.6-1.2 KB. The causal dQ pass spills on
    # every wgmma tile too (128x32 s3 16 B, s2 40 B; 64x32 w8 40 B), so the shipped 32x32 w4
    # runs mma.sync; the second entry needs --allow-spill 16.
    (256, True): [
        _bwd(16, 128, 32, 32, 8, 2, 4, 2, split=True),  # 255 / 255 regs
        _bwd(16, 128, 128, 32, 8, 2, 8, 3, split=True),  # dQ: 16 B spill
    ],
}


def _candidates(kind: str, d: int, causal: bool, quick: bool = False) -> list:
    """Shipped config first, then the alternatives (deduplicated)."""
    if kind == "fwd":
        first, rest = fwd_config(d, torch.bfloat16, causal, 90), FWD_CANDIDATES[d]
    else:
        first = bwd_config(d, torch.bfloat16, causal, 90)
        rest = QUICK_BWD_CANDIDATES.get((d, causal), []) if quick else BWD_CANDIDATES[d]
    return [first] + [c for c in rest if c != first]


def _flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * n * n * d
    return f / 2 if causal else f


def _sdpa_times(q, k, v, do, causal, backend):
    """(fwd ms, bwd ms) of SDPA on one backend, or None if it refuses the shape."""
    import triton
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qh, kh, vh = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel([backend]):
            fwd = triton.testing.do_bench(
                lambda: sdpa(qh, kh, vh, is_causal=causal), return_mode="median"
            )
            o = sdpa(qh, kh, vh, is_causal=causal)
            doh = do.transpose(1, 2)
            bwd = triton.testing.do_bench(
                lambda: torch.autograd.grad(o, (qh, kh, vh), doh, retain_graph=True),
                return_mode="median",
            )
    except RuntimeError:
        return None
    return fwd, bwd


def _sdpa_ref(q, k, v, do, causal):
    """SDPA flash output and gradients in (B, N, H, D) layout: the accuracy yardstick."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qh, kh, vh = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = sdpa(qh, kh, vh, is_causal=causal)
        grads = torch.autograd.grad(o, (qh, kh, vh), do.transpose(1, 2))
    return o.transpose(1, 2), [g.transpose(1, 2) for g in grads]


def _time_one(kind, cfg, tensors, p, ref_o, ref_g, flops) -> dict:
    """Time one candidate (median ms), with its max abs error against SDPA-flash."""
    import triton

    from flashsuite.fa2 import interface

    q, k, v, do = tensors
    try:
        o, lse = interface.forward(q, k, v, p, config=cfg if kind == "fwd" else None)
        if kind == "fwd":
            err = (o.float() - ref_o.float()).abs().max().item()
            fn = lambda: interface.forward(q, k, v, p, config=cfg)
        else:
            grads = interface.backward(do, q, k, v, o, lse, p, config=cfg)
            err = max(
                (a.float() - r.float()).abs().max().item()
                for a, r in zip(grads, ref_g, strict=True)
            )
            fn = lambda: interface.backward(do, q, k, v, o, lse, p, config=cfg)
        ms = triton.testing.do_bench(fn, return_mode="median")
    except Exception as e:  # report and keep sweeping
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    work = flops if kind == "fwd" else 2.5 * flops
    return {"ms": ms, "tflops": work / ms * 1e-9, "max_abs_err": err}


def sweep(
    out_dir: str,
    head_dims: list[int],
    seqlens: list[int],
    tokens: int = 16384,
    hidden: int = 2048,
    quick_bwd: bool = False,
) -> dict:
    """Time every probed-ok candidate on the current GPU; print tables; write JSON.
    Shapes: B = tokens // N, Hq = hidden // D (the standard sweep). `quick_bwd`: backward
    only, QUICK_BWD_CANDIDATES, SDPA-flash only (no cuDNN)."""
    import triton
    from torch.nn.attention import SDPBackend

    from flashsuite.common.validation import check_inputs

    dtype = torch.bfloat16
    t_start = time.time()
    kinds = ("bwd",) if quick_bwd else ("fwd", "bwd")
    jobs, keys = [], []
    for d in head_dims:
        for causal in (False, True):
            for kind in kinds:
                for cfg in _candidates(kind, d, causal, quick_bwd):
                    jobs.append((kind, d, dtype, causal, cfg))
                    keys.append((kind, d, causal, cfg))
    t0 = time.time()
    probes = dict(zip(keys, probe_many(jobs), strict=True))
    print(f"probed {len(jobs)} candidates in {time.time() - t0:.0f} s", flush=True)

    results = []
    for d in head_dims:
        h = max(1, hidden // d)
        for n in seqlens:
            b = max(1, tokens // n)
            for causal in (False, True):
                torch.manual_seed(0)
                q = torch.randn(b, n, h, d, device=DEVICE, dtype=dtype)
                k = torch.randn(b, n, h, d, device=DEVICE, dtype=dtype)
                v = torch.randn(b, n, h, d, device=DEVICE, dtype=dtype)
                do = torch.randn(b, n, h, d, device=DEVICE, dtype=dtype)
                p = check_inputs(q, k, v, causal=causal)
                ref_o, ref_g = _sdpa_ref(q, k, v, do, causal)
                fl = _flops(b, h, n, d, causal)
                row = {"D": d, "N": n, "B": b, "H": h, "causal": causal, "fwd": [], "bwd": []}
                row["sdpa_cudnn"] = None
                peers = [("sdpa_flash", SDPBackend.FLASH_ATTENTION)]
                if not quick_bwd:
                    peers.append(("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION))
                for name, backend in peers:
                    t = _sdpa_times(q, k, v, do, causal, backend)
                    row[name] = None if t is None else {
                        "fwd_ms": t[0], "bwd_ms": t[1],
                        "fwd_tflops": fl / t[0] * 1e-9, "bwd_tflops": 2.5 * fl / t[1] * 1e-9,
                    }  # fmt: skip
                for kind in kinds:
                    for cfg in _candidates(kind, d, causal, quick_bwd):
                        pr = probes[(kind, d, causal, cfg)]
                        entry = {"config": asdict(cfg), "probe": pr}
                        if pr["ok"]:
                            entry.update(_time_one(kind, cfg, (q, k, v, do), p, ref_o, ref_g, fl))
                        row[kind].append(entry)
                _print_row(row)
                results.append(row)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "fa2_quick_bwd.json" if quick_bwd else "fa2_tune.json")
    meta = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "dtype": "bfloat16",
    }
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {path} ({time.time() - t_start:.0f} s in all)")
    _print_best(results)
    return {"meta": meta, "results": results}


def _print_row(row: dict) -> None:
    flash = row["sdpa_flash"]
    cudnn = row["sdpa_cudnn"]
    head = f"D={row['D']} N={row['N']} B={row['B']} H={row['H']} causal={row['causal']}"
    print(f"\n{head}")
    for kind in ("fwd", "bwd"):
        if not row[kind]:
            continue  # --quick-bwd: no forward candidates
        ref = flash[f"{kind}_tflops"] if flash else None
        peers = "  ".join(
            f"{nm} {pe[f'{kind}_tflops']:.0f}"
            for nm, pe in (("sdpa-flash", flash), ("sdpa-cudnn", cudnn))
            if pe
        )
        print(f"  {kind}: {peers} TFLOP/s")
        for e in row[kind]:
            c = e["config"]
            cfg = FwdConfig(**c) if kind == "fwd" else BwdConfig(**c)
            if "tflops" in e:
                ratio = f" {e['tflops'] / ref:.2f}x flash" if ref else ""
                bad = "  MISMATCH vs SDPA" if not e["max_abs_err"] < 0.1 else ""
                print(
                    f"    {_cfg_str(cfg):42} {e['tflops']:6.0f} TFLOP/s{ratio}  "
                    f"err {e['max_abs_err']:.1e}{bad}"
                )
            else:
                why = e.get("error") or _fmt_probe(e["probe"])
                print(f"    {_cfg_str(cfg):42} skipped: {why}")
    sys.stdout.flush()


def _print_best(results: list[dict]) -> None:
    print("\nbest per (D, causal, kind), mean TFLOP/s over N:")
    best: dict[tuple, dict[str, list[float]]] = {}
    for row in results:
        for kind in ("fwd", "bwd"):
            for e in row[kind]:
                if "tflops" in e:
                    key = (row["D"], row["causal"], kind)
                    best.setdefault(key, {}).setdefault(json.dumps(e["config"]), []).append(
                        e["tflops"]
                    )
    for (d, causal, kind), by_cfg in sorted(best.items()):
        cfg, tfs = max(by_cfg.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
        print(f"  D{d} causal={causal!s:5} {kind}: {sum(tfs) / len(tfs):.0f}  {cfg}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--probe", action="store_true", help="compile-probe the shipped table only")
    ap.add_argument("--fp32", action="store_true", help="with --probe: fp32 entries as well")
    ap.add_argument(
        "--quick-bwd",
        action="store_true",
        help="GPU, < 90 s: backward only, D 128/256, N 8192, shipped + QUICK_BWD_CANDIDATES",
    )
    ap.add_argument("--out", default="fa2_tune_out", help="folder for the sweep's JSON")
    ap.add_argument("--d", type=int, nargs="*", default=None, help="head dims")
    ap.add_argument("--n", type=int, nargs="*", default=None, help="seqlens")
    ap.add_argument(
        "--allow-spill", type=int, default=0, help="time candidates with up to this many bytes"
    )
    args = ap.parse_args(argv)
    os.environ[_SPILL_ENV] = str(args.allow_spill)
    if args.probe:
        dtypes = (torch.bfloat16, torch.float32) if args.fp32 else (torch.bfloat16,)
        sys.exit(0 if probe_table(dtypes) else 1)
    if not torch.cuda.is_available():
        sys.exit("fa2.tune: the timing sweep needs a CUDA GPU (use --probe on CPU)")
    if args.quick_bwd:
        sweep(args.out, args.d or [128, 256], args.n or [8192], quick_bwd=True)
    else:
        sweep(args.out, args.d or [64, 128, 256], args.n or [2048, 8192])


if __name__ == "__main__":
    main()
