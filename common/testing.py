"""Test helpers shared by the test suite and the benchmarks: input factories, the tolerance
check relative to PyTorch's own error, and the Triton-interpreter bf16 fix.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from flashsuite.common.fp8_reference import scores_capped_and_masked
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
    # Large logits: q, k and v are standard normal times `amplitude` (x12: scores ~ 144x wider,
    # softmax rows nearly one-hot), and `spikes` keys are 20x longer than the rest (a few huge
    # scores in every row, far above the running max of the blocks before them).
    amplitude: float = 1.0
    spikes: int = 0
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
        if self.amplitude != 1.0:
            parts.append(f"x{self.amplitude:g}")
        if self.spikes:
            parts.append(f"spikes{self.spikes}")
        return "-".join(parts + list(self.tags))


def _randn(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device,
    gen,
    non_contiguous: bool,
    amplitude: float = 1.0,
    spikes: int = 0,
):
    b, n, h, d = shape
    # Non-contiguous: a slice out of a buffer with interleaved heads and padding (strides are
    # not the compact ones, the last dim stays contiguous: the API's only stride requirement).
    full = (b, n, 2 * h + 1, d + 8) if non_contiguous else shape
    x = torch.randn(full, generator=gen, device=device, dtype=torch.float32) * amplitude
    if spikes:
        # Spread over the sequence, the last one at the end (after every other block).
        x[:, torch.linspace(0, n - 1, spikes, device=device).round().long()] *= 20.0
    x = x.to(dtype)
    return x[:, :, 1 : 2 * h + 1 : 2, :d] if non_contiguous else x


def make_inputs(
    case: Case, device: torch.device | str = "cpu", seed: int = 0, requires_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q (B, Nq, Hq, D), k (B, Nk, Hkv, D), v (B, Nk, Hkv, Dv); never zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    amp, nc = case.amplitude, case.non_contiguous
    q = _randn(
        (case.batch, case.seqlen_q, case.heads_q, case.head_dim), case.dtype, device, gen, nc, amp
    )
    k = _randn(
        (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
        case.dtype,
        device,
        gen,
        nc,
        amp,
        case.spikes,
    )
    v = _randn(
        (case.batch, case.seqlen_k, case.heads_kv, case.dv), case.dtype, device, gen, nc, amp
    )
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def make_grad_out(case: Case, device: torch.device | str = "cpu", seed: int = 1) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (case.batch, case.seqlen_q, case.heads_q, case.dv)
    return torch.randn(shape, generator=gen, device=device).to(case.dtype)


# The comparison rule (docs/testing.md). Every numerical test checks a kernel result `ours`
# against the float64 oracle `ref` and measures it against `pt`, the same computation done by
# PyTorch in the input dtype (for the LSE, a float32 output whatever the inputs, in float32):
#
#     max|ours - ref|  <= MAX_FACTOR  * max|pt - ref|  + floor
#     mean|ours - ref| <= MEAN_FACTOR * mean|pt - ref| + floor
#     floor = FLOOR_ULPS * eps(float32) * max(rms|ref|, 1)
#
# where PyTorch's error is never taken below that of rounding `ref` into the delivered dtype
# (where PyTorch's arithmetic is exact by luck, a kernel may still round the last bit).
#
# The max bounds the worst element; the mean bounds systematic drift (an output off by 1 %, an
# LSE shifted by 0.01) that hides under the max of a low-precision yardstick. The factors are
# the same for the output, the LSE and every gradient, and come from the ratios ours/pt over
# every CPU case of every version (docs/testing.md): in bf16 and fp16 no max ratio exceeds 2.0
# and no mean ratio 1.6; the largest elsewhere (2.75 max, 2.0 mean) are float32 gradients and
# LSEs whose errors on both sides are float32 roundoff.
MAX_FACTOR = 3.0
MEAN_FACTOR = 2.5
# Against the e4m3-rounding baseline of the float8 path (the kernel rounds Q, K, V and P the
# same way, so its error is the baseline's plus accumulation order).
FP8_FACTOR = 1.5
# The floor only matters where PyTorch's own error is ~0 while the kernel's is float32
# roundoff: an exact answer reached by cancellation (dQ of a row that sees one key is 0 in
# exact maths, and in PyTorch's arithmetic, but sums of O(1) terms in the kernel's). 64
# float32 ulps of the data's scale (inputs are standard normal: max(rms, 1)) is ~8e-6: far
# below PyTorch's own error in 16-bit dtypes and below anything a 1 % error produces.
FLOOR_ULPS = 64.0

_LOG_ENV = "FLASHSUITE_COMPARE_LOG"


@dataclass
class Comparison:
    name: str
    err: float  # max |ours - ref|
    pt_err: float  # max |pt - ref|: PyTorch's own error in the input dtype
    bound: float
    ok: bool
    mean_err: float = 0.0  # mean |ours - ref|
    pt_mean_err: float = 0.0  # mean |pt - ref|
    mean_bound: float = 0.0
    factor: float = 0.0  # the max's factor

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"{self.name}: max|ours-ref|={self.err:.3g} bound={self.bound:.3g} "
            f"(pytorch's {self.pt_err:.3g}), mean|ours-ref|={self.mean_err:.3g} "
            f"bound={self.mean_bound:.3g} (pytorch's {self.pt_mean_err:.3g}): {verdict}"
        )


def compare(
    name: str,
    ours: torch.Tensor,
    ref: torch.Tensor,
    pt: torch.Tensor,
    factor: float | None = None,
    dtype: torch.dtype | None = None,
) -> Comparison:
    """The suite's one comparison rule (see MAX_FACTOR above and docs/testing.md).

    `ref` is the float64 oracle, `pt` the same maths in the input dtype (`reference_pair` makes
    both). `factor`, when given, replaces both MAX_FACTOR and MEAN_FACTOR (FP8_FACTOR against
    the e4m3 baseline); `dtype`, when given, is the dtype `ours` must
    have. An LSE must be float32 (never cast to q's dtype). NaN fails; infinite entries (LSE
    of rows that see no key) must match exactly.
    """
    max_factor, mean_factor = (factor, factor) if factor is not None else (MAX_FACTOR, MEAN_FACTOR)
    if dtype is not None and ours.dtype != dtype:
        raise AssertionError(f"{name}: expected dtype {dtype}, got {ours.dtype}")
    if name == "lse" and ours.dtype not in (torch.float32, torch.float64):
        raise AssertionError(f"lse: expected float32, got {ours.dtype} (the LSE is never cast)")
    ours64, ref64, pt64 = ours.detach().double(), ref.detach().double(), pt.detach().double()
    if ours64.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(ours64.shape)} != {tuple(ref64.shape)}")
    nan = math.nan
    if torch.isnan(ours64).any():
        return Comparison(name, nan, nan, 0.0, False, nan, nan, 0.0, max_factor)
    inf_ref = torch.isinf(ref64)
    if not torch.equal(torch.isinf(ours64), inf_ref) or not torch.equal(
        ours64[inf_ref], ref64[inf_ref]
    ):
        return Comparison(name, math.inf, nan, 0.0, False, math.inf, nan, 0.0, max_factor)
    fin = ~inf_ref
    if not fin.any():
        return Comparison(name, 0.0, 0.0, 0.0, True, 0.0, 0.0, 0.0, max_factor)
    ref_f = ref64[fin]
    err = (ours64[fin] - ref_f).abs()
    pt_err = (pt64[fin] - ref_f).abs().nan_to_num(0.0, 0.0, 0.0)
    # Never below the rounding of the exact answer into the delivered dtype: where PyTorch's
    # arithmetic happens to be exact (one visible key: P = 1), that is the best possible.
    rounding = (ref_f.to(ours.dtype).double() - ref_f).abs()
    pt_max = max(pt_err.max().item(), rounding.max().item())
    pt_mean = max(pt_err.mean().item(), rounding.mean().item())
    ref_rms = ref_f.square().mean().sqrt().item()
    floor = FLOOR_ULPS * torch.finfo(torch.float32).eps * max(ref_rms, 1.0)
    bound = max_factor * pt_max + floor
    mean_bound = mean_factor * pt_mean + floor
    res = Comparison(
        name,
        err.max().item(),
        pt_max,
        bound,
        False,
        err.mean().item(),
        pt_mean,
        mean_bound,
        max_factor,
    )
    res.ok = res.err <= bound and res.mean_err <= mean_bound
    log = os.environ.get(_LOG_ENV)
    if log:  # calibration: one JSON line per comparison (docs/testing.md)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(log, "a") as f:
            record = dict(test=test, dtype=str(ours.dtype), ref_rms=ref_rms, **asdict(res))
            f.write(json.dumps(record) + "\n")
    return res


def reference_pair(q, k, v, *, grad_out=None, **options):
    """The float64 oracle and the same maths in the input dtype ("PyTorch's own error").

    Returns dict name -> (ref, pt) for out, lse and, if `grad_out` is given, dq, dk, dv. The
    LSE's `pt` is computed in float32 (the LSE is a float32 output whatever the inputs, and
    16-bit inputs are exact in float32); everything else's in q's dtype.
    """
    results = {}
    for tag, compute_dtype in (("ref", torch.float64), ("pt", None)):
        qs, ks, vs = (t.detach().clone().requires_grad_(grad_out is not None) for t in (q, k, v))
        out, lse = attention_reference(qs, ks, vs, compute_dtype=compute_dtype, **options)
        entry = {"out": out.detach(), "lse": lse.detach()}
        if grad_out is not None:
            dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), grad_out.to(out.dtype))
            entry.update(dq=dq, dk=dk, dv=dv)
        results[tag] = entry
    if q.dtype not in (torch.float32, torch.float64):
        with torch.no_grad():
            _, lse32 = attention_reference(q, k, v, compute_dtype=torch.float32, **options)
        results["pt"]["lse"] = lse32
    return {name: (results["ref"][name], results["pt"][name]) for name in results["ref"]}


def patch_triton_interpreter_bf16() -> bool:
    """Make bf16 arithmetic under TRITON_INTERPRET=1 behave as on the GPU.

    1. `tl.dot` (triton-lang/triton#11584): the interpreter keeps bf16 as uint16 bit patterns
       and multiplies them as integers; up-cast bf16 operands to fp32 before the matmul.
    2. fp32 -> bf16 casts: the interpreter truncates (rounds toward zero), the GPU's
       cvt.rn.bf16.f32 rounds to nearest even. Truncation turns a recomputed P = 0.99999994
       into 0.99609375 instead of 1.0: a one-ulp error the compiled kernel does not make.
    Returns True if the patches are applied.
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
    original_dot, original_cast = builder.create_dot, builder.cast_impl

    def _as_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None)
            return interpreter.TensorHandle(data.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, _as_f32(a), _as_f32(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original_cast(self, src, dst_type)
        x = np.ascontiguousarray(src.data, dtype=np.float32)
        bits = x.view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
        out = np.where(np.isnan(x), np.uint32(0x7FC0), rounded).astype(np.uint16)
        return interpreter.TensorHandle(
            out.view(interpreter._get_np_dtype(dst_type)), dst_type.scalar
        )

    create_dot._flashsuite_bf16 = True
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
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


def ordered_backward_runs(select, forward, inputs: tuple, dout, runs: int = 5) -> tuple:
    """`runs` forward + backward passes (`forward()` returns the output; gradients of `inputs`
    for `dout`) under torch.use_deterministic_algorithms(True, warn_only=True) (restored
    after; warn_only lets cuBLAS run without CUBLAS_WORKSPACE_CONFIG) and a hang
    watchdog (a turn counter that never reaches its value hangs the kernel); asserts the runs'
    gradients are bitwise equal and returns (`select()`'s dispatch Choice taken under the
    flag, the first run's gradients)."""
    results = []
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        choice = select()
        with hang_watchdog(240):  # the first calls compile
            for _ in range(runs):
                results.append(torch.autograd.grad(forward(), inputs, dout))
                torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(was)
    for i, grads in enumerate(results[1:], start=1):
        for j, (a, b) in enumerate(zip(results[0], grads, strict=True)):
            assert torch.equal(a, b), f"gradient {j} of run {i} differs from run 0"
    return choice, results[0]


# Hopper's e4m3 wgmma does not accumulate in float32. Read off fa3's kernel with crafted dot
# products (benchmarks/fp8_acc_probe.py; H100, 2026-12-05: 166 rows, 96 of them random, every
# one matched to the LSE's float32 round trip): in each k = 32 step the accumulator and the 32
# exact products are aligned to the largest exponent among them and each is cut toward zero to
# FP8_ACC_BITS bits below that exponent's leading bit; their sum is then cut toward zero to
# FP8_ACC_BITS bits below its own leading bit. So a product 2^-14 of the largest addend is lost
# whole (a +256 with 31 addends of 2^-6 sums to 256), wherever it sits in the step. fa3's fp8
# LSE is measured against this emulation (mma_truncated); the cut of the sum alone (an earlier
# model) underestimates the kernel's error up to 2.3x on scores with cancellation.
FP8_ACC_BITS = 13
FP8_MMA_K = 32  # wgmma K of 8-bit operands


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 x with its mantissa cut to `bits` bits (toward zero); 23 leaves x unchanged."""
    if bits >= 23:
        return x
    raw = x.contiguous().view(torch.int32)
    return (raw & ~((1 << (23 - bits)) - 1)).view(torch.float32)


def mma_truncated(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int) -> torch.Tensor:
    """acc + a @ b (float32 (..., M, N)) as the e4m3 wgmma accumulates it with `bits` bits (the
    FP8_ACC_BITS note above): per k = FP8_MMA_K step, acc and the step's products aligned to
    the largest exponent among them and cut, then their sum cut. a, b hold e4m3 values (their
    products are exact in float32). 23 bits: plain float32."""
    if bits >= 23:
        return acc + a @ b
    acc = acc.float()
    a, bt = a.float(), b.float().transpose(-1, -2)  # (..., M, K), (..., N, K)
    n, m = bt.shape[-2], a.shape[-2]
    outer = max(1, acc[..., :1, :1].numel())
    rows = max(1, (1 << 24) // (outer * n * FP8_MMA_K))  # M rows per (..., rows, N, K) chunk
    out = []
    for m0 in range(0, m, rows):
        c = acc[..., m0 : m0 + rows, :]
        for k0 in range(0, a.shape[-1], FP8_MMA_K):
            ks = slice(k0, k0 + FP8_MMA_K)
            prods = a[..., m0 : m0 + rows, None, ks] * bt[..., None, :, ks]  # (..., rows, N, K)
            top = torch.maximum(c.abs(), prods.abs().amax(-1))
            _, e = torch.frexp(top)  # top = f * 2^e, f in [0.5, 1): leading bit 2^(e - 1)
            # No finer than float32's smallest subnormal (a step of tiny P would divide by 0).
            ulp = torch.ldexp(torch.ones_like(top), (e - 1 - bits).clamp_min(-149))
            # Multiples of ulp below 2^(bits + 1) each: the sum of 33 is exact in float32.
            step = torch.trunc(c / ulp) + torch.trunc(prods / ulp[..., None]).sum(-1)
            c = truncate_mantissa(step * ulp, bits)
        out.append(c)
    return torch.cat(out, dim=-2)


def fp8_lse_baseline(
    q8, k8, descales=(None, None, None), acc_bits: int = FP8_ACC_BITS, **options
) -> torch.Tensor:
    """The LSE (B, Hq, Nq) float32 of e4m3 q, k whose scores are accumulated with `acc_bits`
    mantissa bits (mma_truncated), then descaled, capped, masked and reduced in float64."""

    from flashsuite.common.fp8 import descale_rows

    b, nq, hq, d = q8.shape
    nk, hkv = k8.shape[1], k8.shape[2]
    g = hq // hkv
    ones = torch.ones(b, hkv, device=q8.device)
    ds_q, ds_k = (t if t is not None else ones for t in descales[:2])
    qf = q8.float().transpose(1, 2)  # (B, Hq, Nq, D)
    kf = k8.float().repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, D)
    s = mma_truncated(torch.zeros(b, hq, nq, nk, device=q8.device), qf, kf.transpose(-1, -2),
                      acc_bits).double()  # fmt: skip
    # Each row's descale of q times each key's of k (block views: per block; else per head).
    rows_q = descale_rows(ds_q, nq)  # (B, Hq or Hkv, Nq or 1)
    if rows_q.shape[1] != hq:
        rows_q = rows_q.repeat_interleave(g, 1)
    rows_k = descale_rows(ds_k, nk).repeat_interleave(g, 1)  # (B, Hq, Nk or 1)
    descale = rows_q[..., :, None].double() * rows_k[..., None, :].double()  # (B, Hq, Nq, Nk)
    s = scores_capped_and_masked(s * descale * (options.get("softmax_scale") or d**-0.5), options)
    return torch.logsumexp(s, dim=-1).float()


def fp8_baseline(q8, k8, v8, descales=(None, None, None), **options) -> torch.Tensor:
    """The fp8 path's own error: attention of the dequantised e4m3 q, k, v in float32 with
    P = exp(S - rowmax) rounded to e4m3 before P·V (as the fp8 kernel feeds its PV wgmma; the
    row sum stays float32), delivered in bf16 like the kernel's output. (B, Nq, Hq, Dv).
    Descales (B, Hkv), q's shared by its GQA group: common.fp8_reference.attention_fp8 in
    "head" mode."""
    from flashsuite.common.fp8 import Fp8Tensor
    from flashsuite.common.fp8_reference import attention_fp8

    b, hq, hkv = q8.shape[0], q8.shape[2], k8.shape[2]
    ones = torch.ones(b, hkv, device=q8.device)
    ds_q, ds_k, ds_v = (t if t is not None else ones for t in descales)
    q = Fp8Tensor(q8, ds_q, "head", group=hq // hkv)
    return attention_fp8(q, Fp8Tensor(k8, ds_k), Fp8Tensor(v8, ds_v), **options)
