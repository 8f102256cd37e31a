"""Benchmark plumbing shared by `flashsuite bench` and tests/benchmarks: the standard sweep,
the peers (PyTorch SDPA's flash / cuDNN / efficient backends; any other SDPA backend as
`sdpa-<name>`, e.g. `sdpa-math`; and `fa4`, FlashAttention-4's CuTe-DSL kernels from the
flash-attn-4 package, where it is installed: the optional `peers` extra), the call to time, and
one timer per consumer.

`flashsuite bench` times with CUDA events through `triton.testing.do_bench` (median of repeats
after warm-up; on a CPU, the median of wall-clock repeats); tests/benchmarks lets
pytest-benchmark time the same call (`prepare`), followed by a device synchronisation. Random
inputs (never zeros), the same inputs for every contender of a shape.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from flashsuite.common.flops import attention_flops
from flashsuite.common.testing import Case, make_grad_out, make_inputs

PEERS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
}
TOKENS = 16384  # B·N
MODEL_DIM = 2048  # Hq·D


def standard_sweep(
    head_dims=(64, 128, 256),
    seqlens=(512, 1024, 2048, 4096, 8192, 16384),
    causals=(False, True),
    dtype: torch.dtype = torch.bfloat16,
    tokens: int = TOKENS,
    model_dim: int = MODEL_DIM,
) -> list[Case]:
    """The standard sweep (docs/design.md, "Performance method"): B·N = 16k tokens, Hq·D = 2048,
    N from 512 to 16k. `tokens` and `model_dim` shrink it (smoke runs on a CPU)."""
    for name, total, parts in (("tokens", tokens, seqlens), ("model_dim", model_dim, head_dims)):
        bad = [x for x in parts if x <= 0 or total % x]
        if bad:
            raise ValueError(f"{name}: expected a multiple of every entry of {parts}, got {total}")
    return [
        Case(
            batch=tokens // n,
            seqlen_q=n,
            seqlen_k=n,
            heads_q=model_dim // d,
            heads_kv=model_dim // d,
            head_dim=d,
            dtype=dtype,
            causal=c,
        )
        for d in head_dims
        for c in causals
        for n in seqlens
    ]


def time_ms(
    fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100, device: str = "cuda"
) -> float:
    """Median milliseconds per call: on a GPU CUDA events (do_bench), L2 flushed between calls;
    on a CPU wall-clock repeats for about `rep_ms` after `warmup_ms`."""
    if device != "cpu":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    times: list[float] = []
    for budget, keep in ((warmup_ms, False), (rep_ms, True)):
        end = time.perf_counter() + budget / 1e3
        while True:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if keep:
                times.append((t1 - t0) * 1e3)
            if t1 >= end and (times or not keep):
                break
    return statistics.median(times)


@dataclass
class Result:
    contender: str
    direction: str  # "fwd" | "bwd"
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str
    ms: float
    tflops: float
    error: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _sdpa_fn(backend_name: str, case: Case, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if case.window_size != (-1, -1):
        raise ValueError(f"peer {backend_name}: SDPA takes no window_size, got {case.window_size}")

    backend = getattr(SDPBackend, sdpa_backend(backend_name))
    qt, kt, vt = (
        t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad) for t in (q, k, v)
    )

    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=case.causal)

    return run, (qt, kt, vt)


def _ours_fn(version: str, case: Case, q, k, v):
    from flashsuite import dispatch

    def run():
        return dispatch.attention(
            q, k, v, causal=case.causal, window_size=case.window_size, version=version
        )

    return run, (q, k, v)


def materialising(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False):
    """What a user writes without a fused kernel: softmax(q·kᵀ·scale)·v in the input dtype, S and
    P going through HBM (the baseline fa1 is measured against). q, k, v (B, N, H, D) with Hq = Hkv;
    returns a callable giving out (B, H, N, D). Causal is bottom-right aligned; rows that see
    no key (causal, Nq > Nk) come out NaN, as they do in plain PyTorch."""
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, H, N, D)
    scale = 1.0 / math.sqrt(q.shape[-1])
    n, nk = q.shape[1], k.shape[1]
    visible = (
        torch.ones(n, nk, dtype=torch.bool, device=q.device).tril(nk - n) if causal else None
    )  # (Nq, Nk), bottom-right aligned

    def run():
        s = (qh * scale) @ kh.transpose(-1, -2)  # (B, H, Nq, Nk)
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
        return torch.softmax(s, dim=-1) @ vh

    return run


def sdpa_backend(peer: str) -> str:
    """The `torch.nn.attention.SDPBackend` member a peer name stands for: PEERS, or any
    `sdpa-<backend>` (e.g. `sdpa-math`)."""
    from torch.nn.attention import SDPBackend

    name = PEERS.get(peer) or peer.removeprefix("sdpa-").upper()
    if not peer.startswith("sdpa-") or not hasattr(SDPBackend, name):
        raise ValueError(f"peer: expected one of {sorted(PEERS)} or sdpa-<backend>, got {peer!r}")
    return name


FA4 = "fa4"  # FlashAttention-4's CuTe-DSL forward and backward (flash_attn.cute), a peer


def fa4_function() -> tuple[Callable | None, str]:
    """FA4's `flash_attn_func` (package flash-attn-4, module flash_attn.cute), or None and why
    it cannot be imported. Never a dependency of flashsuite: the `peers` extra installs it."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # not installed, or its CuTe-DSL import failed
        return None, f"{type(exc).__name__}: {exc}"
    return flash_attn_func, ""


def available_peers(device: str = "cuda") -> list[str]:
    """The peers to time by default: SDPA's flash, cuDNN and efficient backends, and FA4 where it
    imports (CUDA only); on a CPU, SDPA's math backend."""
    if device == "cpu":
        return ["sdpa-math"]
    return [*PEERS, FA4] if fa4_function()[0] is not None else list(PEERS)


def _fa4_fn(case: Case, q, k, v):
    fn, why = fa4_function()
    if fn is None:
        raise RuntimeError(f"peer fa4: flash_attn.cute (flash-attn-4) cannot be imported: {why}")

    # FA4 spells an open window edge None
    window = tuple(None if w < 0 else w for w in case.window_size)

    def run():  # (B, N, H, D) in and out, like flashsuite; it also returns the LSE
        res = fn(q, k, v, causal=case.causal, window_size=window)
        return res[0] if isinstance(res, tuple) else res

    return run, (q, k, v)


def make_callable(contender: str, case: Case, q, k, v):
    """(run, leaf tensors) for a version name or a peer name."""
    if contender.startswith("sdpa-"):
        return _sdpa_fn(contender, case, q, k, v)
    if contender == FA4:
        return _fa4_fn(case, q, k, v)
    return _ours_fn(contender, case, q, k, v)


def prepare(
    contender: str, case: Case, direction: str = "fwd", device: str = "cuda"
) -> Callable[[], object]:
    """The call to time: one forward (without autograd) or one backward (of a forward done
    here, once) of `contender` on `case`, inputs made once. Raises what the contender raises."""
    q, k, v = make_inputs(case, device, requires_grad=direction == "bwd")
    run, leaves = make_callable(contender, case, q, k, v)
    if direction == "fwd":

        def forward():
            with torch.no_grad():
                return run()

        return forward
    out = run()
    dout = make_grad_out(case, device)
    if out.shape != dout.shape:  # peers work in (B, H, N, D)
        dout = dout.transpose(1, 2).contiguous()
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def case_flops(case: Case, direction: str) -> float:
    """FLOPs of one call (common/flops.py: causal-aware, backward 2.5x the forward)."""
    return attention_flops(
        case.batch,
        case.heads_q,
        case.seqlen_q,
        case.seqlen_k,
        case.head_dim,
        causal=case.causal,
        backward=direction == "bwd",
    )


def describe(contender: str, case: Case, direction: str) -> dict:
    """The fields of a `Result` naming what was timed (JSON rows, pytest-benchmark extra_info)."""
    return dict(
        contender=contender,
        direction=direction,
        batch=case.batch,
        seqlen=case.seqlen_q,
        heads=case.heads_q,
        head_dim=case.head_dim,
        causal=case.causal,
        dtype=str(case.dtype).removeprefix("torch."),
    )


def measure(contender: str, case: Case, direction: str = "fwd", device: str = "cuda") -> Result:
    """Time one contender on one case; failures are recorded, not raised."""
    base = describe(contender, case, direction)
    try:
        ms = time_ms(prepare(contender, case, direction, device), device=device)
        return Result(**base, ms=ms, tflops=case_flops(case, direction) / ms / 1e9)
    except Exception as exc:  # a peer missing on this build, an unsupported shape, OOM
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        return Result(**base, ms=math.nan, tflops=math.nan, error=msg)
    finally:
        if device != "cpu":
            torch.cuda.empty_cache()
