"""GPU benchmark of the inference entry points (H200): split-KV decode and varlen prefill.

    python benchmarks/decode_bench.py --out DIR [--quick]
    python benchmarks/decode_bench.py --out DIR --varlen     # the varlen forward peers only
    python benchmarks/decode_bench.py --out DIR --decode     # the decode sweep only
    python benchmarks/decode_bench.py --out DIR --varlen-bwd # the varlen training peers only

Decode sweep: B in {1, 8, 32, 128} x Nk in {4k, 32k, 128k} wherever B * Nk <= 4M tokens, Nq = 1,
GQA 32/8 heads, D = 128, bf16, every row's cache full; contiguous and paged (64-token pages,
shuffled block table), through fa2's Triton and fa3's CuTe DSL split-KV kernels (fa3 is
what auto picks on sm90, decode_configs.KVCACHE_AUTO), and on a float8_e4m3fn copy of the
cache (`fa2_fp8_*`: what auto runs for one, fa2's decode). Each point reports the median time
(triton.testing.do_bench) and the K/V bytes read per second, next to PyTorch SDPA's flash and
cuDNN backends on the same cache (viewed (B, Hkv, Nk, D), enable_gqa=True) timed in the same
run; fa3's largest difference from fa2's output, and each version's time for forced split
counts at five shapes (the data to set their split heuristics from). fa3 is timed twice: with
the splits merged by the shared Triton combine (`fa3_*` in the JSON) and with the merge fused
into the kernel (`fa3_fused_*`, the shipped default, decode_configs.DECODE_FUSED_COMBINE; with its
largest difference from the other). Every decode time is one
replay of a CUDA graph of the call (as a serving loop runs decode steps), so Python and launch
overhead are out of every column; fa2's eager time, overhead included, is in the JSON.
The metadata value checks (a device-to-host copy per call, which a graph cannot hold) are off
(FLASHSUITE_CHECK_METADATA=0), as flash-attn and SDPA do none.

Varlen prefill: packed sequences of random lengths (mean 2k, 64k tokens in all), Hq = Hkv = 16,
D = 128, bf16, causal and not, forward and backward, through fa3 (its varlen forward and
backward, what auto runs on sm90) and fa2, each against the dense kernel of the same version on
B = 32 x N = 2048 (the same total tokens), PREFILL_PASSES interleaved passes and their
medians. TFLOP/s counts the visible pairs of each sequence (common.flops).

Varlen forward peers (`varlen_peers`, also part of the full run): the same packed batch (mean
2k, 64k tokens, H = 16, D = 128, bf16, causal and not), forward only, through fa3's varlen
kernel and fa2's, against dense attention over the same total tokens (B = 32 x N = 2048) by
fa3 and by PyTorch SDPA's cuDNN backend; TFLOP/s of the visible pairs and tokens per second
of each.

Varlen training peers (`varlen_bwd_peers`, --varlen-bwd only): fwd + bwd (torch.autograd.grad)
of the same kind of packed batch (64k tokens; mean 2k, and mean 512), Hq = Hkv = 16, D = 64 and
128, bf16, causal and not, through fa3's varlen forward with fa3's own varlen backward
(FLASHSUITE_FA3_VARLEN_BWD=1) and with fa2's (=0), fa2's varlen forward and backward, and
dense attention over the same total tokens (B = 64k / N) by PyTorch SDPA's cuDNN and flash
backends; the backward's time is fwd + bwd minus fwd; TFLOP/s of the visible pairs (2.5x the
forward's for the backward); the largest difference between fa3's own gradients and fa2's.

Writes DIR/decode_bench.json and prints a table last. Runs in about 2-3 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ["FLASHSUITE_CHECK_METADATA"] = "0"

from flashsuite import dispatch
from flashsuite.common.flops import attention_flops
from flashsuite.dispatch.bench import time_ms
from flashsuite.fa2 import decode
from flashsuite.fa3 import decode_configs as fa3_decode_configs
from flashsuite.fa3 import decode_host

HQ, HKV, D = 32, 8, 128
PAGE = 64
DTYPE = torch.bfloat16
PREFILL_PASSES = 3  # interleaved passes of the varlen prefill contenders (medians)


def _graph_ms(fn) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph: the GPU time of its kernels,
    without the Python and launch overhead that a decode step in a serving loop (which replays
    graphs) does not pay either."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compiles, autotuning, allocator pools
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def _sdpa_ms(q, k_cache, v_cache, backend) -> float | str:
    from torch.nn.attention import sdpa_kernel

    qh = q.transpose(1, 2)  # (B, Hq, 1, D)
    kh, vh = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # (B, Hkv, Nk, D) views
    try:
        with sdpa_kernel([backend]):
            return _graph_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True))
    except Exception as exc:  # a backend that cannot take this shape says why
        return f"n/a ({type(exc).__name__})"


def _decode(version, q, k_cache, v_cache, lens, table, num_splits=0):
    return lambda: dispatch.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, block_table=table, num_splits=num_splits,
        version=version,
    )  # fmt: skip


@contextlib.contextmanager
def _combine(fused: bool):
    """fa3's decode with the split combine fused into the kernel or by the shared Triton kernel
    (decode_configs.DECODE_FUSED_COMBINE), whatever the shipped default."""
    saved = fa3_decode_configs.DECODE_FUSED_COMBINE
    fa3_decode_configs.DECODE_FUSED_COMBINE = fused
    try:
        yield
    finally:
        fa3_decode_configs.DECODE_FUSED_COMBINE = saved


def _fa2(q, k_cache, v_cache, lens, table, num_splits=0):
    return _decode("fa2", q, k_cache, v_cache, lens, table, num_splits)


def _timed(fn) -> float | str:
    """_graph_ms, or the error that stopped it (one version's failure keeps the sweep going)."""
    try:
        return _graph_ms(fn)
    except Exception as exc:
        return f"error ({type(exc).__name__}: {str(exc)[:200]})"


# The shapes a split count matters most at: B = 1 (few CTAs, latency-bound at 4k), and where
# the heuristic moves from many splits to few.
SPLIT_SWEEP = ((1, 4096), (1, 32768), (1, 131072), (8, 32768), (32, 4096))


def _split_sweep(version, q, k, v, lens) -> dict:
    """A version's contiguous decode time for a range of forced split counts (0: the
    heuristic's), the data to set fa2.decode.PROGRAMS_PER_SM / fa3's DECODE_CTAS_PER_SM from."""
    return {
        s: _timed(_decode(version, q, k, v, lens, None, s))
        for s in (0, 1, 2, 4, 8, 16, 32, 64, 128)
    }


def _fp8_cache(q, k, v, lens) -> dict:
    """The same step on a float8_e4m3fn copy of the cache (per (row, kv head) descales; auto
    runs fa2's decode on it): its time, K/V bytes read per second (half the bf16 bytes), and its
    largest difference from the bf16 cache's output (the e4m3 rounding of K and V)."""
    from flashsuite.common.fp8 import quantize_e4m3

    def quantised(x):  # by row groups: float32 temporaries of at most 256M elements
        step = max(1, (1 << 28) // x[0].numel())
        parts = [quantize_e4m3(x[i : i + step]) for i in range(0, x.shape[0], step)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    (k8, dk), (v8, dv) = quantised(k), quantised(v)

    def call():
        return dispatch.attention_with_kvcache(
            q, k8, v8, cache_seqlens=lens, descale_k=dk, descale_v=dv
        )

    row = {"fa2_fp8_ms": _timed(call)}
    if isinstance(row["fa2_fp8_ms"], float):
        kv8 = 2 * k8.numel()  # one byte an element
        row["fa2_fp8_tbps"] = kv8 / (row["fa2_fp8_ms"] * 1e-3) / 1e12
        ref = dispatch.attention_with_kvcache(q, k, v, cache_seqlens=lens)
        row["fp8_max_diff"] = (call().float() - ref.float()).abs().max().item()
    return row


def decode_sweep(quick: bool) -> list[dict]:
    from torch.nn.attention import SDPBackend

    rows = []
    points = [(b, n) for b in (1, 8, 32, 128) for n in (4096, 32768, 131072) if b * n <= 4 << 20]
    if quick:
        points = points[:3]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, n in points:
        q = torch.randn(b, 1, HQ, D, device="cuda", generator=gen).to(DTYPE)
        k = torch.randn(b, n, HKV, D, device="cuda", generator=gen).to(DTYPE)
        v = torch.randn(b, n, HKV, D, device="cuda", generator=gen).to(DTYPE)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * b * n * HKV * D * k.element_size()
        row = dict(batch=b, seqlen_k=n, kv_bytes=kv_bytes)
        row["fa2_ms"] = _graph_ms(_fa2(q, k, v, lens, None))
        row["fa2_eager_ms"] = time_ms(_fa2(q, k, v, lens, None))  # with the Python overhead
        row.update(_fp8_cache(q, k, v, lens))
        with _combine(fused=False):
            row["fa3_ms"] = _timed(_decode("fa3", q, k, v, lens, None))
        with _combine(fused=True):
            row["fa3_fused_ms"] = _timed(_decode("fa3", q, k, v, lens, None))
        if (b, n) in SPLIT_SWEEP:
            row["fa2_ms_by_num_splits"] = _split_sweep("fa2", q, k, v, lens)
            with _combine(fused=False):
                row["fa3_ms_by_num_splits"] = _split_sweep("fa3", q, k, v, lens)
            with _combine(fused=True):
                row["fa3_fused_ms_by_num_splits"] = _split_sweep("fa3", q, k, v, lens)
        cfg = decode.decode_config(HQ // HKV, D, interpreter=False)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        row["heuristic_splits"] = decode.num_splits_heuristic(
            b * HKV, math.ceil(n / cfg.block_n), sms
        )
        row["fa3_heuristic_splits"] = decode_host.num_splits_heuristic(b * HKV, n // 128, sms)
        # Paged copy: the same tokens on shuffled 64-token pages.
        pages = b * n // PAGE
        table = torch.randperm(pages, device="cuda").to(torch.int32).reshape(b, n // PAGE)
        k_pages = torch.empty(pages, PAGE, HKV, D, dtype=DTYPE, device="cuda")
        v_pages = torch.empty_like(k_pages)
        k_pages[table.long()] = k.view(b, n // PAGE, PAGE, HKV, D)
        v_pages[table.long()] = v.view(b, n // PAGE, PAGE, HKV, D)
        out_dense = dispatch.attention_with_kvcache(q, k, v, cache_seqlens=lens, version="fa2")
        out_paged = dispatch.attention_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=lens, block_table=table, version="fa2"
        )
        row["paged_max_diff"] = (out_dense.float() - out_paged.float()).abs().max().item()
        row["fa2_paged_ms"] = _graph_ms(_fa2(q, k_pages, v_pages, lens, table))
        row["paged_over_contiguous"] = row["fa2_paged_ms"] / row["fa2_ms"]
        with _combine(fused=False):
            row["fa3_paged_ms"] = _timed(_decode("fa3", q, k_pages, v_pages, lens, table))
        with _combine(fused=True):
            row["fa3_fused_paged_ms"] = _timed(_decode("fa3", q, k_pages, v_pages, lens, table))
        try:
            with _combine(fused=True):
                fused = _decode("fa3", q, k, v, lens, None)()
            with _combine(fused=False):
                unfused = _decode("fa3", q, k, v, lens, None)()
            row["fa3_fused_max_diff"] = (fused.float() - unfused.float()).abs().max().item()
        except Exception as exc:
            row["fa3_fused_max_diff"] = f"error ({type(exc).__name__})"
        try:
            for name, args in (("fa3", (k, v, None)), ("fa3_paged", (k_pages, v_pages, table))):
                out = _decode("fa3", q, *args[:2], lens, args[2])()
                row[f"{name}_max_diff_vs_fa2"] = (
                    (out.float() - out_dense.float()).abs().max().item()
                )
        except Exception as exc:
            row["fa3_max_diff_vs_fa2"] = f"error ({type(exc).__name__})"
        del k_pages, v_pages
        row["sdpa_flash_ms"] = _sdpa_ms(q, k, v, SDPBackend.FLASH_ATTENTION)
        row["sdpa_cudnn_ms"] = _sdpa_ms(q, k, v, SDPBackend.CUDNN_ATTENTION)
        sdpa = [row[k] for k in ("sdpa_flash_ms", "sdpa_cudnn_ms") if isinstance(row[k], float)]
        if isinstance(row["fa3_ms"], float) and sdpa:
            row["fa3_speedup_vs_best_sdpa"] = min(sdpa) / row["fa3_ms"]
        keys = (
            "fa2_ms",
            "fa2_paged_ms",
            "fa3_ms",
            "fa3_paged_ms",
            "fa3_fused_ms",
            "fa3_fused_paged_ms",
            "sdpa_flash_ms",
            "sdpa_cudnn_ms",
        )
        for key in keys:
            if isinstance(row[key], float):
                row[key.replace("_ms", "_tbps")] = kv_bytes / (row[key] * 1e-3) / 1e12
        rows.append(row)
        print(f"decode B={b} Nk={n}: {row}", file=sys.stderr, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def _mixed_lengths(total: int, mean: int, gen: torch.Generator) -> list[int]:
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(mean // 8, 2 * mean - mean // 8, (1,), generator=gen)))
    lens[-1] -= sum(lens) - total
    return lens


def varlen_prefill(version: str) -> list[dict]:
    rows = []
    total, heads = 65536, 16
    lens = _mixed_lengths(total, 2048, torch.Generator().manual_seed(0))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    mk = lambda *shape: torch.randn(*shape, device="cuda").to(DTYPE).requires_grad_()
    q, k, v = mk(total, heads, D), mk(total, heads, D), mk(total, heads, D)
    do = torch.randn(total, heads, D, device="cuda").to(DTYPE)
    dense = [mk(32, 2048, heads, D) for _ in range(3)]
    ddo = do.view(32, 2048, heads, D)
    for causal in (False, True):

        def run_varlen(causal=causal):
            return dispatch.attention_varlen(
                q, k, v, cu, cu, max(lens), max(lens), causal=causal, version=version
            )

        def run_dense(causal=causal):
            return dispatch.attention(*dense, causal=causal, version=version)

        flops = sum(attention_flops(1, heads, n, n, D, causal=causal) for n in lens)
        dense_flops = attention_flops(32, heads, 2048, 2048, D, causal=causal)
        row = dict(causal=causal, version=version, sequences=len(lens), max_len=max(lens))
        contenders = (
            ("varlen", run_varlen, (q, k, v), do, flops),
            ("dense", run_dense, tuple(dense), ddo, dense_flops),
        )
        # Interleaved passes, medians: one pass per contender let a clock swing of the GPU
        # move a single dense timing by 13 % (docs/inference.md).
        ms: dict[str, list[float]] = {}
        for _ in range(PREFILL_PASSES):
            for name, fn, inputs, grad, _fl in contenders:
                with torch.no_grad():
                    ms.setdefault(f"{name}_fwd", []).append(time_ms(fn))
                ms.setdefault(f"{name}_both", []).append(
                    time_ms(
                        lambda fn=fn, inputs=inputs, grad=grad: torch.autograd.grad(
                            fn(), inputs, grad
                        )
                    )
                )
        for name, *_, fl in contenders:
            fwd = statistics.median(ms[f"{name}_fwd"])
            both = statistics.median(ms[f"{name}_both"])
            row[f"{name}_fwd_tflops"] = fl / (fwd * 1e-3) / 1e12
            row[f"{name}_bwd_tflops"] = 2.5 * fl / ((both - fwd) * 1e-3) / 1e12
        row["fwd_ratio"] = row["varlen_fwd_tflops"] / row["dense_fwd_tflops"]
        row["bwd_ratio"] = row["varlen_bwd_tflops"] / row["dense_bwd_tflops"]
        rows.append(row)
        print(f"varlen causal={causal}: {row}", file=sys.stderr, flush=True)
    return rows


def varlen_peers() -> list[dict]:
    """Forward only: fa3 varlen, fa2 varlen, fa3 dense and SDPA cuDNN dense on 64k tokens."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    total, heads = 65536, 16
    lens = _mixed_lengths(total, 2048, torch.Generator().manual_seed(0))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, heads, D, device="cuda").to(DTYPE) for _ in range(3))
    dense = [t.view(32, 2048, heads, D) for t in (q, k, v)]  # (B, N, H, D)
    dense_t = [t.transpose(1, 2) for t in dense]  # (B, H, N, D) for SDPA
    rows = []
    for causal in (False, True):

        def packed(version: str, causal=causal):
            return lambda: dispatch.attention_varlen(
                q, k, v, cu, cu, max(lens), max(lens), causal=causal, version=version
            )

        def cudnn(causal=causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(*dense_t, is_causal=causal)

        flops = sum(attention_flops(1, heads, n, n, D, causal=causal) for n in lens)
        dense_flops = attention_flops(32, heads, 2048, 2048, D, causal=causal)
        row = dict(causal=causal, sequences=len(lens), max_len=max(lens), tokens=total)
        for name, fn, fl in (
            ("fa3_varlen", packed("fa3"), flops),
            ("fa2_varlen", packed("fa2"), flops),
            ("fa3_dense", lambda c=causal: dispatch.attention(*dense, causal=c, version="fa3"),
             dense_flops),
            ("cudnn_dense", cudnn, dense_flops),
        ):  # fmt: skip
            try:
                with torch.no_grad():
                    ms = time_ms(fn)
            except Exception as e:  # a peer that cannot run here: recorded, not fatal
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"
                continue
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = fl / (ms * 1e-3) / 1e12
            row[f"{name}_mtok_s"] = total / (ms * 1e-3) / 1e6
        rows.append(row)
        print(f"varlen peers causal={causal}: {row}", file=sys.stderr, flush=True)
    return rows


def varlen_bwd_peers() -> list[dict]:
    """fwd + bwd: fa3 varlen with its own backward and with fa2's, fa2 varlen, SDPA dense."""
    rows = []
    for mean, d, causal in [(m, d, c) for m in (2048, 512) for d in (64, 128) for c in (0, 1)]:
        rows.append(_varlen_bwd_point(mean, d, bool(causal)))
        print(f"varlen bwd peers: {rows[-1]}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    os.environ.pop("FLASHSUITE_FA3_VARLEN_BWD", None)
    return rows


def _varlen_bwd_point(mean: int, d: int, causal: bool) -> dict:
    """One point of `varlen_bwd_peers`: 64k tokens of mean length `mean`, H = 16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    total, heads = 65536, 16
    lens = _mixed_lengths(total, mean, torch.Generator().manual_seed(0))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    mk = lambda *shape: torch.randn(*shape, device="cuda").to(DTYPE).requires_grad_()
    q, k, v = mk(total, heads, d), mk(total, heads, d), mk(total, heads, d)
    do = torch.randn(total, heads, d, device="cuda").to(DTYPE)
    b = total // mean
    dense = [t.detach().view(b, mean, heads, d).transpose(1, 2).requires_grad_()
             for t in (q, k, v)]  # fmt: skip  # (B, H, N, D) for SDPA
    ddo = do.view(b, mean, heads, d).transpose(1, 2)
    flops = sum(attention_flops(1, heads, n, n, d, causal=causal) for n in lens)
    dense_flops = attention_flops(b, heads, mean, mean, d, causal=causal)

    def packed(version: str, own: str):
        def run():
            os.environ["FLASHSUITE_FA3_VARLEN_BWD"] = own  # read by each backward call
            return dispatch.attention_varlen(
                q, k, v, cu, cu, max(lens), max(lens), causal=causal, version=version
            )

        return run

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*dense, is_causal=causal)

        return run

    row = dict(mean=mean, head_dim=d, causal=causal, sequences=len(lens), tokens=total)
    peers = (
        ("fa3_own", packed("fa3", "1"), (q, k, v), do, flops),
        ("fa3_fa2bwd", packed("fa3", "0"), (q, k, v), do, flops),
        ("fa2", packed("fa2", "0"), (q, k, v), do, flops),
        ("cudnn_dense", sdpa(SDPBackend.CUDNN_ATTENTION), dense, ddo, dense_flops),
        ("flash_dense", sdpa(SDPBackend.FLASH_ATTENTION), dense, ddo, dense_flops),
    )
    for name, fn, inputs, grad, fl in peers:
        try:
            with torch.no_grad():
                fwd = time_ms(fn)
            both = time_ms(
                lambda fn=fn, inputs=inputs, grad=grad: torch.autograd.grad(fn(), inputs, grad)
            )
        except Exception as e:  # a peer that cannot run here: recorded, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"
            continue
        row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = fwd, both - fwd
        row[f"{name}_bwd_tflops"] = 2.5 * fl / ((both - fwd) * 1e-3) / 1e12
        row[f"{name}_step_mtok_s"] = total / (both * 1e-3) / 1e6
    try:
        own = torch.autograd.grad(packed("fa3", "1")(), (q, k, v), do)
        ref = torch.autograd.grad(packed("fa3", "0")(), (q, k, v), do)
        row["fa3_own_vs_fa2_max_diff"] = max(
            (a.float() - r.float()).abs().max().item() for a, r in zip(own, ref, strict=True)
        )
    except Exception as e:  # recorded, not fatal
        row["fa3_own_vs_fa2_error"] = f"{type(e).__name__}: {e}"
    return row


def _print_varlen_bwd_peers(rows: list[dict]) -> None:
    print("\nvarlen fwd+bwd, 64k tokens, H=16, bf16: backward TFLOP/s | step M tokens/s")
    names = ("fa3_own", "fa3_fa2bwd", "fa2", "cudnn_dense", "flash_dense")
    print(f"{'mean':>5} {'D':>4} {'causal':>6} | " + " | ".join(f"{n:>13}" for n in names))
    for r in rows:
        cells = [
            f"{r[n + '_bwd_tflops']:.0f} | {r[n + '_step_mtok_s']:.1f}" if n + "_bwd_ms" in r
            else "error"
            for n in names
        ]  # fmt: skip
        diff = _fmt(r.get("fa3_own_vs_fa2_max_diff", "n/a"))
        print(
            f"{r['mean']:>5} {r['head_dim']:>4} {int(r['causal']):>6} | "
            + " | ".join(f"{c:>13}" for c in cells)
            + f" | max|fa3 own - fa2| {diff}"
        )


def _fmt(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="first three decode points only")
    ap.add_argument("--varlen", action="store_true", help="the varlen forward peers only")
    ap.add_argument("--decode", action="store_true", help="the decode sweep only")
    ap.add_argument("--varlen-bwd", action="store_true", help="the varlen training peers only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_bench needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    if args.varlen_bwd:
        result["varlen_bwd_peers"] = varlen_bwd_peers()
        result["seconds"] = time.time() - start
        (args.out / "decode_bench.json").write_text(json.dumps(result, indent=2))
        _print_varlen_bwd_peers(result["varlen_bwd_peers"])
        print(f"\n{result['seconds']:.0f} s; JSON in {args.out / 'decode_bench.json'}")
        return
    if not args.varlen:
        result["decode"] = decode_sweep(args.quick)
    if not (args.varlen or args.decode):
        result["varlen"] = varlen_prefill("fa3") + varlen_prefill("fa2")
    if not args.decode:
        result["varlen_peers"] = varlen_peers()
    result["seconds"] = time.time() - start
    (args.out / "decode_bench.json").write_text(json.dumps(result, indent=2))
    if not args.decode:
        _print_varlen_peers(result["varlen_peers"])
    if args.varlen:
        print(f"\n{result['seconds']:.0f} s; JSON in {args.out / 'decode_bench.json'}")
        return
    print(
        f"\ndecode, Nq=1, GQA {HQ}/{HKV}, D={D}, bf16, CUDA-graph replay (ms | K/V TB/s); "
        f"paged = {PAGE}-token pages"
    )
    heads = ("fa2", "fa2 paged", "fa3", "fa3 paged", "fa3 fused", "SDPA flash", "SDPA cuDNN",
             "e4m3 cache")  # fmt: skip
    print(f"{'B':>4} {'Nk':>7} | " + " | ".join(f"{h:>15}" for h in heads) + " | fa3/best")
    for r in result["decode"]:
        cells = []
        for key in (
            "fa2",
            "fa2_paged",
            "fa3",
            "fa3_paged",
            "fa3_fused",
            "sdpa_flash",
            "sdpa_cudnn",
            "fa2_fp8",
        ):
            ms, rate = r[f"{key}_ms"], r.get(f"{key}_tbps")
            cells.append(f"{_fmt(ms)} | {rate:.2f}" if rate is not None else str(ms)[:15])
        ratio = _fmt(r.get("fa3_speedup_vs_best_sdpa", "n/a"))
        print(
            f"{r['batch']:>4} {r['seqlen_k']:>7} | "
            + " | ".join(f"{c:>15}" for c in cells)
            + f" | {ratio}"
        )
    if args.decode:
        print(f"\n{result['seconds']:.0f} s; JSON in {args.out / 'decode_bench.json'}")
        return
    print("\nvarlen prefill, 64k tokens, mean 2k, H=16, D=128, bf16 (TFLOP/s; ratio varlen/dense)")
    for r in result["varlen"]:
        print(
            f"{r['version']} causal={int(r['causal'])} fwd {r['varlen_fwd_tflops']:.0f} vs dense "
            f"{r['dense_fwd_tflops']:.0f} ({r['fwd_ratio']:.2f}x) | bwd "
            f"{r['varlen_bwd_tflops']:.0f} vs dense {r['dense_bwd_tflops']:.0f} "
            f"({r['bwd_ratio']:.2f}x)"
        )
    print(f"\n{result['seconds']:.0f} s; JSON in {args.out / 'decode_bench.json'}")


def _print_varlen_peers(rows: list[dict]) -> None:
    print("\nvarlen forward, 64k tokens, mean 2k, H=16, D=128, bf16: TFLOP/s | M tokens/s")
    names = ("fa3_varlen", "fa2_varlen", "fa3_dense", "cudnn_dense")
    print(f"{'causal':>6} | " + " | ".join(f"{n:>17}" for n in names))
    for r in rows:
        cells = [
            f"{r[n + '_tflops']:.0f} | {r[n + '_mtok_s']:.0f}" if n + "_ms" in r else "error"
            for n in names
        ]
        print(f"{int(r['causal']):>6} | " + " | ".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
