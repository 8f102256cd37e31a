"""Compile probe: build the fa1 kernels of the config table for a GPU arch on any machine.

`python -m benchmarks.fa1_probe [--ci] [ARCH ...]` (default 90 75) compiles every (kernel,
dtype, head_dim, causal) of `configs.py` (--ci: fp16 at D = 64 and where its config is not
bf16's) with `triton.compile` for `GPUTarget("cuda", ARCH, 32)`, no GPU needed, and prints
registers and spills (ptxas -v, from the Triton wheel), shared memory
(`metadata.shared`) and which MMA the PTX uses (wgmma, mma.sync, or none: FMA).

The sm90 TMA entries are compiled the way a launch compiles them (`launch_probe`: Triton's own
argument binder on CPU tensors and host descriptors of a standard-sweep shape, so the integer
and alignment specialisation matches a real call) and also print the stack frame: its bytes
are the local memory a launch reports (Triton's `n_spills` counts it in 4-byte words). The
plain signature `probe` builds leaves those integers unspecialised and spills more.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashsuite.fa1 import kernels
from flashsuite.fa1.configs import Fa1Config, bwd_config, fwd_config, padded_head_dim, q_splits

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_FP32_ARGS = ("Lse", "OAcc", "M", "L", "Delta", "DQAcc")
_DESC_ARGS = ("q_desc", "k_desc", "v_desc", "acc_desc", "out_desc")


def _signature(fn, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    """Argument types as a launch would specialise them (16-byte aligned pointers, strides)."""
    sig, attrs = {}, {}
    for idx, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper():  # tensors
            sig[name] = "*fp32" if name in _FP32_ARGS else f"*{dtype}"
            attrs[(idx,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(idx,)] = [["tt.divisibility", 16]]
    return sig, attrs


def probe(
    fn, dtype: torch.dtype, head_dim: int, causal: bool, arch: int, cfg: Fa1Config
) -> dict[str, object]:
    """Compile one kernel; return registers, spill bytes, shared memory and the MMA kind."""
    block_d = padded_head_dim(head_dim)
    constexprs = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_DV": block_d,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "CAUSAL": causal,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }
    if "USE_DESC" in fn.arg_names:  # the forward's pointer path (TMA entries: launch_probe)
        assert not cfg.use_tma, "compile TMA entries with launch_probe"
        constexprs.update(USE_DESC=False, PROXY_FENCE=False, BLOCK_NS=cfg.block_n, SPLIT_KV=False)
        constexprs.update({name: None for name in _DESC_ARGS})
    sig, attrs = _signature(fn, _TYPES[dtype], constexprs)
    compiled = triton.compile(
        ASTSource(fn, sig, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
    return _ptxas(compiled, arch)


def launch_probe(dtype: torch.dtype, head_dim: int, causal: bool, cfg: Fa1Config) -> dict:
    """Compile the sm90 TMA forward as a launch compiles it: the launcher's own arguments
    (`interface.fwd_launch`) for the standard sweep's shape at N = 2048 (B·N = 16k,
    Hq·D = 2048, contiguous CPU tensors, 132 SMs' Q splits), specialised by Triton's binder;
    ptxas -v of that PTX."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from flashsuite.common.validation import check_inputs
    from flashsuite.fa1 import interface

    n, h = 2048, max(1, 2048 // head_dim)
    b = 16384 // n
    q = torch.zeros(b, n, h, head_dim, dtype=dtype)  # (B, N, H, D)
    k, v, out = torch.zeros_like(q), torch.zeros_like(q), torch.empty_like(q)
    lse = torch.empty(b, h, n)  # (B, H, N)
    p = check_inputs(q, k, v, causal=causal)
    splits = q_splits(b * h, -(-n // cfg.block_m), 132)
    _, args, kwargs = interface.fwd_launch(q, k, v, out, lse, p, cfg, splits, on_gpu=True)
    assert kwargs["USE_DESC"], cfg
    fn = kernels.fa1_fwd_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )
    return _ptxas(compiled, 90)


def _ptxas(compiled, arch: int) -> dict:
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    gpu = "sm_90a" if arch == 90 else f"sm_{arch}"
    run = subprocess.run(
        [_PTXAS, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    )
    os.unlink(f.name)
    log = run.stderr + run.stdout
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "regs": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_st": int(spill.group(1)),
        "spill_ld": int(spill.group(2)),
        "stack": int(re.search(r"(\d+) bytes stack frame", log).group(1)),
        "smem_kb": compiled.metadata.shared / 1024,
        "mma": "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "fma"),
    }


def main(archs: list[int], ci: bool = False) -> None:
    """`ci`: fp16 at D = 64 and where its config differs from bf16's (elsewhere the two 16-bit
    types build the same kernel with another element type: CI compiles one, as for fa3)."""
    for arch in archs:
        dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if arch >= 80 else [])
        head_dims = (32, 64, 96, 128) + ((256,) if arch >= 80 else ())
        for name, fn in (("fwd", kernels.fa1_fwd_kernel), ("bwd", kernels.fa1_bwd_kernel)):
            for dtype in dtypes:
                for d in head_dims:
                    for causal in (False, True):
                        if name == "fwd":
                            cfg = fwd_config(d, dtype, arch, causal)
                            twin = fwd_config(d, torch.bfloat16, arch, causal)
                        else:
                            cfg = bwd_config(d, dtype, arch)
                            twin = bwd_config(d, torch.bfloat16, arch)
                        fp16_twin = dtype == torch.float16 and arch >= 80 and cfg == twin
                        if ci and fp16_twin and d != 64:
                            continue
                        if cfg.use_tma and name == "fwd":
                            r = launch_probe(dtype, d, causal, cfg)
                        else:
                            r = probe(fn, dtype, d, causal, arch, cfg)
                        path = (" tma" + (" split" if cfg.split_kv else "")) if cfg.use_tma else ""
                        stack = f", stack {r['stack']} B" if cfg.use_tma else ""
                        print(
                            f"sm{arch} {name} {_TYPES[dtype]} D={d:3d} causal={int(causal)} "
                            f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                            f"{path}: "
                            f"{r['regs']:3d} regs, spill {r['spill_st']}/{r['spill_ld']} B, "
                            f"smem {r['smem_kb']:.1f} KB, {r['mma']}{stack}",
                            flush=True,
                        )


if __name__ == "__main__":
    args = sys.argv[1:]
    ci = "--ci" in args
    main([int(a) for a in args if a != "--ci"] or [90, 75], ci=ci)
