"""Compile probe of the fa3 backward: build configs for sm_90a (no GPU) and report PTX facts.

    python -m benchmarks.fa3_bwd_probe                  # the CI set, a table
    python -m benchmarks.fa3_bwd_probe --all            # every shipped (head_dim, dtype, causal)
    python -m benchmarks.fa3_bwd_probe --json out.json  # the same, as JSON
    python -m benchmarks.fa3_bwd_probe --shard 0/2      # every other case (CI runs 2 at once)
    python -m benchmarks.fa3_bwd_probe --variant bulk   # a named variant (fa3_bwd_variants),
                                                        # bf16, D 64 / 128, causal or not
    python -m benchmarks.fa3_bwd_probe --variant base --softcap   # the softcap builds
    python -m benchmarks.fa3_bwd_probe --local                    # sliding-window builds
    python -m benchmarks.fa3_bwd_probe --varlen                   # packed-sequence builds

Per case: instruction counts in the PTX (wgmma, RS wgmma, TMA loads, setmaxnreg, named
barriers, the dQ reduction) and ptxas' spill bytes and remarks. benchmarks.fa3_probe sets the
CUTE_DSL_* variables (sm_90a, ptxas -v, PTX kept) when imported, before cutlass is: run this
in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import fa3_probe as probe  # first: sets CUTE_DSL_* before cutlass is imported

os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"  # the cubin too, for its highest register

# The dQ reduction: per-element atomics (atom/red .global.add.f32), the MMA threads' vectorised
# reductions (dq_mode "red") or the TMA bulk reduce-add.
DQ_ATOMIC = r"(?:atom|red)\.global\.add\.f32"
DQ_RED_V4 = r"red\.global\.add\.v4\.f32"
DQ_BULK = r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32"
# Deterministic dQ: the turn counter's acquiring load (spin) and releasing increment.
SEM_ACQUIRE = r"ld\.acquire\.gpu\.global\.b32"
SEM_RELEASE = r"red\.release\.gpu\.global\.add\.s32"
TANH = r"tanh\.approx\.f32"
# fp32 multiplies (scale_out takes one per dS element out of the row-block loop, adds D / 2 on
# dK's epilogue) and 32-bit shared-memory loads (stats_regs issues the LSE / D rows' loads
# under the S^T / dP^T wgmmas rather than after them).
MUL_F32 = r"\bmul(?:\.rn)?(?:\.ftz)?\.f32\b"
LD_SHARED_32 = r"\bld\.shared(?:::cta)?(?:\.v[24])?\.[bf]32\b"
FIRST_GEMM = r"wgmma\.commit_group.*?wgmma\.wait_group"  # from the first commit to its wait
# One wgmma: its shape, then after the accumulator either A from registers ("{...}") and B's
# descriptor, or both descriptors; the trailing immediates end with imm-trans-b (RS) or with
# imm-trans-a, imm-trans-b (SS; 1 = MN-major).
WGMMA = (
    r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.[^{]*\{[^}]*\}, (\{)?[^;]*?"
    r"((?:,\s*\d)+);"
)


def lds_under_gemm(ptx: str) -> int:
    """32-bit shared-memory loads between the first wgmma commit (S^T of the row-block loop)
    and the first wait: the LSE / D rows stats_regs loads while S^T and dP^T run."""
    m = re.search(FIRST_GEMM, ptx, re.S)
    return len(re.findall(LD_SHARED_32, m.group(0))) if m else 0


def wgmma_shapes(ptx: str) -> dict[str, int]:
    """wgmma instructions by shape, A's source and transposes: "m64n80k16.ss.t10" is an SS
    m64n80k16 with A MN-major and B K-major, "m64n128k16.rs.t1" an RS one with B MN-major."""
    out: dict[str, int] = {}
    for shape, rs, imms in re.findall(WGMMA, ptx):
        flags = imms.replace(",", "").split()
        trans = "".join(flags[-1:] if rs else flags[-2:])
        name = f"{shape}.{'rs' if rs else 'ss'}.t{trans}"
        out[name] = out.get(name, 0) + 1
    return out


def variant_cases(names: list[str]) -> list[tuple]:
    """(head_dim, bf16, causal, cfg) of each named variant (benchmarks.fa3_bwd_variants)."""
    import torch

    from benchmarks.fa3_bwd_variants import variant, variant_causal, variant_head_dims

    return [
        (d, torch.bfloat16, c, variant(n))
        for n in names
        for d in variant_head_dims(n)
        for c in variant_causal(n)
    ]


def varlen_cases() -> list[tuple]:
    """(head_dim, bf16, causal, cfg, softcap, local) of the packed-sequence builds CI compiles:
    both loops ("sdp_t" at D 64 / 96 / 128, "dkv_t" at D 192 / 256), 128-row tiles (D 64),
    causal, a window and softcap, the per-element-atomic dQ variant, the dense routes of
    bwd_configs.VARLEN_DENSE_ROUTES (FA4's at D 64, the per-warpgroup hand-off), and the
    deterministic builds (ordered atomics, turn counters per padded row block) at D 96
    causal, 128 with a window and 256."""
    import torch

    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.fa3.bwd_configs import bwd_config_for
    from flashsuite.fa3.bwd_interface import ordered_config

    bf16 = torch.bfloat16

    def ordered(d: int, causal: bool, local: bool = False):
        return ordered_config(bwd_config_for(d, bf16, causal, sdq=True, local=local, varlen=True))

    return [
        (64, bf16, False, bwd_config_for(64, bf16, False, varlen=True), False, False),
        (128, bf16, True, bwd_config_for(128, bf16, True, varlen=True), False, False),
        (96, bf16, True, bwd_config_for(96, bf16, True, True, varlen=True), True, False),
        (128, bf16, False, bwd_config_for(128, bf16, False, local=True, varlen=True), False, True),
        (192, bf16, True, bwd_config_for(192, bf16, True, varlen=True), False, False),
        (256, bf16, False, bwd_config_for(256, bf16, False, True, varlen=True), True, True),
        (128, bf16, True, variant("pipe_atomic"), False, False),
        # the dense routes packed sequences take with bwd_configs.VARLEN_DENSE_ROUTES
        (64, bf16, True, variant("pipe128_dqm_wgs_sout_ng_shfl_wgdq_tma_dvf"), False, False),
        (128, bf16, False, variant("pipe_wgdq_tma"), False, False),
        (96, bf16, True, ordered(96, True), False, False),
        (128, bf16, False, ordered(128, False, local=True), False, True),
        (256, bf16, False, ordered(256, False), False, False),
    ]


def cases(everything: bool, local: bool = False) -> list[tuple]:
    """(head_dim, dtype, causal, cfg) to compile. The CI set is every shipped (head_dim, causal)
    in bf16 plus fp16 once: the dtype changes only the conversion instructions. `local`: the
    configs of problems with a sliding window."""
    import torch

    from flashsuite.fa3.bwd_configs import bwd_shipped_configs

    shipped = bwd_shipped_configs(local)
    if everything:
        return shipped
    picked = [c for c in shipped if c[1] == torch.bfloat16]
    picked += [c for c in shipped if c[1] == torch.float16 and c[0] == 64 and c[2]]
    return picked


def max_register(cubin: bytes | None) -> int | None:
    """Highest general register index in the SASS of `cubin` (Triton's nvdisasm), or None
    without a cubin or a disassembler. Under setmaxnreg ptxas' "Used N registers" is the entry
    count, not the MMA warpgroups' use: this is what must stay below their 240."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not cubin or not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True)
    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass.stdout)]
    return max(regs) if regs else None


def probe_backward(
    head_dim: int,
    dtype,
    causal: bool,
    cfg,
    softcap: bool = False,
    local: bool = False,
    varlen: bool = False,
) -> dict:
    """Compile one backward config and return its PTX counts and ptxas facts."""
    from flashsuite.fa3.bwd_host import BwdCompileKey, compile_backward

    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    key = BwdCompileKey(
        dtype, head_dim, causal, cfg, local=local, softcap=softcap, varlen=varlen, tvm_ffi=tvm
    )
    t0 = time.perf_counter()
    compiled, log = probe._capture_fd2(lambda: compile_backward(key))
    ptx = getattr(compiled, "__ptx__", None) or ""
    counts = probe.ptx_counts(ptx)
    counts["dq_atomic"] = len(re.findall(DQ_ATOMIC, ptx))
    counts["dq_bulk"] = len(re.findall(DQ_BULK, ptx))
    counts["dq_red_v4"] = len(re.findall(DQ_RED_V4, ptx))
    counts["dq_reduce"] = counts["dq_atomic"] + counts["dq_bulk"] + counts["dq_red_v4"]
    counts["sem_acquire"] = len(re.findall(SEM_ACQUIRE, ptx))
    counts["sem_release"] = len(re.findall(SEM_RELEASE, ptx))
    counts["fence_async_global"] = len(re.findall(r"fence\.proxy\.async\.global", ptx))
    counts["tanh"] = len(re.findall(TANH, ptx))
    counts["griddep_wait"] = len(re.findall(r"\bgriddepcontrol\.wait\b", ptx))
    counts["griddep_launch"] = len(re.findall(r"\bgriddepcontrol\.launch_dependents\b", ptx))
    counts["mul_f32"] = len(re.findall(MUL_F32, ptx))
    counts["lds_under_gemm"] = lds_under_gemm(ptx)
    counts["wgmma_shapes"] = wgmma_shapes(ptx)
    counts["st_shared_v4"] = len(re.findall(r"\bst\.shared(?:::cta)?\.v4\.[bf]32\b", ptx))
    return {
        "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "causal": causal,
        "softcap": softcap,
        "local": local,
        "varlen": varlen,
        "config": cfg.__dict__,
        "compile_s": round(time.perf_counter() - t0, 2),
        "ptx": counts,
        "max_reg": max_register(getattr(compiled, "__cubin__", None)),
        **probe.parse_ptxas(log),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--shard", default="0/1", help="i/n: probe cases i, i+n, i+2n, ...")
    ap.add_argument("--all", action="store_true", help="every dtype, not only the CI set")
    ap.add_argument("--variant", action="append", default=[], help="a named variant (repeat)")
    ap.add_argument("--softcap", action="store_true", help="build with softcap")
    ap.add_argument("--local", action="store_true", help="build with a sliding window")
    ap.add_argument("--varlen", action="store_true", help="the packed-sequence builds CI compiles")
    args = ap.parse_args(argv)
    i, n = (int(x) for x in args.shard.split("/"))
    results = []
    todo = variant_cases(args.variant) if args.variant else cases(args.all, args.local)
    todo = [(*c, args.softcap, args.local) for c in todo]
    if args.varlen:
        todo = varlen_cases()
    for d, dt, causal, cfg, softcap, local in todo[i::n]:
        r = probe_backward(d, dt, causal, cfg, softcap, local, args.varlen)
        results.append(r)
        if not args.json:
            print(
                f"D={d:3d} {r['dtype']:8s} causal={causal!s:5s} {cfg} R{r['max_reg']} "
                f"spill={r['spill_stores']}/{r['spill_loads']} remarks={r['remarks']} "
                f"{r['compile_s']}s {r['ptx']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
