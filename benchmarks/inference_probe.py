"""Compile the inference kernels (fa2 split-KV decode, combine, varlen forward/backward) for
sm_90a on the CPU, as their launchers specialise them, and print registers, spilled bytes and
shared memory per kernel (no GPU needed; ptxas from the triton wheel).

    python benchmarks/inference_probe.py [--quick]     (without TRITON_INTERPRET)

Exit status 1 if any kernel spills. `--quick` compiles the GQA 32/8 decode at D = 128 (both
paged variants, each also on a float8_e4m3fn cache), its combine and the D = 128 causal varlen
backward: the CI subset.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

_INT_PTRS = {"BlockTable", "CacheSeqlens", "Leftpad", "CuQ", "CuK"}
_FP32_PTRS = {"Lse", "Lse2", "Delta", "OPart", "LsePart", "DescaleK", "DescaleV"}
_FP32_SCALARS = {"qk_scale", "softcap_log2", "scale"}


def compile_one(
    fn, constexprs: dict, num_warps: int, num_stages: int, dtype="bf16", ptrs: dict | None = None
) -> dict:
    """`ptrs`: element types of named pointer arguments other than `dtype` (e.g. a float8
    cache's K and V)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, prm in enumerate(fn.params):
        name = prm.name
        if name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper() or (name[0] == "d" and name[1].isupper()):
            kind = "i32" if name in _INT_PTRS else "fp32" if name in _FP32_PTRS else dtype
            sig[name] = f"*{(ptrs or {}).get(name, kind)}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FP32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name not in ("stride_lh", "stride_lb", "stride_btb"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    path = f"/tmp/inference_probe_{os.getpid()}_{fn.__name__}.ptx"
    with open(path, "w") as f:
        f.write(kernel.asm["ptx"])
    log = subprocess.run(
        [get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.devnull],
        capture_output=True,
        text=True,
    ).stderr
    os.remove(path)
    return dict(
        regs=int(re.search(r"Used (\d+) registers", log).group(1)),
        spill=sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)),
        smem=int(kernel.metadata.shared),
    )


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the probe compiles for the GPU")
    from flashsuite.fa2 import configs, decode, varlen

    flags = dict(HAS_LEFT=False, SOFTCAP=False, DOT_PRECISION="tf32")
    fp8_off = dict(KV_FP8=False, DESCALE_K=False, DESCALE_V=False)
    fp8_on = dict(KV_FP8=True, DESCALE_K=True, DESCALE_V=True)
    fp8_ptrs = {"K": "fp8e4nv", "V": "fp8e4nv"}  # a float8_e4m3fn cache under bf16 queries
    jobs = []
    for d in (64, 128, 256):
        for rows in (4, 16, 64):  # GQA 32/8 with Nq = 1, 4, 16
            for paged, per_tile in ((False, False), (True, True), (True, False)):
                cfg = decode.decode_config(rows, d, interpreter=False)
                ce = dict(flags, HAS_RIGHT=rows > 4, HEAD_DIM=d, HEAD_DIM_V=d, D_PAD=d, DV_PAD=d,
                          SPLIT=True, PAGED=paged, PAGE_PER_TILE=per_tile, LEFTPAD=False,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)  # fmt: skip
                label = f"decode D={d} rows={rows} paged={int(paged)} per_tile={int(per_tile)}"
                jobs.append((label, decode._decode_split, dict(ce, **fp8_off), cfg.num_warps,
                             cfg.num_stages, None))  # fmt: skip
                if d <= 128 and rows < 64:  # a float8 cache
                    jobs.append((label + " e4m3", decode._decode_split, dict(ce, **fp8_on),
                                 cfg.num_warps, cfg.num_stages, fp8_ptrs))  # fmt: skip
        cfg = decode.decode_config(4, d, interpreter=False)  # a left-padded contiguous cache
        ce = dict(flags, HAS_RIGHT=False, HEAD_DIM=d, HEAD_DIM_V=d, D_PAD=d, DV_PAD=d, SPLIT=True,
                  PAGED=False, PAGE_PER_TILE=False, LEFTPAD=True, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, **fp8_off)  # fmt: skip
        jobs.append((f"decode D={d} rows=4 leftpad", decode._decode_split, ce, cfg.num_warps,
                     cfg.num_stages, None))  # fmt: skip
        ce = dict(HEAD_DIM_V=d, DV_PAD=d, BLOCK_R=16)
        jobs.append((f"combine D={d}", decode._combine, ce, 4, 1, None))
    for d in (32, 64, 96, 128, 192, 256):  # every head dim of the dense table
        pad = max(16, 1 << (d - 1).bit_length())
        for causal in (False, True):
            f = configs.varlen_fwd_config(d, torch.bfloat16, causal, 90)
            b = configs.varlen_bwd_config(d, torch.bfloat16, causal, 90)
            base = dict(flags, HAS_RIGHT=causal, HEAD_DIM=d, HEAD_DIM_V=d, D_PAD=pad, DV_PAD=pad)
            jobs.append((f"varlen fwd D={d} causal={int(causal)}", varlen._varlen_fwd,
                         dict(base, BLOCK_M=f.block_m, BLOCK_N=f.block_n), f.num_warps,
                         f.num_stages, None))  # fmt: skip
            for name, want_dk, want_dv in configs.dkdv_launches(b):
                ce = dict(base, BLOCK_M=b.block_m1, BLOCK_N=b.block_n1, WANT_DK=want_dk,
                          WANT_DV=want_dv, TAIL_STAGES=None if b.tail_pipelined else 1)  # fmt: skip
                jobs.append((f"varlen {name} D={d} causal={int(causal)}", varlen._varlen_bwd_dkdv,
                             ce, b.num_warps, b.num_stages, None))  # fmt: skip
            jobs.append((f"varlen dq D={d} causal={int(causal)}", varlen._varlen_bwd_dq,
                         dict(base, BLOCK_M=b.block_m2, BLOCK_N=b.block_n2), b.num_warps_dq,
                         b.num_stages_dq, None))  # fmt: skip
    if "--quick" in sys.argv[1:]:
        quick = ("decode D=128 rows=4 ", "combine D=128", "D=128 causal=1")
        jobs = [job for job in jobs if any(key in job[0] for key in quick)]
        jobs = [job for job in jobs if "fwd" not in job[0]]
    worst = 0
    for label, fn, ce, warps, stages, ptrs in jobs:
        r = compile_one(fn, ce, warps, stages, ptrs=ptrs)
        worst = max(worst, r["spill"])
        print(f"{label:<45} w{warps} s{stages}: {r['regs']} regs, spill {r['spill']} B, "
              f"smem {r['smem']} B", flush=True)  # fmt: skip
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
