"""Host time per call of `dispatch.attention`, per version: everything but the kernel.

    python -m benchmarks.host_overhead            # CPU: the kernels replaced by no-ops
    python -m benchmarks.host_overhead --backward # CPU: also fa3's training step
    python -m benchmarks.host_overhead --gpu      # GPU: wall time minus the kernel's time
    python -m benchmarks.host_overhead --sdpa     # CPU: dispatch.sdpa vs F.sdpa, whole calls
    python -m benchmarks.host_overhead --kvcache [--gpu]  # decode steps, attention_with_kvcache
    python -m benchmarks.host_overhead --varlen [--gpu]   # packed sequences, attention_varlen

CPU mode plans for sm90 (`override_arch(90)`) on tiny CPU tensors and replaces each version's
kernel launch (fa3's compiled binary, the Triton kernels of fa2 and fa1) by a no-op, so what
is timed is the whole host path: selection, validation, op arguments, the custom-op dispatch,
the launch-plan lookup, the output allocations. GPU mode times tiny calls on the device
(wall time per call, each call followed by a synchronize) and subtracts the kernel time that
CUDA events measure around single calls, next to `F.scaled_dot_product_attention` timed the
same way; `--backward` adds the host time of one forward + backward step. The table's
columns are `gpu_table`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from flashsuite.common.arch import override_arch
from flashsuite.dispatch import api

SHAPE = (1, 128, 1, 64)  # (B, N, H, D): the tiny call, all host path


class _NoCompiled:
    """Stands in for a compiled Triton kernel: its launches (common.triton_launch's repeat
    calls) do nothing."""

    function = packed_metadata = None

    def run(self, *args) -> None:
        pass

    def __getitem__(self, grid):
        return lambda *args: None


class _NoKernel:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing and returns a compiled
    stand-in, as Triton's launch returns its compiled kernel, so the memoised launch path of
    common.triton_launch is what repeat calls time."""

    def __init__(self, kernel) -> None:
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoCompiled()


@contextlib.contextmanager
def stubbed_kernels() -> Iterator[None]:
    """Replace the kernel launches of fa1, fa2 and fa3 and the portable version's compute by
    no-ops (CPU timing of the host path); fa3's SM count becomes a constant (no device here)."""
    from flashsuite.common import bwd_postprocess, bwd_preprocess, split_combine, triton_launch
    from flashsuite.fa1 import kernels as fa1_kernels
    from flashsuite.fa2 import decode as fa2_decode
    from flashsuite.fa2 import kernels as fa2_kernels
    from flashsuite.fa2 import varlen as fa2_varlen
    from flashsuite.fa3 import bwd_host, decode_host
    from flashsuite.fa3 import compile as fa3_compile  # imports the CuTe DSL only to compile

    sm = type("Props", (), {"multi_processor_count": 132})
    patches = [
        (fa1_kernels, "fa1_fwd_kernel", _NoKernel(fa1_kernels.fa1_fwd_kernel)),
        (fa2_kernels, "_attn_fwd", _NoKernel(fa2_kernels._attn_fwd)),
        (fa3_compile, "get_forward", lambda key: lambda *args: None),
        (fa3_compile, "get_decode", lambda key: lambda *args: None),
        (decode_host, "_launch_plans", {}),  # plans made here hold the stand-in binary
        (fa2_decode, "_decode_split", _NoKernel(fa2_decode._decode_split)),
        (split_combine, "_combine", _NoKernel(split_combine._combine)),
        (fa2_decode, "_combine", _NoKernel(split_combine._combine)),  # the name fa2 launches
        (bwd_host, "get_backward", lambda key: lambda *args: None),
        (bwd_host, "preprocess", _stats_only),
        (bwd_postprocess, "_dq_postprocess", _NoKernel(bwd_postprocess._dq_postprocess)),
        (bwd_preprocess, "varlen_bwd_preprocess", _varlen_stats_only),
        *(
            (fa2_varlen, name, _NoKernel(getattr(fa2_varlen, name)))
            for name in (
                "_varlen_fwd",
                "_varlen_bwd_preprocess",
                "_varlen_bwd_dkdv",
                "_varlen_bwd_dq",
            )
        ),
        (triton_launch, "_stream", lambda device: 0),
        (torch.cuda, "get_device_properties", lambda device=None: sm),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    # The portable version's "kernel" is its torch compute, and its custom op holds the
    # function itself: swap the function's code for an allocation of the outputs.
    from flashsuite.dispatch import portable

    portable_code = portable.forward.__code__
    try:
        for mod, name, stub in patches:
            setattr(mod, name, stub)
        portable.forward.__code__ = _outputs_only.__code__
        yield
    finally:
        portable.forward.__code__ = portable_code
        for mod, name, original in saved:
            setattr(mod, name, original)


def _outputs_only(q, k, v, p, descale_q=None, descale_k=None, descale_v=None):
    """The outputs of a forward, uninitialised: out (B, Nq, Hq, Dv), lse (B, Hq, Nq)."""
    out = torch.empty(p.batch, p.seqlen_q, p.heads_q, p.head_dim_v, dtype=p.out_dtype)
    return out, torch.empty(p.batch, p.heads_q, p.seqlen_q, dtype=torch.float32)


def _step(out: torch.Tensor) -> None:
    out.sum().backward()


def _stats_only(dout, out, lse, tile_m, dq_d=0):
    """The fa3 backward preprocess's outputs, uninitialised: LSE and D (B, Hq, Nq_pad) fp32 and
    the dQ accumulator (B, Hq, Nq_pad, dq_d) fp32 when dq_d > 0 (bwd_host.preprocess)."""
    b, nq, hq, _ = out.shape
    rows = -(-nq // tile_m) * tile_m
    acc = torch.empty(b, hq, rows, dq_d) if dq_d else None
    return torch.empty(b, hq, rows), torch.empty(b, hq, rows), acc


def _varlen_stats_only(out, dout, lse, cu_seqlens_q, tile_m, dq_acc=None):
    """The fa3 varlen backward preprocess's outputs, uninitialised: delta and LSE (Hq,
    rows_pad) fp32 (common.bwd_preprocess.varlen_bwd_preprocess)."""
    from flashsuite.common.bwd_preprocess import varlen_pad_rows

    rows = varlen_pad_rows(out.shape[0], cu_seqlens_q.shape[0] - 1, tile_m)
    return torch.empty(out.shape[1], rows), torch.empty(out.shape[1], rows)


def per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Median over 5 repeats of the wall time of `calls` back-to-back calls, per call."""
    for _ in range(min(calls, 200)):
        fn()
    sync()
    times = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return sorted(times)[len(times) // 2]


def kernel_us(fn: Callable[[], object], reps: int = 50) -> float:
    """Device time of one call, CUDA events around each (median): what the GPU itself spends."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def _tensors(device: str, dtype: torch.dtype, grad: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    return tuple(
        torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)
        for _ in range(3)
    )


def cpu_table(
    versions: tuple[str, ...], calls: int, backward: bool = False, causal: bool = False
) -> list[tuple[str, float]]:
    """Host µs per forward call of each version on CPU tensors, kernels stubbed, planning for
    sm90. With `backward` (fa3 only: its backward binary and preprocess are the stubbed
    kernels), also a forward on inputs that need a gradient, and a training step
    (forward, `out.sum().backward()`). `causal`: causal calls (tile-counter builds in fa3)."""
    q, k, v = _tensors("cpu", torch.bfloat16, grad=False)
    c = {"causal": causal}
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    rows = []
    with override_arch(90), stubbed_kernels():
        for name in versions:
            steps = [
                (name, lambda n=name: _no_grad(lambda: api.attention(q, k, v, version=n, **c)))
            ]
            if backward and name == "fa3":
                steps += [
                    ("fa3 fwd, grad", lambda: api.attention(qg, kg, vg, version="fa3", **c)),
                    ("fa3 fwd+bwd", lambda: _step(api.attention(qg, kg, vg, version="fa3", **c))),
                ]
            for label, fn in steps:
                try:
                    fn()
                except Exception as exc:  # a version that cannot run here: say why, keep going
                    print(f"{label}: skipped ({type(exc).__name__}: {exc})")
                    continue
                rows.append((label, per_call_us(fn, calls, lambda: None)))
    return rows


LAYERS = 32  # the layers of one decode step: the metadata changes once per step


def _per_step(fn: Callable[[], object], *metadata: torch.Tensor) -> Callable[[], object]:
    """`fn` as one layer's call of a decode step of LAYERS layers: before every LAYERS-th call
    the metadata tensors are written in place (their values kept), as a serving loop advances
    its lengths once per step, so the value checks run once per step, not once per call."""
    count = 0

    def call():
        nonlocal count
        if count % LAYERS == 0:
            for t in metadata:
                t.add_(0)  # an in-place write: a new version, the same values
        count += 1
        return fn()

    return call


def _kvcache_calls(device: str, version: str) -> list[tuple[str, Callable[[], object]]]:
    """Decode steps through `dispatch.attention_with_kvcache` (GQA 32/8, D 128, bf16): B 1 on
    4k keys with a tensor length, with the append of one new token, with an int length (what
    transformers' decode step passes), the append through flash_attn_with_kvcache with rotary
    tables and the same step as a dense call through `dispatch.attention` (beside fa3: those
    dispatch by themselves), and B 32 on 64-token pages with a shuffled table. Each call is
    one layer of a LAYERS-layer step (`_per_step`)."""
    from flashsuite import dispatch

    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    q, kn = rand(1, 1, 32, 128), rand(1, 1, 8, 128)
    kc, vc = rand(1, 4096, 8, 128), rand(1, 4096, 8, 128)
    lens = torch.tensor([4000], dtype=torch.int32, device=device)
    q32, pages = rand(32, 1, 32, 128), rand(32 * 64, 64, 8, 128)
    table = torch.randperm(32 * 64, generator=gen).to(device, torch.int32).view(32, 64)
    lens32 = torch.randint(1, 4000, (32,), generator=gen).to(device, torch.int32)
    call = dispatch.attention_with_kvcache
    theta = torch.rand(4096, 64, generator=gen).to(device) * 6.0
    cos, sin = theta.cos(), theta.sin()

    def rotary():  # flash-attn's name with rotary tables: q and the new k rotated, appended
        return dispatch.flash_attn_with_kvcache(
            q, kc, vc, kn, kn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, causal=True
        )

    return [
        ("B1 4k", _per_step(lambda: call(q, kc, vc, cache_seqlens=lens, version=version), lens)),
        ("B1 4k +append", _per_step(
            lambda: call(q, kc, vc, kn, kn, cache_seqlens=lens, version=version), lens)),
        ("B1 4k int len", lambda: call(q, kc, vc, cache_seqlens=4000, version=version)),
        *([("B1 4k +append +rotary (flash-attn name, auto)", _per_step(rotary, lens)),
           # a dense call of one query (decode_route: the same kernel, k and v as full rows)
           ("B1 4k dense Nq 1 (attention)", lambda: dispatch.attention(q, kc, vc, version=version))]
          if version == "fa3" else []),
        ("B32 paged", _per_step(lambda: call(q32, pages, pages, cache_seqlens=lens32,
                                             block_table=table, version=version), lens32, table)),
    ]  # fmt: skip


def entry_table(entry: str, versions: tuple[str, ...], calls: int, gpu: bool) -> list[tuple]:
    """(call, checks on, µs per call) of `_kvcache_calls` (entry "kvcache") or `_varlen_calls`
    ("varlen") for each version, the metadata value checks on (the default) and off: on a CPU
    with the kernels stubbed (planning for sm90), or on the GPU pipelined (back to back, then
    one synchronize)."""
    import os

    make_calls = {"kvcache": _kvcache_calls, "varlen": _varlen_calls}[entry]
    rows = []
    # On the GPU the device's own architecture plans (override_arch(None) would mean "no GPU").
    arch = contextlib.nullcontext() if gpu else override_arch(90)
    ctx = contextlib.nullcontext() if gpu else stubbed_kernels()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    with arch, ctx:
        for check in ("1", "0"):
            os.environ["FLASHSUITE_CHECK_METADATA"] = check
            for name in versions:
                for label, fn in make_calls("cuda" if gpu else "cpu", name):
                    try:
                        fn()
                    except Exception as exc:
                        print(f"{name} {label}: skipped ({type(exc).__name__}: {exc})")
                        continue
                    rows.append((f"{name} {label}", check == "1", per_call_us(fn, calls, sync)))
    os.environ.pop("FLASHSUITE_CHECK_METADATA", None)
    return rows


def _varlen_calls(device: str, version: str) -> list[tuple[str, Callable[[], object]]]:
    """Packed sequences through `dispatch.attention_varlen` (4 sequences of 32 tokens, GQA 4/2,
    D 64, bf16, causal): the forward without a gradient, with one, and a training step
    (forward, then backward of out.sum()); one cu_seqlens tensor for every call, as a model's
    layers share theirs, written in place once per LAYERS calls (`_per_step`)."""
    from flashsuite import dispatch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(128, h, 64, generator=gen).to(device=device, dtype=torch.bfloat16)
        for h in (4, 2, 2)
    )
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 32, 64, 96, 128], dtype=torch.int32, device=device)

    def call(q, k, v):
        return dispatch.attention_varlen(q, k, v, cu, cu, 32, 32, causal=True, version=version)

    return [
        ("fwd", _per_step(lambda: _no_grad(lambda: call(q, k, v)), cu)),
        ("fwd, grad", _per_step(lambda: call(qg, kg, vg), cu)),
        ("fwd+bwd", _per_step(lambda: _step(call(qg, kg, vg)), cu)),
    ]


def gpu_table(
    versions: tuple[str, ...], calls: int, backward: bool, causal: bool = False
) -> list[tuple]:
    """(name, pipelined, synced, kernel, host) µs per forward call on the GPU, SDPA first:
    wall time per call of back-to-back calls (host-bound for tiny calls: the GPU waits), of
    calls each followed by a synchronize, the kernel time (CUDA events), and host = synced -
    kernel (launch latency included). With `backward`, the same for a forward + backward;
    `causal`: causal calls."""
    q, k, v = _tensors("cuda", torch.bfloat16, grad=backward)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(backward) for t in (q, k, v))
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)}
    fns |= {n: (lambda n=n: api.attention(q, k, v, version=n, causal=causal)) for n in versions}
    rows, sync = [], torch.cuda.synchronize
    for name, fwd in fns.items():
        # The forward alone as inference runs it (no grad), then a training step.
        steps = [("fwd", lambda fwd=fwd: _no_grad(fwd))]
        if backward:
            steps.append(("fwd+bwd", lambda fwd=fwd: fwd().sum().backward()))
        for label, fn in steps:
            try:
                fn()
            except Exception as exc:
                print(f"{name} {label}: skipped ({type(exc).__name__}: {exc})")
                continue
            pipelined = per_call_us(fn, calls, sync)
            serial = per_call_us(lambda fn=fn: (fn(), sync()), calls, sync)
            kern = kernel_us(fn)
            rows.append((f"{name} {label}", pipelined, serial, kern, max(serial - kern, 0.0)))
    return rows


# (B, H, N, D), dtype, is_causal, calls per timing: dispatch.sdpa on a CPU, whole calls.
SDPA_SHAPES = [
    ((1, 1, 128, 64), torch.float32, False, 2000),
    ((2, 8, 256, 64), torch.float32, True, 200),
    ((2, 8, 1024, 64), torch.float32, True, 20),
    ((2, 8, 1024, 128), torch.bfloat16, False, 10),
    ((1, 16, 2048, 64), torch.float32, True, 5),
]


def sdpa_cpu_table() -> list[tuple]:
    """(shape, dtype, causal, F.sdpa us, dispatch.sdpa us) per call on CPU tensors, no grad:
    what a user of the drop-in pays over PyTorch's own SDPA on a CPU."""
    from flashsuite import dispatch

    rows = []
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for shape, dtype, causal, calls in SDPA_SHAPES:
            qkv = [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]
            times = [
                per_call_us(lambda f=f, a=qkv, c=causal: f(*a, is_causal=c), calls, lambda: None)
                for f in (F.scaled_dot_product_attention, dispatch.sdpa)
            ]
            rows.append((shape, dtype, causal, *times))
    return rows


def _no_grad(fn: Callable[[], object]) -> object:
    with torch.no_grad():
        return fn()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="time on the GPU (default: CPU, stubbed)")
    ap.add_argument(
        "--backward", action="store_true", help="also time forward + backward (CPU: fa3 only)"
    )
    ap.add_argument("--sdpa", action="store_true", help="CPU: dispatch.sdpa against F.sdpa")
    ap.add_argument(
        "--kvcache", action="store_true", help="decode steps through attention_with_kvcache"
    )
    ap.add_argument(
        "--varlen", action="store_true", help="packed sequences through attention_varlen"
    )
    ap.add_argument("--causal", action="store_true", help="causal calls (fa3: tile counter)")
    ap.add_argument("--versions", default="torch,fa2,fa1,fa3")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    versions = tuple(args.versions.split(","))
    if args.sdpa:
        print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads, no grad")
        print(f"{'(B, H, N, D)':<20}{'dtype':<10}{'causal':<8}{'F.sdpa':>10}{'dispatch':>10}")
        for shape, dtype, causal, ref, ours in sdpa_cpu_table():
            dt = str(dtype).removeprefix("torch.")
            print(f"{shape!s:<20}{dt:<10}{causal!s:<8}{ref:>10.1f}{ours:>10.1f}  {ours / ref:.2f}x")
        return
    if args.kvcache or args.varlen:
        where = "GPU, pipelined" if args.gpu else "CPU, kernels stubbed, planning for sm90"
        entry = "attention_with_kvcache" if args.kvcache else "attention_varlen"
        print(f"{entry} host path ({where}), us per call")
        print(f"{'call':<28}{'checks on':>10}{'checks off':>11}")
        rows = entry_table("kvcache" if args.kvcache else "varlen", versions, args.calls, args.gpu)
        off = {name: us for name, on, us in rows if not on}
        for name, on, us in rows:
            if on:
                print(f"{name:<28}{us:>10.1f}{off.get(name, float('nan')):>11.1f}")
        return
    causal = ", causal" if args.causal else ""
    print(f"torch {torch.__version__}, shape (B, N, H, D) = {SHAPE}, bf16{causal}")
    if args.gpu:
        print(f"{'call':<16}{'pipelined':>10}{'synced':>10}{'kernel':>10}{'host':>10}  (us)")
        for name, *times in gpu_table(versions, args.calls, args.backward, args.causal):
            print(f"{name:<16}" + "".join(f"{t:>10.1f}" for t in times))
    else:
        print("CPU host path, kernels stubbed, planning for sm90")
        print(f"{'call':<16}{'host us':>10}")
        for name, us in cpu_table(versions, args.calls, args.backward, args.causal):
            print(f"{name:<16}{us:>10.1f}")


if __name__ == "__main__":
    main()
