"""Test helpers shared by the test suite and the benchmarks: input factories, the tolerance
check relative to PyTorch's own error, and the Triton-interpreter bf16 fix.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from flashsuite.common.reference import attention_reference


@dataclass(frozen=True)
class Case:
    """One attention problem for tests and benchmarks (API layout: (B, N, H, D))."""

    batch: int = 1
    seqlen_q: int = 64
    seqlen_k: int = 64
    heads_q: int = 2
    heads_kv: int = 2
    head_dim: int = 64
    head_dim_v: int | None = None
    dtype: torch.dtype = torch.float16
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    softmax_scale: float | None = None
    # Build q/k/v as strided views of larger buffers (last dim still contiguous).
    non_contiguous: bool = False
    # Extra labels for test ids.
    tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def options(self) -> dict:
        return dict(
            causal=self.causal,
            window_size=self.window_size,
            softcap=self.softcap,
            softmax_scale=self.softmax_scale,
        )

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        parts = [
            f"b{self.batch}",
            f"q{self.seqlen_q}",
            f"k{self.seqlen_k}",
            f"h{self.heads_q}-{self.heads_kv}",
            f"d{self.head_dim}" + (f"-{self.dv}" if self.dv != self.head_dim else ""),
            dt,
        ]
        if self.causal:
            parts.append("causal")
        if self.window_size != (-1, -1):
            parts.append(f"win{self.window_size[0]}_{self.window_size[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.softmax_scale is not None:
            parts.append(f"scale{self.softmax_scale:g}")
        if self.non_contiguous:
            parts.append("strided")
        return "-".join(parts + list(self.tags))


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device, gen, non_contiguous: bool):
    if not non_contiguous:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    b, n, h, d = shape
    # A slice out of a buffer with interleaved heads and padding: strides are not the compact
    # ones, but the last dim stays contiguous (the API's only stride requirement).
    big = torch.randn((b, n, 2 * h + 1, d + 8), generator=gen, device=device).to(dtype)
    return big[:, :, 1 : 2 * h + 1 : 2, :d]


def make_inputs(
    case: Case, device: torch.device | str = "cpu", seed: int = 0, requires_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv); never zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = _randn(
        (case.batch, case.seqlen_q, case.heads_q, case.head_dim),
        case.dtype,
        device,
        gen,
        case.non_contiguous,
    )
    k = _randn(
        (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
        case.dtype,
        device,
        gen,
        case.non_contiguous,
    )
    v = _randn(
        (case.batch, case.seqlen_k, case.heads_kv, case.dv),
        case.dtype,
        device,
        gen,
        case.non_contiguous,
    )
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def make_grad_out(case: Case, device: torch.device | str = "cpu", seed: int = 1) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (case.batch, case.seqlen_q, case.heads_q, case.dv)
    return torch.randn(shape, generator=gen, device=device).to(case.dtype)


def rounding_atol(dtype: torch.dtype, scale: float = 1.0) -> float:
    """Absolute slack for the final rounding of a result of magnitude `scale` into `dtype`:
    a few units in the last place, so an exactly-rounded answer always passes."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 1e-3
    return 4.0 * eps * max(scale, 1e-3)


@dataclass
class Comparison:
    name: str
    err: float  # max |ours - ref|
    pt_err: float  # max |pt - ref|: PyTorch's own error in the input dtype
    bound: float
    ok: bool

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"{self.name}: max|ours-ref|={self.err:.3g} bound={self.bound:.3g} "
            f"(pytorch's own error {self.pt_err:.3g}) {verdict}"
        )


def compare(
    name: str,
    ours: torch.Tensor,
    ref: torch.Tensor,
    pt: torch.Tensor,
    factor: float = 2.0,
    dtype: torch.dtype | None = None,
) -> Comparison:
    """DESIGN.md's tolerance: max|ours - ref| <= factor * max|pt - ref| + rounding. NaN fails.

    `ref` is the oracle in fp32/fp64, `pt` the same maths in the input dtype; `factor` is 2 for
    outputs and 3 for gradients. Infinite entries (LSE of empty rows) must match exactly.
    """
    ours32, ref32, pt32 = ours.detach().double(), ref.detach().double(), pt.detach().double()
    if ours32.shape != ref32.shape:
        raise AssertionError(f"{name}: shape {tuple(ours32.shape)} != {tuple(ref32.shape)}")
    if torch.isnan(ours32).any():
        return Comparison(name, math.nan, math.nan, 0.0, False)
    inf_ref = torch.isinf(ref32)
    if not torch.equal(torch.isinf(ours32), inf_ref) or not torch.equal(
        ours32[inf_ref], ref32[inf_ref]
    ):
        return Comparison(name, math.inf, math.nan, 0.0, False)
    fin = ~inf_ref
    if not fin.any():
        return Comparison(name, 0.0, 0.0, 0.0, True)
    err = (ours32[fin] - ref32[fin]).abs().max().item()
    pt_fin = pt32[fin]
    pt_err = (pt_fin - ref32[fin]).abs().nan_to_num(0.0, 0.0, 0.0).max().item()
    mag = ref32[fin].abs().max().item()
    bound = factor * pt_err + rounding_atol(dtype or ours.dtype, mag)
    return Comparison(name, err, pt_err, bound, err <= bound)


def reference_pair(q, k, v, *, grad_out=None, **options):
    """Oracle outputs in a wide dtype and in the input dtype ("PyTorch's own error"), with grads.

    Returns dict name -> (ref, pt) for out, lse and, if `grad_out` is given, dq, dk, dv.
    """
    # The oracle must be well above the input precision: fp32 for 16-bit inputs, fp64 for fp32.
    wide = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    results = {}
    for tag, compute_dtype in (("ref", wide), ("pt", None)):
        qs, ks, vs = (t.detach().clone().requires_grad_(grad_out is not None) for t in (q, k, v))
        out, lse = attention_reference(qs, ks, vs, compute_dtype=compute_dtype, **options)
        entry = {"out": out.detach(), "lse": lse.detach()}
        if grad_out is not None:
            dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), grad_out.to(out.dtype))
            entry.update(dq=dq, dk=dk, dv=dv)
        results[tag] = entry
    return {name: (results["ref"][name], results["pt"][name]) for name in results["ref"]}


def patch_triton_interpreter_bf16() -> bool:
    """Make bf16 `tl.dot` correct under TRITON_INTERPRET=1 (triton-lang/triton#11584).

    The interpreter keeps bf16 as uint16 bit patterns and multiplies them as integers; up-cast
    bf16 operands to fp32 before the matmul. Returns True if the patch was applied.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_flashsuite_bf16", False):
        return True
    original = builder.create_dot

    def _as_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None)
            return interpreter.TensorHandle(data.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, _as_f32(a), _as_f32(b), d, input_precision, max_num_imprecise_acc)

    create_dot._flashsuite_bf16 = True
    builder.create_dot = create_dot
    return True


@contextlib.contextmanager
def hang_watchdog(seconds: float) -> Iterator[None]:
    """End the process (printing every thread's traceback) if the block runs past `seconds`.

    For GPU checks of kernels with barriers: a protocol bug hangs the GPU, which no in-process
    exception can interrupt; the scripts save their JSON before each watched step.
    FLASHSUITE_HANG_SCALE multiplies every limit, for runs where everything is slower
    (compute-sanitizer's racecheck makes the oracle's matmuls many times slower).
    """
    seconds *= float(os.environ.get("FLASHSUITE_HANG_SCALE", "1"))
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
