"""Compile probe: build fa3 configs for sm_90a (no GPU needed) and report PTX and ptxas facts.

    python -m benchmarks.fa3_probe                    # the CI set (ci_cases), a table
    python -m benchmarks.fa3_probe --all-dtypes       # every shipped config in fp16 and bf16
    python -m benchmarks.fa3_probe --json out.json    # the same, as JSON
    python -m benchmarks.fa3_probe --shard 0/2        # every other config (CI runs 2 at once)
    python -m benchmarks.fa3_probe --variants         # shipped configs + fa3_variants.flag_variants
    python -m benchmarks.fa3_probe --varlen           # the packed-sequence (varlen) builds only

Per config: instruction counts in the PTX (wgmma, TMA, setmaxnreg, named barriers, stmatrix)
and ptxas' registers, spill bytes and performance remarks (C75xx: C7512 means every wgmma got
serialised). The CuTe DSL reads `CUTE_DSL_*` at import, so this module sets them before
importing cutlass: run it in its own process.
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
from typing import Any

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTE_DSL_COMPILER_OPT"] = "remarks{ptx}"  # ptxas -v output on stderr
os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"  # a cache hit would skip ptxas
os.environ["CUTE_DSL_KEEP"] = "ptx"
_DUMP = tempfile.mkdtemp(prefix="fa3_probe_")
atexit.register(shutil.rmtree, _DUMP, ignore_errors=True)  # the DSL's dumps, read in-process
os.environ["CUTE_DSL_DUMP_DIR"] = _DUMP

PTX_PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "wgmma_rs": r"wgmma\.mma_async[^\n]*\}, \{%r",  # A operand from registers (P·V)
    "tma_load": r"cp\.async\.bulk\.tensor[^\n]*shared::cta\.global",
    "tma_store": r"cp\.async\.bulk\.tensor[^\n]*global\.shared::cta",
    "cp_async_bulk_tensor": r"cp\.async\.bulk\.tensor",
    "setmaxnreg": r"setmaxnreg",
    "bar_sync": r"\bbar\.sync",
    "bar_arrive": r"\bbar\.arrive",
    "bar_sync_wg": r"\bbar\.sync\s+%r\d+, 128;",  # a runtime-id 128-thread barrier: per-WG epilogue
    "bar_sync_epilogue_all": r"\bbar\.sync\s+1, (?:256|384);",  # Barrier.EPILOGUE, every consumer
    "bulk_wait_read": r"cp\.async\.bulk\.wait_group\.read",
    "stmatrix": r"stmatrix",
    "st_global_v4": r"st\.global\.v4",  # O_DIRECT_STORE's 16-byte stores of O
    "ex2": r"ex2\.approx",
    "vote_ballot": r"vote\.sync\.ballot",  # varlen: the virtual block's sequence (fa3/varlen.py)
    "mbarrier_try_wait": r"mbarrier\.try_wait",
}


def ptx_counts(ptx: str) -> dict[str, int]:
    """Occurrences of each instruction family of interest in one PTX module."""
    return {name: len(re.findall(pat, ptx)) for name, pat in PTX_PATTERNS.items()}


def parse_ptxas(log: str) -> dict[str, Any]:
    """Registers, spill bytes and C75xx remark codes from ptxas' -v output."""
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(regs[-1]) if regs else None,
        "spill_stores": sum(int(s) for s, _ in spills) if spills else None,
        "spill_loads": sum(int(ld) for _, ld in spills) if spills else None,
        "remarks": sorted(set(re.findall(r"\((C75\d\d)\)", log))),
        "ptxas_lines": [
            ln.strip() for ln in log.splitlines() if "registers" in ln or "spill" in ln
        ],
    }


def _no_source_locations() -> None:
    """Build MLIR ops without Python source locations.

    remarks{ptx} turns on the DSL's diagnostics collection, which attaches the user's source
    line to every op it builds (a frame walk and a scan of the code's position table per op):
    that more than doubles a trace (the fp8 D 128 causal build: 9.2 s with it, 3.9 s without).
    The probes read ptxas' remarks and the PTX / SASS, none of which needs the locations."""
    import cutlass._mlir_helpers.op as mlir_op

    mlir_op._get_caller_frame_info = lambda: None


def _capture_fd2(fn):
    """Run fn() with file descriptor 2 (where ptxas remarks go) captured; returns (value, text)."""
    _no_source_locations()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            value = fn()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    return value, text


def probe_one(
    head_dim: int,
    dtype: Any,
    causal: bool,
    cfg: Any,
    local: bool = False,
    softcap: bool = False,
    varlen: bool = False,
    fp8_blocks: bool = False,
) -> dict:
    """Compile one config and return its PTX counts and ptxas facts."""
    from flashsuite.fa3.compile import CompileKey, compile_forward

    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    key = CompileKey(
        dtype, head_dim, causal, local, softcap, cfg, tvm_ffi=tvm, varlen=varlen,
        fp8_blocks=fp8_blocks,
    )  # fmt: skip
    t0 = time.perf_counter()
    compiled, log = _capture_fd2(lambda: compile_forward(key))
    ptx = getattr(compiled, "__ptx__", None) or ""
    return {
        "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "causal": causal,
        "local": local,
        "softcap": softcap,
        "varlen": varlen,
        "fp8_blocks": fp8_blocks,
        "config": cfg.__dict__,
        "compile_s": round(time.perf_counter() - t0, 2),
        "ptx_chars": len(ptx),
        "ptx": ptx_counts(ptx),
        **parse_ptxas(log),
    }


# The fp16 builds CI compiles beside every bf16 one: the table gives both 16-bit types the same
# config (tests/test_fa3_compile.py asserts it), so the dtype changes only the element type of
# the wgmma and the conversions; one causal and one full build, at both ends of head_dim.
FP16_CI = (("shipped", 64, True), ("shipped", 256, False))


def ci_cases() -> list[tuple]:
    """configs.shipped_cases that CI compiles: every bf16 entry, the fp16 ones in FP16_CI."""
    import torch

    from flashsuite.fa3.configs import shipped_cases

    return [c for c in shipped_cases() if c[2] == torch.bfloat16 or (c[0], c[1], c[3]) in FP16_CI]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--shard", default="0/1", help="i/n: probe configs i, i+n, i+2n, ...")
    ap.add_argument("--head-dim", type=int, action="append", help="only these head dims")
    ap.add_argument("--variants", action="store_true", help="also the non-default flag variants")
    ap.add_argument(
        "--only-variants", action="store_true", help="only the non-default flag variants"
    )
    ap.add_argument(
        "--varlen", action="store_true", help="only the varlen builds (fa3_variants.varlen_cases)"
    )
    ap.add_argument(
        "--all-dtypes", action="store_true", help="every shipped config in both 16-bit types"
    )
    args = ap.parse_args(argv)

    from benchmarks.fa3_variants import flag_variants, varlen_cases
    from flashsuite.fa3.configs import shipped_cases

    i, n = (int(x) for x in args.shard.split("/"))
    shipped = shipped_cases() if args.all_dtypes else ci_cases()
    cases = [(*c, False, False, False) for c in shipped]
    if args.variants or args.only_variants:
        variants = [(*c, False, False, False) for c in flag_variants()]
        cases = variants if args.only_variants else cases + variants
    if args.varlen:
        cases = [(*c, True) for c in varlen_cases()]
    todo = [c for c in cases if not args.head_dim or c[1] in args.head_dim][i::n]
    results = []
    for name, d, dt, causal, cfg, local, softcap, varlen in todo:
        r = {"name": name, **probe_one(d, dt, causal, cfg, local, softcap, varlen)}
        results.append(r)
        if not args.json:
            print(
                f"{name:22s} D={d:3d} {r['dtype']:8s} causal={causal!s:5s} regs={r['registers']} "
                f"spill={r['spill_stores']}/{r['spill_loads']} remarks={r['remarks']} "
                f"{r['compile_s']}s {r['ptx']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
