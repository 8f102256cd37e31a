"""SHA-256 of the PTX of every shipped fa1 and fa2 Triton config, to show a refactor leaves the
code alone.

    python -m benchmarks.triton_ptx_hash --json before.json [--shard 0/2]
    python -m benchmarks.triton_ptx_hash --compare before.json after.json

Compiles for sm_90a on the CPU (no GPU needed, TRITON_INTERPRET unset) exactly what the
compile probes build: every entry of fa2's `configs.table()` (forward, dK/dV launches, dQ) in
bf16 and fp32, the bf16 D = 64 / 128 entries again with a sliding window and with softcap (the
mask and score paths those flags add), fa2's backward preprocess for every padded Dv; fa1's
sm90 table (forward, TMA entries as a launch compiles them, backward) and its backward
preprocess. Each kernel's PTX is hashed as written, without `.loc`/`.file` lines, and without
any debug information (moving a jit function to another file changes the lines and the DWARF
record of where it was inlined from, not the code); `--compare` reports configs whose code
differs.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks.ptx_hash import compare, hashes, save

_CAPTURED: list[tuple[str, str]] = []  # (kernel name, PTX) compiled by the current case


def _capture_compile() -> None:
    """Wrap triton.compile so that every kernel the probes build leaves its PTX here."""
    import triton

    if getattr(triton.compile, "_ptx_hash", False):
        return
    original = triton.compile

    def compile_and_keep(src, *args, **kwargs):
        compiled = original(src, *args, **kwargs)
        _CAPTURED.append((src.fn.__name__, compiled.asm["ptx"]))
        return compiled

    compile_and_keep._ptx_hash = True
    triton.compile = compile_and_keep


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _cases() -> list[tuple]:
    """(version, what, dtype name, head_dim, causal, variant) for every build."""
    from flashsuite.fa2.configs import table

    names = {v: k for k, v in _DTYPES.items()}
    out = [("fa2", kind, names[dt], d, causal, "") for kind, d, dt, causal, _ in table()]
    for variant in ("local", "softcap"):
        for kind in ("fwd", "bwd"):
            for d in (64, 128):
                for causal in (False, True):
                    out.append(("fa2", kind, "bf16", d, causal, variant))
    for dt in ("bf16", "fp32"):
        for d in (16, 32, 64, 128, 256):
            out.append(("fa2", "pre", dt, d, False, ""))
    for kind in ("fwd", "bwd"):
        for dt in ("fp16", "fp32", "bf16"):
            for d in (32, 64, 96, 128, 256):
                for causal in (False, True):
                    out.append(("fa1", kind, dt, d, causal, ""))
    for dt in ("fp16", "fp32", "bf16"):
        for d in (32, 64, 128, 256):
            out.append(("fa1", "pre", dt, d, False, ""))
    return out


def _case_id(case: tuple) -> str:
    version, what, dt, d, causal, variant = case
    return f"{version}:{what}:{dt}:D{d}:causal={causal}" + (f":{variant}" if variant else "")


def _build_fa2(what: str, dtype: torch.dtype, d: int, causal: bool, variant: str) -> None:
    from benchmarks import fa2_tune
    from flashsuite.fa2 import configs, kernels

    if what == "pre":  # as interface.backward launches it (4 warps, Triton's default stages)
        flags = dict(HEAD_DIM_V=d, DV_PAD=d, BLOCK_M=configs.PREPROCESS_BLOCK_M)
        fa2_tune._compile_one(kernels._bwd_preprocess, dtype, flags, 4, 3)
        return
    extra = {"local": {"HAS_LEFT": True}, "softcap": {"SOFTCAP": True}}.get(variant)
    lookup = configs.fwd_config if what == "fwd" else configs.bwd_config
    fa2_tune.probe(what, d, dtype, causal, lookup(d, dtype, causal, 90), extra)


def _build_fa1(what: str, dtype: torch.dtype, d: int, causal: bool) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks import fa1_probe
    from flashsuite.fa1 import configs, kernels

    if what == "pre":  # as interface.backward launches it
        fn = kernels.fa1_bwd_preprocess_kernel
        constexprs = dict(HEAD_DIM_V=d, BLOCK_DV=configs.padded_head_dim(d), BLOCK_M=64)
        sig, attrs = fa1_probe._signature(fn, fa1_probe._TYPES[dtype], constexprs)
        src = ASTSource(fn, sig, constexprs, attrs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    elif what == "fwd":
        cfg = configs.fwd_config(d, dtype, 90, causal)
        if cfg.use_tma:
            fa1_probe.launch_probe(dtype, d, causal, cfg)
        else:
            fa1_probe.probe(kernels.fa1_fwd_kernel, dtype, d, causal, 90, cfg)
    else:
        cfg = configs.bwd_config(d, dtype, 90)
        fa1_probe.probe(kernels.fa1_bwd_kernel, dtype, d, causal, 90, cfg)


def _hash_case(case: tuple) -> tuple[str, dict]:
    version, what, dt, d, causal, variant = case
    _capture_compile()
    _CAPTURED.clear()
    if version == "fa2":
        _build_fa2(what, _DTYPES[dt], d, causal, variant)
    else:
        _build_fa1(what, _DTYPES[dt], d, causal)
    if not _CAPTURED:
        raise RuntimeError(f"no kernel compiled for {_case_id(case)}")
    return _case_id(case), {f"{i}:{name}": hashes(ptx) for i, (name, ptx) in enumerate(_CAPTURED)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write {case: {kernel: {ptx, ptx_no_debug}}} here")
    ap.add_argument("--shard", default="0/1", help="i/n: cases i, i+n, i+2n, ...")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="BEFORE AFTER")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    if os.environ.get("TRITON_INTERPRET"):
        ap.error("TRITON_INTERPRET is set: unset it to compile PTX")
    i, n = (int(x) for x in args.shard.split("/"))
    result = {}
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        for case_id, kernels in pool.map(_hash_case, _cases()[i::n]):
            for name, h in kernels.items():
                result[f"{case_id}:{name}"] = h
                print(case_id, name, h["ptx_no_debug"][:16], flush=True)
    save(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
