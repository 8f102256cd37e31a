"""SHA-256 of the PTX of every fa3 config CI compiles, to show a refactor leaves the code alone.

    python -m benchmarks.fa3_ptx_hash --json before.json [--shard 0/2]
    python -m benchmarks.fa3_ptx_hash --compare before.json after.json

Compiles for sm_90a on the CPU (no GPU needed): the bf16/fp16 shipped cases and flag variants
(what tests/test_fa3_compile.py builds), the shipped bf16 entries again with a sliding window
and with softcap (the mask and score paths those flags add), every fp8 table entry (causal and
not; window and softcap cases) and every fp8 tile variant (`fa3_variants.fp8_variants`). The
PTX is hashed as written and with the `.loc`/`.file` debug lines removed; `--compare` reports
configs whose PTX differs. The CuTe DSL reads `CUTE_DSL_*` at import: run this module in its
own process.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from benchmarks.ptx_hash import cli

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
os.environ["CUTE_DSL_KEEP"] = "ptx"
os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="fa3_ptx_hash_")
atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], ignore_errors=True)


def _cases() -> list[tuple[str, str, int, object, bool, bool, bool, object]]:
    """(family, name, head_dim, dtype, causal, local, softcap, config) for every build."""
    import torch

    from benchmarks.fa3_variants import flag_variants, fp8_variants
    from flashsuite.fa3.configs import (
        FP8_DTYPE,
        HEAD_DIMS,
        dense_options_off,
        get_config,
        shipped_cases,
    )

    out = []
    for name, d, dt, causal, cfg in shipped_cases() + flag_variants():
        out.append(("bf16", name, d, dt, causal, False, False, cfg))
    for d in (64, 128, 256):
        for causal in (False, True):
            cfg = dense_options_off(get_config(d, torch.bfloat16, causal))  # config_for's
            out.append(("bf16", "local", d, torch.bfloat16, causal, True, False, cfg))
            out.append(("bf16", "softcap", d, torch.bfloat16, causal, False, True, cfg))
    # fp8: dtype None in the case (its id says e4m3), FP8_DTYPE in the compile key.
    for d in HEAD_DIMS:
        for causal in (False, True):
            cfg = get_config(d, FP8_DTYPE, causal)
            out.append(("fp8", "shipped", d, None, causal, False, False, cfg))
    cfg = dense_options_off(get_config(128, FP8_DTYPE, False))
    out.append(("fp8", "window_softcap", 128, None, False, True, True, cfg))
    for d in (64, 256):
        for causal in (False, True):
            cfg = dense_options_off(get_config(d, FP8_DTYPE, causal))
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


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__, lambda args: _cases(), _case_id, _compile)


if __name__ == "__main__":
    sys.exit(main())
