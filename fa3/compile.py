"""Compile cache for the fa3 forward: one binary per static key, any batch / seqlen / heads.

The key (`CompileKey`) holds only what changes the generated code. Batch, sequence lengths,
head counts and strides are symbolic in the fake tensors the kernel is compiled from, so new
shapes never recompile. The binary is built with `--enable-tvm-ffi`: it takes torch tensors
directly and launches on torch's current stream.

Two cache levels: an in-process dict, then the on-disk cache of `disk_cache` (a new process
loads the binary a previous one built). Every launch passes every kernel parameter
positionally, as a binary loaded from disk takes them (no defaults).

The CuTe DSL (`cutlass`) and the kernel classes are imported only when a binary is compiled:
loading one from disk needs TVM-FFI alone. `CUTE_DSL_*` environment settings are read when
`cutlass.cute` is first imported; set `CUTE_DSL_ARCH=sm_90a` before the first compile on a
machine without a GPU (the `--gpu-arch` option below already targets sm_90a).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from flashsuite.fa3 import disk_cache
from flashsuite.fa3.configs import SMEM_CAPACITY, Fa3Config, smem_bytes


def cutlass_dtype(dtype: torch.dtype) -> Any:
    """The CuTe DSL element type of a 16-bit torch dtype (imports the DSL)."""
    import cutlass

    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]


@dataclass(frozen=True)
class CompileKey:
    """Everything that changes the generated code of one forward kernel."""

    dtype: torch.dtype
    head_dim: int
    causal: bool
    local: bool
    softcap: bool
    cfg: Fa3Config
    arch: str = "sm_90a"
    tvm_ffi: bool = True


_cache: dict[Any, Any] = {}  # static key (CompileKey, fp8.Fp8CompileKey) -> executor
_lock = threading.Lock()


def compile_options(arch: str, tvm_ffi: bool, extra: str = "") -> str:
    """cute.compile's option string: target arch, the TVM-FFI launcher, anything extra."""
    options = f"--gpu-arch {arch}"
    if tvm_ffi:
        options += " --enable-tvm-ffi"
    return f"{options} {extra}" if extra else options


def check_storage(kernel: Any, estimate: int, what: str) -> None:
    """The DSL does not check shared-memory capacity (a launch would fail on the GPU): compare
    the real storage struct with the config table's estimate and the hardware limit."""
    real = kernel.storage.__sizeof__()
    if real > min(estimate, SMEM_CAPACITY):
        raise RuntimeError(
            f"fa3: {what} storage struct is {real} B (estimated {estimate} B, "
            f"capacity {SMEM_CAPACITY} B)"
        )


def cached(key: Any, build: Any) -> Any:
    """The executor for `key`: from this process's dict, else loaded from the on-disk cache,
    else built by `build(key)` and stored there (thread-safe; `disk_cache.load_or_build`)."""
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn = disk_cache.load_or_build(key, build)
                _cache[key] = fn
    return fn


def _fake_inputs(key: CompileKey) -> tuple:
    """Fake q, k, v, out, lse with symbolic sizes and 16-byte-aligned symbolic strides."""
    import cutlass
    import cutlass.cute as cute

    dt = cutlass_dtype(key.dtype)
    d = key.head_dim
    b, nq, nk, hq, hkv = (cute.sym_int() for _ in range(5))
    elems_16b = 16 // (dt.width // 8)  # TMA: outer strides are multiples of 16 bytes

    def qkv(n: Any, h: Any) -> Any:
        stride = (*(cute.sym_int64(divisibility=elems_16b) for _ in range(3)), 1)
        return cute.runtime.make_fake_tensor(dt, (b, n, h, d), stride=stride, assumed_align=16)

    q, k, v = qkv(nq, hq), qkv(nk, hkv), qkv(nk, hkv)
    # out is allocated by us, contiguous: (B, Nq, Hq, D).
    o = cute.runtime.make_fake_compact_tensor(
        dt, (b, nq, hq, d), stride_order=(3, 2, 1, 0), assumed_align=16
    )
    lse = cute.runtime.make_fake_compact_tensor(
        cutlass.Float32, (b, hq, nq), stride_order=(2, 1, 0), assumed_align=4
    )  # (B, Hq, Nq)
    return q, k, v, o, lse


def compile_forward(key: CompileKey, extra_options: str = "") -> Any:
    """Build one forward binary (no cache). `extra_options` are appended to cute.compile's."""
    import cutlass
    import cutlass.cute as cute

    from flashsuite.fa3.kernels import Fa3Forward

    est = smem_bytes(key.cfg, key.head_dim)
    kernel = Fa3Forward(
        cutlass_dtype(key.dtype), key.head_dim, key.cfg, key.causal, key.local, key.softcap
    )
    q, k, v, o, lse = _fake_inputs(key)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=key.tvm_ffi)
    options = compile_options(key.arch, key.tvm_ffi, extra_options)
    compiled = cute.compile(
        kernel,
        q,
        k,
        v,
        o,
        lse,
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        cutlass.Int32(1),
        stream,
        options=options,
    )
    check_storage(kernel, est, str(key.cfg))
    return compiled


def get_forward(key: CompileKey) -> Any:
    """The cached binary for `key`, compiled on first use (thread-safe)."""
    return cached(key, compile_forward)


def kernel_scalars(
    scale: float, softcap: float, window: tuple[int, int], causal: bool, nq: int, nk: int
) -> tuple[float, float, int, int]:
    """Runtime scalars of the kernel: (scale_log2, softcap_pre, window_left, window_right).

    With softcap the scores are softcap * tanh(s * scale / softcap): tanh's argument takes
    scale / softcap and the exp2 scale becomes softcap * log2(e). An unbounded window side
    becomes a bound no row reaches (nq + nk), so the kernel has one code path per side.
    """
    if softcap > 0:
        scale_log2, softcap_pre = softcap * math.log2(math.e), scale / softcap
    else:
        scale_log2, softcap_pre = scale * math.log2(math.e), 1.0
    left, right = window
    far = nq + nk + 1
    left = far if left < 0 else left
    right = 0 if causal else (far if right < 0 else right)
    return scale_log2, softcap_pre, left, right
