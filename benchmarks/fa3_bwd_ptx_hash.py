"""SHA-256 of the PTX of the fa3 backward builds, to show a change leaves them alone.

    python -m benchmarks.fa3_bwd_ptx_hash --json before.json [--shard 0/2] [--variants]
    python -m benchmarks.fa3_bwd_ptx_hash --compare before.json after.json

Compiles for sm_90a on the CPU (no GPU needed): every (head_dim, dtype, causal) config
`bwd_config_for` ships, the bf16 ones again with softcap, with a sliding window (D 64 / 128 /
256) and as the deterministic build `fa3.interface` derives under
torch.use_deterministic_algorithms (D 64 / 128); with `--variants` also every named variant of
`benchmarks/fa3_bwd_variants.py` at its head dims, causal and not. A case is named by how it was
chosen, not by the config's repr, so that a new BwdConfig field (which changes the repr) keeps
the names; the PTX is hashed as `benchmarks/ptx_hash.py` does. The CuTe DSL reads `CUTE_DSL_*`
at import: run this module in its own process.
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
os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="fa3_bwd_ptx_hash_")
atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], ignore_errors=True)


def _deterministic(d: int, dtype, causal: bool):
    """The config fa3.interface takes for (d, dtype, causal) under
    torch.use_deterministic_algorithms."""
    import torch

    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.interface import _bwd_config

    q = torch.empty(1, 128, 2, d, dtype=dtype)
    p = check_inputs(q, q, q, causal=causal)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        return _bwd_config(p, None)
    finally:
        torch.use_deterministic_algorithms(was)


def _cases(variants: bool) -> list[tuple]:
    """(name, head_dim, dtype, causal, local, softcap, config) for every build."""
    import torch

    from flashsuite.fa3.bwd_configs import BWD_HEAD_DIMS, bwd_config_for, bwd_shipped_configs

    bf16 = torch.bfloat16
    out = [("shipped", d, dt, c, False, False, cfg) for d, dt, c, cfg in bwd_shipped_configs()]
    for d in BWD_HEAD_DIMS:
        for c in (False, True):
            out.append(("softcap", d, bf16, c, False, True, bwd_config_for(d, bf16, c, True)))
    for d in (64, 128, 256):
        for c in (False, True):
            out.append(("local", d, bf16, c, True, False, bwd_config_for(d, bf16, c, local=True)))
    for d in (64, 128):
        for c in (False, True):
            out.append(("deterministic", d, bf16, c, False, False, _deterministic(d, bf16, c)))
    if variants:
        from benchmarks.fa3_bwd_variants import (
            VARIANTS,
            variant,
            variant_causal,
            variant_head_dims,
        )

        for name in VARIANTS:
            for d in variant_head_dims(name):
                for c in variant_causal(name):
                    out.append((f"variant-{name}", d, bf16, c, False, False, variant(name)))
    return out


def _case_id(case) -> str:
    name, d, dt, causal, local, softcap, _ = case
    dts = str(dt).removeprefix("torch.")
    return f"bwd:{name}:D{d}:{dts}:causal={causal}:local={local}:softcap={softcap}"


def _compile(case) -> str:
    _, d, dt, causal, local, softcap, cfg = case
    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    from flashsuite.fa3.bwd_host import BwdCompileKey, compile_backward

    key = BwdCompileKey(dt, d, causal, cfg, local=local, softcap=softcap, tvm_ffi=tvm)
    ptx = getattr(compile_backward(key), "__ptx__", None) or ""
    if not ptx:
        raise RuntimeError(f"no PTX for {_case_id(case)}")
    return ptx


def main(argv: list[str] | None = None) -> int:
    flags = (("--variants", "the named variants too"),)
    return cli(argv, __doc__, lambda args: _cases(args.variants), _case_id, _compile, flags)


if __name__ == "__main__":
    sys.exit(main())
