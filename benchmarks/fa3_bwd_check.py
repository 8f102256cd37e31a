"""fa3's own backward on the H200: correctness against the oracle, then backward TFLOP/s.

    source .gpu/activate.sh
    python3 benchmarks/fa3_bwd_check.py --out $OUT/bwd [--smoke] [--bench]

1. Correctness (always): dq, dk, dv of `dispatch.attention(..., version="fa3")` (fa3's forward
   and, where supports_backward says yes, fa3's own backward) against the oracle
   (common.testing.reference_pair; DESIGN's rule with factor 3 for gradients), and out / lse
   against it too (factor 2: the forward is untouched). D 64 and 128, bf16 and fp16, causal or
   not, GQA / MQA, Nq != Nk both ways, odd lengths (1, 17, 113, 1000), fully masked rows
   (causal with Nq > Nk), strided inputs, N up to 4k, softcap (30 and 5), sliding windows;
   then D 96, 192 and 256 (`wide_head_cases`). `--match window` runs only the window cases
   (--match takes any part of a case id). fa2's backward error on the same case is recorded
   beside ours. One line per case; DIR/fa3_bwd.json is written before every case and each GPU
   step runs under a hang watchdog (a barrier bug hangs the GPU: the JSON then shows which
   case was running). --smoke: the first three cases and the first of each of D 96, 192 and
   256.
2. --bench: backward TFLOP/s (2.5x the forward FLOPs, causal halved) over B*N = 16k tokens,
   Hq*D = 2048 (1536 at D 96 / 192), N 1k / 4k / 16k, D 64 / 96 / 128 / 192 / 256, causal
   and not: fa3 (own backward), fa3 with
   FLASHSUITE_FA3_BWD=0 (fa2's backward, the previous pairing), SDPA cuDNN and flash, and FA4's
   CuTe-DSL SM90 backward (flash_attn.cute, skipped with a note if not importable), all timed in
   this run with triton.testing.do_bench (median); then a training step (forward + backward) at
   D = 128, N = 8k. A summary table is printed last.
3. --variant NAME (repeatable; names in benchmarks/fa3_bwd_variants.py) replaces 1 and 2: per
   variant, the reduced correctness set (`variant_cases`: causal, GQA, MQA, odd lengths, empty
   rows, strided, at the variant's head dims, `fa3_bwd_variants.variant_head_dims`) through
   fa3.interface.backward(..., cfg=variant), and with --bench the backward TFLOP/s of every
   variant at N 4k / 16k at its head dims, causal or not (non-causal only for
   `fa3_bwd_variants.NON_CAUSAL`, whose causal cases are reported as refused), beside SDPA
   cuDNN and FA4 timed in the same run. A variant that fails or raises is recorded and the
   next one runs; DIR/fa3_bwd_variants.json is rewritten before every step.

    python3 -m benchmarks.fa3_bwd_check --out $OUT/bwd --variant base --variant pipe --bench
    python3 -m benchmarks.fa3_bwd_check --out $OUT/bwd --variant wide192 --variant wide256 --bench
4. --stability (after the correctness run, or after the --variant runs): under
   torch.use_deterministic_algorithms the fa3 backward orders its dQ adds
   (BwdConfig.deterministic); every `stability_cases` case runs forward + backward through
   dispatch STABILITY_RUNS times and dq, dk, dv must be bitwise equal to the first run's and
   within the oracle bound. The same case without the flag runs as often and whether its dq
   varied is recorded (the atomics' order is free there). DIR/fa3_bwd_stability.json.
   --match filters these cases too.

    python3 -m benchmarks.fa3_bwd_check --out $OUT/bwd --variant base --variant det --bench \
        --stability
    python3 -m benchmarks.fa3_bwd_check --out $OUT/bwd --match window --stability
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from flashsuite.common.flops import attention_flops
from flashsuite.common.testing import (
    Case,
    compare,
    hang_watchdog,
    make_grad_out,
    make_inputs,
    reference_pair,
)

_HANG_S = 240  # seconds one GPU step may take (a first compile of the backward included)
_VARIANT_HANG_S = 90  # the same for one variant step (one compile, a smaller problem)
BF16, F16 = torch.bfloat16, torch.float16
SWITCH = "FLASHSUITE_FA3_BWD"


def _log(msg: str) -> None:
    print(msg, flush=True)


def correctness_cases() -> list[Case]:
    """Small and tile-edge problems first (the smoke set), then the rest."""
    c = []
    c.append(Case(1, 128, 128, 2, 2, 64, dtype=BF16, tags=("one-block",)))
    c.append(Case(1, 17, 113, 2, 2, 128, dtype=BF16, causal=True, tags=("odd",)))
    c.append(Case(2, 300, 260, 4, 2, 64, dtype=F16, causal=True, tags=("gqa",)))
    for d in (64, 128):
        for causal in (False, True):
            c.append(Case(2, 1000, 1000, 4, 4, d, dtype=BF16, causal=causal))
            c.append(Case(1, 1, 17, 2, 2, d, dtype=BF16, causal=causal, tags=("nq1",)))
            c.append(Case(1, 113, 17, 2, 2, d, dtype=BF16, causal=causal, tags=("nq>nk",)))
            c.append(Case(1, 17, 1000, 2, 2, d, dtype=BF16, causal=causal, tags=("nk>nq",)))
            c.append(Case(2, 513, 700, 8, 1, d, dtype=BF16, causal=causal, tags=("mqa",)))
            c.append(Case(1, 4096, 4096, 4, 2, d, dtype=BF16, causal=causal, tags=("long",)))
        c.append(Case(2, 1000, 1000, 4, 4, d, dtype=F16))
        # Causal with Nq > Nk: the first Nq - Nk rows see no key (LSE -inf, zero gradients).
        c.append(Case(1, 400, 130, 2, 2, d, dtype=BF16, causal=True, tags=("empty-rows",)))
        c.append(Case(2, 250, 250, 4, 2, d, dtype=BF16, non_contiguous=True))
        # Softcap: dS takes the cap's derivative 1 - tanh^2; odd lengths and GQA for the masks.
        for causal in (False, True):
            c.append(Case(2, 700, 513, 4, 2, d, dtype=BF16, causal=causal, softcap=30.0))
        c.append(Case(1, 113, 17, 2, 1, d, dtype=F16, causal=True, softcap=5.0, tags=("nq>nk",)))
        # Sliding windows: causal with a left edge (Nq > Nk: empty rows), both edges with
        # Nk > Nq (keys 0..299 seen by no row: column blocks with no row block write zero
        # dK / dV), a left edge only, softcap, and a long one (masked blocks on both edges).
        c.append(Case(2, 1000, 1000, 4, 2, d, dtype=BF16, window_size=(256, 0), tags=("window",)))
        c.append(Case(1, 300, 700, 2, 2, d, dtype=F16, window_size=(100, 50), tags=("window",)))
        c.append(
            Case(1, 700, 300, 4, 1, d, dtype=BF16, causal=True, window_size=(64, -1),
                 tags=("window",))
        )  # fmt: skip
        c.append(Case(1, 513, 513, 2, 2, d, dtype=BF16, window_size=(37, -1), tags=("window",)))
        c.append(
            Case(1, 600, 600, 2, 1, d, dtype=BF16, window_size=(200, 30), softcap=30.0,
                 tags=("window",))
        )  # fmt: skip
        long_window = Case(1, 4096, 4096, 4, 4, d, dtype=BF16, window_size=(512, 512))
        c.append(replace(long_window, tags=("window", "long")))
    c += wide_head_cases()
    return c


def wide_head_cases() -> list[Case]:
    """D = 96 (the "sdp_t" layout of D = 128), 192 and 256 (the "dkv_t" layout): GQA, odd
    lengths, empty rows, MQA, strided, softcap, a long causal case and a window each, the GQA
    case first
    (the smoke set takes it)."""
    c = []
    for d in (96, 192, 256):
        c.append(Case(2, 300, 260, 4, 2, d, dtype=F16, causal=True, tags=("gqa",)))
        c.append(Case(2, 1000, 1000, 4, 4, d, dtype=BF16))
        c.append(Case(1, 17, 113, 2, 2, d, dtype=BF16, causal=True, tags=("odd",)))
        c.append(Case(1, 400, 130, 2, 2, d, dtype=BF16, causal=True, tags=("empty-rows",)))
        c.append(Case(2, 513, 700, 8, 1, d, dtype=BF16, causal=True, tags=("mqa",)))
        c.append(Case(2, 250, 250, 4, 2, d, dtype=BF16, non_contiguous=True))
        c.append(Case(2, 700, 513, 4, 2, d, dtype=BF16, causal=True, softcap=30.0))
        c.append(Case(1, 4096, 4096, 4, 2, d, dtype=BF16, causal=True, tags=("long",)))
        c.append(Case(1, 700, 900, 4, 2, d, dtype=BF16, window_size=(128, 64), tags=("window",)))
    return c


def variant_cases() -> list[Case]:
    """The reduced correctness set each variant runs (about a minute per variant)."""
    return [
        Case(1, 128, 128, 2, 2, 64, dtype=BF16, tags=("one-block",)),
        Case(1, 17, 113, 2, 2, 128, dtype=BF16, causal=True, tags=("odd",)),
        Case(2, 300, 260, 4, 2, 64, dtype=F16, causal=True, tags=("gqa",)),
        Case(2, 1000, 1000, 4, 4, 128, dtype=BF16),
        Case(2, 513, 700, 8, 1, 64, dtype=BF16, causal=True, tags=("mqa",)),
        Case(1, 400, 130, 2, 2, 128, dtype=BF16, causal=True, tags=("empty-rows",)),
        Case(2, 250, 250, 4, 2, 64, dtype=BF16, non_contiguous=True),
        Case(1, 4096, 4096, 4, 2, 128, dtype=BF16, causal=True, tags=("long",)),
        # Non-causal D = 128 shapes for the non-causal variants (pipe80's 80-row blocks): GQA
        # with a ragged last row block and Nq < Nk, one partial block of MQA over strided
        # inputs, and a long one.
        Case(2, 170, 333, 8, 2, 128, dtype=F16, tags=("gqa",)),
        Case(1, 50, 700, 4, 1, 128, dtype=BF16, non_contiguous=True, tags=("mqa",)),
        Case(1, 4096, 4096, 4, 2, 128, dtype=BF16, tags=("long",)),
    ] + [c for c in wide_head_cases() if c.softcap == 0]


STABILITY_RUNS = 10


def stability_cases() -> list[Case]:
    """Deterministic-mode cases: D 64 and 128 causal or not, GQA, MQA, tails, empty rows, a
    long causal one (64 column blocks queue on each row block's counter), a causal GQA case
    at each of D 96, 192 and 256, and sliding windows at every head dim."""
    c = []
    for d in (64, 128):
        for causal in (False, True):
            c.append(Case(2, 1000, 1000, 4, 4, d, dtype=BF16, causal=causal))
    c.append(Case(2, 300, 260, 4, 2, 64, dtype=F16, causal=True, tags=("gqa",)))
    c.append(Case(2, 513, 700, 8, 1, 128, dtype=BF16, tags=("mqa",)))
    c.append(Case(1, 400, 130, 2, 2, 64, dtype=BF16, causal=True, tags=("empty-rows",)))
    c.append(Case(1, 8192, 8192, 4, 4, 128, dtype=BF16, causal=True, tags=("long",)))
    c.append(Case(2, 700, 513, 4, 2, 64, dtype=BF16, causal=True, softcap=30.0))
    for d in (96, 192, 256):
        c.append(Case(2, 1000, 700, 4, 2, d, dtype=BF16, causal=True, tags=("gqa",)))
    # Sliding windows: each row block's turns start at its first column block
    # (bwd_host.turn_counters); a left edge at D 64, 192 and 256, both edges with Nq > Nk at
    # D 128, both edges with Nq < Nk at D 96.
    c.append(Case(2, 700, 1300, 4, 2, 64, dtype=BF16, window_size=(200, 0), tags=("window",)))
    c.append(Case(1, 1000, 600, 2, 2, 128, dtype=BF16, window_size=(130, 70), tags=("window",)))
    c.append(Case(1, 2048, 2048, 2, 1, 256, dtype=BF16, window_size=(256, 0), tags=("window",)))
    c.append(Case(1, 600, 900, 4, 2, 96, dtype=BF16, window_size=(90, 150), tags=("window",)))
    c.append(Case(2, 800, 800, 2, 2, 192, dtype=BF16, window_size=(300, 0), tags=("window",)))
    return c


def _grads(case: Case, q, k, v, dout, deterministic: bool) -> tuple:
    """(dq, dk, dv, backward version) of dispatch's fa3 forward + backward, with
    torch.use_deterministic_algorithms set to `deterministic` for the call."""
    from flashsuite import dispatch

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        choice = dispatch.select(q, k, v, version="fa3", **case.options())
        out = dispatch.attention(q, k, v, version="fa3", **case.options())
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(was)
    return (*grads, choice.backward)


def check_stability(case: Case) -> dict:
    """STABILITY_RUNS deterministic backwards of one case: bitwise equal, and within the oracle
    bound; then as many default runs, recording whether their dq varied."""
    q, k, v = make_inputs(case, "cuda", requires_grad=True)
    dout = make_grad_out(case, "cuda")
    names = ("dq", "dk", "dv")
    with hang_watchdog(_HANG_S):
        *first, backward = _grads(case, q, k, v, dout, True)
        differs = {n: 0 for n in names}
        for _ in range(STABILITY_RUNS - 1):
            *again, _ = _grads(case, q, k, v, dout, True)
            for n, a, b in zip(names, first, again, strict=True):
                differs[n] += not torch.equal(a, b)
        *base, _ = _grads(case, q, k, v, dout, False)
        base_varies = 0
        for _ in range(STABILITY_RUNS - 1):
            base_varies += not torch.equal(base[0], _grads(case, q, k, v, dout, False)[0])
    ref = reference_pair(q, k, v, grad_out=dout, **case.options())
    comps = [compare(n, g, *ref[n], factor=3.0) for n, g in zip(names, first, strict=True)]
    stable = not any(differs.values())
    return {
        "case": case.id,
        "backward": backward,
        "ok": stable and backward == "fa3" and all(c.ok for c in comps),
        "runs": STABILITY_RUNS,
        "runs_differing": differs,
        "default_dq_runs_differing": base_varies,
        "checks": {c.name: {"err": c.err, "bound": c.bound, "ok": c.ok} for c in comps},
        "text": f"bwd {backward}, differing runs {differs}, default dq varied in {base_varies}; "
        + "; ".join(str(c) for c in comps),
    }


def run_stability(out_dir: Path, match: list[str] | None = None) -> int:
    """Every stability case (whose id holds one of `match`, when given);
    DIR/fa3_bwd_stability.json rewritten before each."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, if used
    path = out_dir / "fa3_bwd_stability.json"
    report: dict = {"device": torch.cuda.get_device_name(), "cases": []}
    failed = 0
    for case in (c for c in stability_cases() if not match or any(m in c.id for m in match)):
        report["running"] = case.id
        path.write_text(json.dumps(report, indent=1))
        try:
            r = check_stability(case)
        except Exception as exc:
            r = {"case": case.id, "ok": False, "error": traceback.format_exc(limit=4)}
            r["text"] = f"{type(exc).__name__}: {exc}"[:300]
        report["cases"].append(r)
        failed += not r["ok"]
        _log(f"{'ok  ' if r['ok'] else 'FAIL'} [stability] {case.id}: {r['text']}")
    report["running"] = ""
    path.write_text(json.dumps(report, indent=1))
    n = len(report["cases"])
    _log(f"stability: {n - failed}/{n} cases bitwise stable and correct")
    return 1 if failed else 0


def _p(case: Case, q, k, v):
    from flashsuite.common.validation import check_inputs

    return check_inputs(q, k, v, **case.options())


def check_case(case: Case) -> dict:
    """One correctness case: fa3 through dispatch vs the oracle, and fa2's backward error."""
    from flashsuite import dispatch
    from flashsuite.dispatch import registry

    q, k, v = make_inputs(case, "cuda", requires_grad=True)
    dout = make_grad_out(case, "cuda")
    choice = dispatch.select(q, k, v, version="fa3", **case.options())
    t0 = time.perf_counter()
    with hang_watchdog(_HANG_S):
        out, lse = dispatch.attention(q, k, v, version="fa3", return_lse=True, **case.options())
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    ref = reference_pair(q, k, v, grad_out=dout, **case.options())
    ours = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    comps = [
        compare(name, ours[name], *ref[name], factor=2.0 if name in ("out", "lse") else 3.0)
        for name in ("out", "lse", "dq", "dk", "dv")
    ]
    # fa2's backward on the same saved tensors: the yardstick the old pairing met.
    with hang_watchdog(_HANG_S):
        fa2 = registry.module("fa2").backward(
            dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, _p(case, q, k, v)
        )
        torch.cuda.synchronize()
    fa2_err = {
        name: (g.double() - ref[name][0].double()).abs().max().item()
        for name, g in zip(("dq", "dk", "dv"), fa2, strict=True)
    }
    return {
        "case": case.id,
        "backward": choice.backward,
        "ok": all(c.ok for c in comps),
        "seconds": round(secs, 2),
        "checks": {c.name: {"err": c.err, "bound": c.bound, "ok": c.ok} for c in comps},
        "fa2_err": fa2_err,
        "text": "; ".join(str(c) for c in comps),
    }


def _variant_backward(case: Case, cfg, q, k, v, dout, step: bool = False):
    """(fn, leaves): fn() runs fa3's own backward with `cfg` on the saved forward of q, k, v;
    with `step`, fn() runs that forward (dispatch, no autograd) and then the backward."""
    from flashsuite import dispatch
    from flashsuite.fa3 import interface

    p = _p(case, q, k, v)

    def forward():
        with torch.no_grad():
            return dispatch.attention(q, k, v, version="fa3", return_lse=True, **case.options())

    out, lse = forward()
    if step:
        return lambda: interface.backward(dout, q, k, v, *forward(), p, cfg=cfg), (out, lse)
    return lambda: interface.backward(dout, q, k, v, out, lse, p, cfg=cfg), (out, lse)


def check_variant_case(case: Case, cfg) -> dict:
    """One correctness case of one variant: dq, dk, dv against the oracle (factor 3)."""
    q, k, v = make_inputs(case, "cuda")
    dout = make_grad_out(case, "cuda")
    t0 = time.perf_counter()
    with hang_watchdog(_VARIANT_HANG_S):
        run, _ = _variant_backward(case, cfg, q, k, v, dout)
        dq, dk, dv = run()
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    ref = reference_pair(q, k, v, grad_out=dout, **case.options())
    ours = {"dq": dq, "dk": dk, "dv": dv}
    comps = [compare(n, ours[n], *ref[n], factor=3.0) for n in ("dq", "dk", "dv")]
    return {
        "case": case.id,
        "ok": all(c.ok for c in comps),
        "seconds": round(secs, 2),
        "checks": {c.name: {"err": c.err, "bound": c.bound, "ok": c.ok} for c in comps},
        "text": "; ".join(str(c) for c in comps),
    }


def time_variant(name: str, cfg, case: Case, step: bool = False) -> dict:
    """Backward TFLOP/s of fa3's own backward with `cfg` (forward outside the timed call); with
    `step`, forward + backward TFLOP/s of fa3's forward followed by that backward."""
    from flashsuite.dispatch.bench import time_ms

    shape = (case.batch, case.heads_q, case.seqlen_q, case.seqlen_k, case.head_dim)
    flops = attention_flops(*shape, causal=case.causal, backward=True)
    if step:
        flops += attention_flops(*shape, causal=case.causal)
    row = {"contender": name, "case": case.id, "step": step, "n": case.seqlen_q}
    row.update(d=case.head_dim, causal=case.causal)
    try:
        q, k, v = make_inputs(case, "cuda")
        dout = make_grad_out(case, "cuda")
        with hang_watchdog(_VARIANT_HANG_S):
            run, _ = _variant_backward(case, cfg, q, k, v, dout, step)
            ms = time_ms(run)
        row.update(ms=ms, tflops=flops / ms / 1e9)
    except Exception as exc:
        row.update(ms=math.nan, tflops=math.nan, error=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        torch.cuda.empty_cache()
    return row


def run_variants(
    names: list[str], bench: bool, out_dir: Path, match: list[str] | None = None
) -> int:
    """With `bench`, cuDNN and FA4 first; then per variant its correctness set (only the cases
    whose id holds one of `match`, when given) and (bench) its TFLOP/s, so that a hang in one
    variant leaves the results of those before it."""
    from benchmarks.fa3_bwd_variants import VARIANTS, variant, variant_causal, variant_head_dims

    cfgs = {n: variant(n) for n in names}  # unknown names fail here, before any GPU work
    path = out_dir / "fa3_bwd_variants.json"
    report: dict = {"device": torch.cuda.get_device_name(), "variants": {}, "bench": []}

    def save(running: str = "") -> None:
        report["running"] = running
        path.write_text(json.dumps(report, indent=1))

    def timed(name: str, case: Case, fn) -> None:
        save(running=f"bench {name} {case.id}")
        row = fn()
        report["bench"].append(row)
        _log(f"{name:11s} {case.id}: {row['tflops']:.1f} TFLOP/s {row.get('error', '')}")

    all_dims = {d for n in names for d in variant_head_dims(n)}
    bench_cases = [
        c for c in sweep_cases() if c.seqlen_q in (4096, 16384) and c.head_dim in all_dims
    ]
    bench_cases = bench_cases if bench else []
    peers = []
    if bench:
        fa4, why = _fa4()
        peers = ["sdpa-cudnn"] + (["fa4"] if fa4 is not None else [])
        if fa4 is None:
            report["fa4_skipped"] = why
            _log(f"FA4 (flash_attn.cute) not importable, skipped: {why}")
        for case in bench_cases:
            for c in peers:
                timed(c, case, lambda c=c, case=case: time_case(c, case))
    failed = 0
    for name, cfg in cfgs.items():
        rows = []
        report["variants"][name] = {"config": cfg.__dict__, "what": VARIANTS[name][1]}
        report["variants"][name]["cases"] = rows
        dims = variant_head_dims(name)
        cases = [c for c in variant_cases() if c.head_dim in dims]
        for case in (c for c in cases if not match or any(m in c.id for m in match)):
            save(running=f"{name} {case.id}")
            try:
                r = check_variant_case(case, cfg)
            except Exception as exc:
                r = {"case": case.id, "ok": False, "error": traceback.format_exc(limit=4)}
                r["text"] = f"{type(exc).__name__}: {exc}"[:300]
                if isinstance(exc, ValueError) and " cannot run: " in str(exc):
                    # The config refuses the case by design (dispatch sends it to fa2):
                    # neither a pass nor a failure.
                    r["ok"], r["refused"] = None, str(exc).split(" cannot run: ", 1)[1]
            rows.append(r)
            tag = "ok  " if r["ok"] else "FAIL" if r["ok"] is False else "REFUSED"
            _log(f"{tag} [{name}] {case.id}: {r['text']}")
        ran = [r for r in rows if r["ok"] is not None]
        passed = sum(r["ok"] for r in ran)
        refused = len(rows) - len(ran)
        report["variants"][name]["passed"] = f"{passed}/{len(ran)}"
        report["variants"][name]["refused"] = refused
        failed += passed < len(ran)
        _log(f"variant {name}: {passed}/{len(ran)} cases pass, {refused} refused by the config")
        # Timed even when a case failed (the speed of a mechanism is still worth knowing);
        # the summary marks such variants.
        causal = variant_causal(name)  # a non-causal variant's causal cases are refused
        for case in (c for c in bench_cases if c.head_dim in dims and c.causal in causal):
            timed(name, case, lambda name=name, cfg=cfg, case=case: time_variant(name, cfg, case))
    save()
    if bench:
        label = {}
        for n, v in report["variants"].items():
            ok, ran = (int(x) for x in v["passed"].split("/"))
            label[n] = n if ok == ran else f"{n}!"
        for row in report["bench"]:
            row["contender"] = label.get(row["contender"], row["contender"])
        marked = list(label.values())
        _log("! = failed a correctness case")
        _log(_summary(report["bench"], marked + peers, ratio_of=marked[0]))
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def _fa4():
    """FA4's flash_attn_func (flash_attn.cute), or None with the reason (dispatch.bench's)."""
    from flashsuite.dispatch.bench import fa4_function

    return fa4_function()


def _forward_fn(contender: str, case: Case, q, k, v):
    """(forward callable returning out, leaves) for one contender."""
    from flashsuite import dispatch
    from flashsuite.dispatch.bench import FA4, PEERS, make_callable

    if contender in PEERS or contender == FA4:
        return make_callable(contender, case, q, k, v)
    return (lambda: dispatch.attention(q, k, v, causal=case.causal, version="fa3")), (q, k, v)


def time_case(contender: str, case: Case, step: bool = False) -> dict:
    """Backward (or, with `step`, forward + backward) TFLOP/s of one contender on one case."""
    from flashsuite.dispatch.bench import time_ms

    flops = attention_flops(
        case.batch,
        case.heads_q,
        case.seqlen_q,
        case.seqlen_k,
        case.head_dim,
        causal=case.causal,
        backward=True,
    )
    if step:
        flops += attention_flops(
            case.batch, case.heads_q, case.seqlen_q, case.seqlen_k, case.head_dim,
            causal=case.causal,
        )  # fmt: skip
    row = {"contender": contender, "case": case.id, "step": step, "n": case.seqlen_q}
    row.update(d=case.head_dim, causal=case.causal)
    saved = os.environ.get(SWITCH)
    try:
        if contender == "fa3-fa2bwd":
            os.environ[SWITCH] = "0"
        q, k, v = make_inputs(case, "cuda", requires_grad=True)
        run, leaves = _forward_fn(
            "fa3" if contender.startswith("fa3") else contender, case, q, k, v
        )
        dout = make_grad_out(case, "cuda")
        with hang_watchdog(_HANG_S):
            out = run()
            if out.shape != dout.shape:  # SDPA works in (B, H, N, D)
                dout = dout.transpose(1, 2).contiguous()
            if step:
                ms = time_ms(lambda: torch.autograd.grad(run(), leaves, dout))
            else:
                ms = time_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
        row.update(ms=ms, tflops=flops / ms / 1e9)
    except Exception as exc:  # a peer missing on this build, an unsupported shape
        row.update(ms=math.nan, tflops=math.nan, error=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        if saved is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = saved
        torch.cuda.empty_cache()
    return row


def sweep_cases() -> list[Case]:
    """The standard sweep at D 64 / 128 / 256 (Hq * D = 2048) and 96 / 192 (Hq * D = 1536)."""
    from flashsuite.dispatch.bench import standard_sweep

    seqlens = (1024, 4096, 16384)
    return standard_sweep(head_dims=(64, 128, 256), seqlens=seqlens) + standard_sweep(
        head_dims=(96, 192), seqlens=seqlens, model_dim=1536
    )


def _summary(rows: list[dict], contenders: list[str], ratio_of: str = "fa3") -> str:
    lines = ["backward TFLOP/s (bf16, B*N = 16k, Hq*D = 2048); step = fwd+bwd TFLOP/s"]
    head = f"{'D':>4} {'causal':>6} {'N':>6} {'kind':>5} " + " ".join(
        f"{c:>11}" for c in contenders
    )
    lines.append(head + f" {ratio_of + '/cudnn':>11}")
    keys = sorted({(r["d"], r["causal"], r["n"], r["step"]) for r in rows})
    for d, causal, n, step in keys:
        got = {
            r["contender"]: r["tflops"]
            for r in rows
            if (r["d"], r["causal"], r["n"], r["step"]) == (d, causal, n, step)
        }
        cells = " ".join(f"{got.get(c, math.nan):11.1f}" for c in contenders)
        ratio = got.get(ratio_of, math.nan) / got.get("sdpa-cudnn", math.nan)
        kind = "step" if step else "bwd"
        lines.append(f"{d:>4} {causal!s:>6} {n:>6} {kind:>5} {cells} {ratio:11.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for fa3_bwd.json")
    ap.add_argument(
        "--smoke", action="store_true", help="three correctness cases, one per wide head dim"
    )
    ap.add_argument("--bench", action="store_true", help="also the TFLOP/s sweep")
    ap.add_argument(
        "--match", action="append", default=[],
        help="only the correctness cases whose id has this (repeat: any of them)",
    )  # fmt: skip
    ap.add_argument(
        "--variant", action="append", default=[], help="a BwdConfig variant by name (repeat)"
    )
    ap.add_argument(
        "--stability", action="store_true", help="deterministic mode: bitwise equal over 10 runs"
    )
    ap.add_argument(
        "--sweep-match", action="append", default=[],
        help="with --bench: only the sweep points whose id has this (repeat: any of them); "
        "'step' keeps the training-step rows, 'none' skips the sweep and keeps only those",
    )  # fmt: skip
    args = ap.parse_args(argv)
    # fa3's own backward is what this script checks, also where dispatch leaves it off by
    # default (bwd_configs.BWD_DEFAULT_ON); the "fa3-fa2bwd" contender sets 0 for its own runs.
    os.environ[SWITCH] = "1"
    if not torch.cuda.is_available():
        _log("fa3_bwd_check: needs a CUDA GPU (sm90)")
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.variant:
        rc = run_variants(args.variant, args.bench, out_dir, args.match)
        return max(rc, run_stability(out_dir, args.match)) if args.stability else rc
    path = out_dir / "fa3_bwd.json"
    report: dict = {"device": torch.cuda.get_device_name(), "cases": [], "bench": []}

    def save(running: str = "") -> None:
        report["running"] = running
        path.write_text(json.dumps(report, indent=1))

    cases = correctness_cases()
    if args.smoke:  # the first three (D 64 / 128) and the first case of each wide head dim
        wide = wide_head_cases()
        cases = cases[:3] + [next(c for c in wide if c.head_dim == d) for d in (96, 192, 256)]
    if args.match:
        cases = [c for c in cases if any(m in c.id for m in args.match)]
    failures = 0
    for case in cases:
        save(running=case.id)
        try:
            r = check_case(case)
        except Exception as exc:
            r = {"case": case.id, "ok": False, "error": traceback.format_exc(limit=4)}
            _log(f"ERROR {case.id}: {type(exc).__name__}: {exc}")
        report["cases"].append(r)
        failures += not r["ok"]
        if "text" in r:
            verdict = "ok  " if r["ok"] else "FAIL"
            _log(f"{verdict} {case.id} [bwd {r['backward']}, {r['seconds']}s] {r['text']}")
    save()
    _log(f"correctness: {len(cases) - failures}/{len(cases)} cases pass")

    if args.bench:
        fa4, why = _fa4()
        contenders = ["fa3", "fa3-fa2bwd", "sdpa-cudnn", "sdpa-flash"]
        if fa4 is None:
            report["fa4_skipped"] = why
            _log(f"FA4 (flash_attn.cute) not importable, skipped: {why}")
        else:
            contenders.append("fa4")
        sweep = sweep_cases()
        if args.sweep_match:
            sweep = [c for c in sweep if any(m in c.id for m in args.sweep_match)]
        for case in sweep:
            for c in contenders:
                save(running=f"bench {c} {case.id}")
                row = time_case(c, case)
                report["bench"].append(row)
                _log(f"{c:11s} {case.id}: {row['tflops']:.1f} TFLOP/s {row.get('error', '')}")
        step = Case(2, 8192, 8192, 16, 16, 128, dtype=BF16)
        step_rows = not args.sweep_match or any(m in ("step", "none") for m in args.sweep_match)
        for causal in (False, True) if step_rows else ():
            case = replace(step, causal=causal)
            for c in contenders:
                save(running=f"step {c} {case.id}")
                row = time_case(c, case, step=True)
                report["bench"].append(row)
                _log(f"{c:11s} step {case.id}: {row['tflops']:.1f} TFLOP/s")
        save()
        _log(_summary(report["bench"], contenders))
    rc = 1 if failures else 0
    return max(rc, run_stability(out_dir, args.match)) if args.stability else rc


if __name__ == "__main__":
    # Run as a file: the repository root on the path for `benchmarks.fa3_bwd_variants`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
