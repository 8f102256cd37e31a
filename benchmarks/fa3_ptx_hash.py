"""SHA-256 of the PTX of every fa3 config CI compiles, to show a refactor leaves the code alone.

    python -m benchmarks.fa3_ptx_hash --json before.json [--shard 0/2]
    python -m benchmarks.fa3_ptx_hash --compare before.json after.json
    python -m benchmarks.fa3_ptx_hash --bwd --json before_bwd.json   (the backward's builds)

Compiles for sm_90a on the CPU (no GPU needed): the bf16/fp16 shipped cases and flag variants
(what tests/test_fa3_compile.py builds), the shipped bf16 entries again with a sliding window
and with softcap (the mask and score paths those flags add), every fp8 table entry (causal and
not; window and softcap cases) and every fp8 tile variant (`fa3_variants.fp8_variants`). The
PTX is hashed as written and with the `.loc`/`.file` debug lines removed; `--compare` reports
configs whose PTX differs. `--bwd` hashes the dense backward's builds instead: every shipped
(head_dim, causal) config, the sliding-window and softcap builds, the deterministic builds and
the per-element-atomic variants ("base", "pipe_atomic"). The CuTe DSL reads `CUTE_DSL_*` at
import: run this module in its own process.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks.ptx_hash import compare, hashes, save

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
os.environ["CUTE_DSL_KEEP"] = "ptx"
os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="fa3_ptx_hash_")


def _cases() -> list[tuple[str, str, int, object, bool, bool, bool, object]]:
    """(family, name, head_dim, dtype, causal, local, softcap, config) for every build."""
    import torch

    from benchmarks.fa3_variants import flag_variants, fp8_variants
    from flashsuite.fa3.configs import FP8_DTYPE, HEAD_DIMS, get_config, shipped_cases

    out = []
    for name, d, dt, causal, cfg in shipped_cases() + flag_variants():
        out.append(("bf16", name, d, dt, causal, False, False, cfg))
    for d in (64, 128, 256):
        for causal in (False, True):
            cfg = get_config(d, torch.bfloat16, causal)
            out.append(("bf16", "local", d, torch.bfloat16, causal, True, False, cfg))
            out.append(("bf16", "softcap", d, torch.bfloat16, causal, False, True, cfg))
    # fp8: dtype None in the case (its id says e4m3), FP8_DTYPE in the compile key.
    for d in HEAD_DIMS:
        for causal in (False, True):
            cfg = get_config(d, FP8_DTYPE, causal)
            out.append(("fp8", "shipped", d, None, causal, False, False, cfg))
    cfg = get_config(128, FP8_DTYPE, False)
    out.append(("fp8", "window_softcap", 128, None, False, True, True, cfg))
    for d in (64, 256):
        for causal in (False, True):
            cfg = get_config(d, FP8_DTYPE, causal)
            out.append(("fp8", "local", d, None, causal, True, False, cfg))
            out.append(("fp8", "softcap", d, None, causal, False, True, cfg))
    for name, d, cfg in fp8_variants():  # the candidates fa3_fp8_check --ablate times
        if not name.startswith("shipped"):
            for causal in (False, True):
                out.append(("fp8", name, d, None, causal, False, False, cfg))
    return out


def _case_id(case) -> str:
    family, name, d, dt, causal, local, softcap, cfg = case
    dts = str(dt).removeprefix("torch.") if dt is not None else "e4m3"
    return f"{family}:{name}:D{d}:{dts}:causal={causal}:local={local}:softcap={softcap}:{cfg}"


def _compile(case) -> str:
    family, _, d, dt, causal, local, softcap, cfg = case
    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    from flashsuite.fa3.compile import CompileKey, compile_forward
    from flashsuite.fa3.configs import FP8_DTYPE

    dt = FP8_DTYPE if family == "fp8" else dt
    compiled = compile_forward(CompileKey(dt, d, causal, local, softcap, cfg, tvm_ffi=tvm))
    ptx = getattr(compiled, "__ptx__", None) or ""
    if not ptx:
        raise RuntimeError(f"no PTX for {_case_id(case)}")
    return ptx


def _bwd_cases() -> list[tuple[str, int, bool, bool, bool, object]]:
    """(name, head_dim, causal, local, softcap, BwdConfig) of every dense backward build."""
    import torch

    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.fa3.bwd_configs import BWD_HEAD_DIMS, bwd_config_for

    bf16 = torch.bfloat16
    out = []
    for d in BWD_HEAD_DIMS:
        for causal in (False, True):
            out.append(("shipped", d, causal, False, False, bwd_config_for(d, bf16, causal)))
        out.append(("local", d, False, True, False, bwd_config_for(d, bf16, False)))
        out.append(("softcap", d, True, False, True, bwd_config_for(d, bf16, True, True)))
    for name, d in (("det", 64), ("det", 128), ("det_pipe", 128), ("wide256_det", 256)):
        out.append((name, d, True, False, False, variant(name)))
    for name in ("base", "pipe_atomic"):
        out.append((name, 128, False, False, False, variant(name)))
    return out


def _bwd_id(case) -> str:
    name, d, causal, local, softcap, cfg = case
    return f"bwd:{name}:D{d}:causal={causal}:local={local}:softcap={softcap}:{cfg}"


def _bwd_compile(case) -> str:
    import torch

    from flashsuite.fa3.bwd_host import BwdCompileKey, compile_backward

    _, d, causal, local, softcap, cfg = case
    key = BwdCompileKey(torch.bfloat16, d, causal, cfg, local=local, softcap=softcap)
    ptx = getattr(compile_backward(key), "__ptx__", None) or ""
    if not ptx:
        raise RuntimeError(f"no PTX for {_bwd_id(case)}")
    return ptx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write {case: {ptx, ptx_no_debug}} hashes here")
    ap.add_argument("--shard", default="0/1", help="i/n: cases i, i+n, i+2n, ...")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="BEFORE AFTER [AFTER ...]")
    ap.add_argument("--bwd", action="store_true", help="the dense backward's builds")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    i, n = (int(x) for x in args.shard.split("/"))
    cases, case_id, build = _cases(), _case_id, _compile
    if args.bwd:
        cases, case_id, build = _bwd_cases(), _bwd_id, _bwd_compile
    result = {}
    for case in cases[i::n]:
        result[case_id(case)] = hashes(build(case))
        print(case_id(case), result[case_id(case)]["ptx"][:16], flush=True)
    save(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
