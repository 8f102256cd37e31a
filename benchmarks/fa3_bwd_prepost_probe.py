"""Compile probe of fa3's dense backward pre- and postprocess (fa3/bwd_prepost.py) for sm_90a,
no GPU needed: PTX instruction counts, ptxas registers and spills, and each binary's argument
signature (what its argument check answers to CPU tensors).

    python -m benchmarks.fa3_bwd_prepost_probe                  # the CI set, a table
    python -m benchmarks.fa3_bwd_prepost_probe --json out.json  # the same, as JSON
    python -m benchmarks.fa3_bwd_prepost_probe --shard 0/2      # every other case

The CI set: the preprocess at every head dim in both 16-bit dtypes, zeroing the dQ accumulator
(every shipped backward config has a tile-ordered one), and without zeroing in bf16 (the
"atomic" dq_mode variants); the postprocess at every shipped (head_dim, tile_m) in both dtypes
without a scale (no shipped config has scale_out) and in bf16 with one. benchmarks.fa3_probe
sets the CUTE_DSL_* variables (sm_90a, ptxas -v, PTX kept) when imported, before cutlass is:
run this in its own process.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import fa3_probe as probe  # first: sets CUTE_DSL_* before cutlass is imported

PTX_PATTERNS = {
    "ld_global_v4": r"\bld\.global(?:\.nc)?(?:\.L\w+::\w+)*\.v4\.[bfsu]32\b",
    "st_global_v4": r"\bst\.global\.v4\.[bfsu]32\b",
    "ld_global_scalar": r"\bld\.global(?:\.nc)?\.[bfsu]32\b",
    "st_global_scalar": r"\bst\.global\.[bfsu]32\b",
    "cp_async_16": r"\bcp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16\b",
    "ld_shared": r"\bld\.shared\.",
    "local": r"\b(?:ld|st)\.local\.",
    "shfl_bfly": r"\bshfl\.sync\.bfly\.b32\b",
    "s64_index": r"\b(?:mul|mad)\.lo\.s64\b",
    "wide_index": r"\bmul\.wide\.[su]32\b",
    "bar_sync": r"\bbar\.sync\b",
    "griddep_wait": r"\bgriddepcontrol\.wait\b",
    "griddep_launch": r"\bgriddepcontrol\.launch_dependents\b",
}


def cases() -> list[tuple]:
    """("pre", dtype, head_dim_v, zero_d[, pdl]) and ("post", dtype, head_dim, tile_m,
    has_scale, swizzle[, pdl]): the postprocess with its layout's DQ_SWIZZLE terms; one of each
    launched as a programmatic dependent (BwdConfig.pdl)."""
    import torch

    from flashsuite.fa3.bwd_configs import BWD_HEAD_DIMS, bwd_config_for, dq_tiled
    from flashsuite.fa3.bwd_prepost import dq_swizzle

    out: list[tuple] = []
    for dt in (torch.bfloat16, torch.float16):
        out += [("pre", dt, d, d) for d in BWD_HEAD_DIMS]
    out += [("pre", torch.bfloat16, d, 0) for d in BWD_HEAD_DIMS]
    tiles = set()  # (head_dim, tile_m, swizzle) of every tile-ordered config dispatch can pick
    for d in BWD_HEAD_DIMS:
        for causal in (False, True):
            for softcap in (False, True):
                for local in (False, True):
                    cfg = bwd_config_for(d, torch.bfloat16, causal, softcap, local=local)
                    if dq_tiled(cfg):
                        swz = dq_swizzle(cfg.tile_m, d, cfg.num_mma_wgs, cfg.dq_split)
                        tiles.add((d, cfg.tile_m, swz))
    for d, tile_m, swz in sorted(tiles):
        out += [("post", dt, d, tile_m, False, swz) for dt in (torch.bfloat16, torch.float16)]
        out.append(("post", torch.bfloat16, d, tile_m, True, swz))
    out.append(("pre", torch.bfloat16, 128, 128, True))
    out.append(("post", torch.bfloat16, 128, 80, False, dq_swizzle(80, 128, 2, "dt"), True))
    return out


def _cpu_args(case: tuple, b: int, nq: int, hq: int, strided: bool) -> tuple:
    """CPU tensors of the binary's parameters at one (B, Nq, Hq), with non-contiguous outer
    strides when `strided` (the argument check answers before any launch)."""
    import torch

    kind, dt, d = case[:3]

    def rows(n: int, dtype: Any, width: int) -> Any:  # (B, n, Hq, width)
        if not strided:
            return torch.zeros(b, n, hq, width, dtype=dtype)
        return torch.zeros(b, hq, n + 3, 2 * width, dtype=dtype)[:, :, :n, :width].transpose(1, 2)

    nq_pad = -(-nq // 64) * 64
    if kind == "pre":
        zero_d = case[3]
        lse = torch.zeros(b, nq, hq).transpose(1, 2) if strided else torch.zeros(b, hq, nq)
        acc = torch.zeros(b, hq, nq_pad, zero_d) if zero_d else None
        stats = torch.zeros(b, hq, nq_pad)
        return (rows(nq, dt, d), rows(nq, dt, d), lse, stats, stats.clone(), acc)
    tile_m = case[3]
    nq_pad = -(-nq // tile_m) * tile_m
    acc = torch.zeros(b, hq, nq_pad, d)
    row_off, col_off = torch.zeros(tile_m, dtype=torch.int32), torch.zeros(d, dtype=torch.int32)
    return (acc, row_off, col_off, rows(nq, dt, d), 1.0)


def _signature_error(fn: Any, args: tuple) -> str:
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ran"


def probe_case(case: tuple) -> dict:
    """Compile one case; its PTX counts, ptxas facts and argument-check answers."""
    from flashsuite.fa3 import bwd_prepost as bp

    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    kind, dt, d = case[:3]
    if kind == "pre":
        key: Any = bp.PreprocessKey(dt, d, case[3], pdl=case[4:5] == (True,), tvm_ffi=tvm)
        build = bp.compile_preprocess
    else:
        pdl = case[6:7] == (True,)
        key = bp.PostprocessKey(dt, d, case[3], case[4], case[5], pdl=pdl, tvm_ffi=tvm)
        build = bp.compile_postprocess
    t0 = time.perf_counter()
    compiled, log = probe._capture_fd2(lambda: build(key))
    ptx = getattr(compiled, "__ptx__", None) or ""
    row = {
        "kind": kind,
        "dtype": str(dt).removeprefix("torch."),
        "head_dim": d,
        "key": repr(key),
        "compile_s": round(time.perf_counter() - t0, 2),
        "ptx": {name: len(re.findall(pat, ptx)) for name, pat in PTX_PATTERNS.items()},
        **probe.parse_ptxas(log),
    }
    row["pdl"] = key.pdl
    if kind == "pre":
        row["zero_d"] = case[3]
    else:
        row["tile_m"], row["has_scale"], row["swizzle"] = case[3], case[4], case[5]
    if tvm:  # two shapes, contiguous and strided: the check answers only the device
        row["signatures"] = [
            _signature_error(compiled, _cpu_args(case, 1, 17, 1, False)),
            _signature_error(compiled, _cpu_args(case, 3, 113, 5, True)),
        ]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--shard", default="0/1", help="i/n: probe cases i, i+n, i+2n, ...")
    args = ap.parse_args(argv)
    i, n = (int(x) for x in args.shard.split("/"))
    results = []
    for case in cases()[i::n]:
        r = probe_case(case)
        results.append(r)
        if not args.json:
            print(
                f"{r['key']}: R{r['registers']} spill={r['spill_stores']}/{r['spill_loads']} "
                f"{r['compile_s']}s {r['ptx']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
