"""fa3 on the H200: correctness, TFLOP/s next to SDPA (cuDNN, flash), and the ablation table.

    python -m benchmarks.fa3_ablate --out DIR [--skip-correctness] [--skip-bench] [--skip-ablation]
    python -m benchmarks.fa3_ablate --out DIR --smoke     # 3 small cases, for compute-sanitizer
    python -m benchmarks.fa3_ablate --out DIR --skip-correctness --skip-bench --head-dim 64
    python -m benchmarks.fa3_ablate --out DIR --final     # < 2 min: the candidates to ship
    python -m benchmarks.fa3_ablate --out DIR --persistent     # < 2 min: persistent schedulers
    python -m benchmarks.fa3_ablate --out DIR --persistent --smoke --variant new --head-dim 128

Stages, each variant in its own try/except so one failure does not end the run (a GPU hang
cannot be caught in-process: the first case is tiny so a barrier bug shows at once):
1. correctness against common.reference on small shapes (fp16/bf16, D 64/128/256, causal and
   not, Nq/Nk in {1, 17, 1000, ...}, GQA, window, softcap), max errors and PASS/FAIL;
2. forward TFLOP/s, B·N = 16k tokens, Hq·D = 2048, N in {8192, 16384}, D in {64, 128, 256},
   causal F/T, with SDPA's cuDNN and flash backends timed in the same run (ratio columns);
3. ablation at D = 128, N = 8192 over fa3_variants.ablation_configs (ping-pong, intra-WG overlap,
   stages, tile_n), each variant checked for correctness on a small case before timing;
4. launch overhead: wall time of a tiny call vs SDPA's.
Results go to DIR/fa3_ablate.json.

--persistent (DIR/fa3_persistent.json, < 2 min): fa3_variants.persistent_variants, i.e. per shape
the plain grid, the round-robin persistent scheduler ("old") and the overlapped persistent one with
the balanced order ("new"), each checked on 8 small bf16 cases (odd lengths, GQA/MQA, keyless rows,
several tiles per CTA) and then timed at D = 64/128/256 causal N = 4k/8k/16k and D = 128 non-causal
N = 16k next to cuDNN in the same run. The new variants run last (a hang ends the run after the JSON
written so far).

--final (DIR/fa3_final.json): each non-shipped entry of fa3_variants.final_variants (3 consumer
WGs, wider tile_n, persistent LPT scheduler, the D=128 ablation winners) is compiled, checked
on 8 small cases (fp16/bf16, causal or not, odd Nq/Nk, GQA, a window, more tiles than SMs),
then every entry is timed at N = 16384 (causal also 8192) next to cuDNN in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.fa3_variants import (
    ablation_configs,
    bench_sweep,
    final_variants,
    persistent_variants,
)
from flashsuite.common.flops import attention_flops
from flashsuite.common.testing import compare, hang_watchdog, reference_pair
from flashsuite.common.validation import check_inputs
from flashsuite.fa3 import interface
from flashsuite.fa3.configs import Fa3Config

DEV = "cuda"
_HANG_S = 90  # seconds one correctness case may take (compiles included) before we give up


def _log(msg: str) -> None:
    print(msg, flush=True)


def _inputs(b, nq, nk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn((b, nq, hq, d), generator=g, device=DEV).to(dtype)  # (B, Nq, Hq, D)
    k = torch.randn((b, nk, hkv, d), generator=g, device=DEV).to(dtype)  # (B, Nk, Hkv, D)
    v = torch.randn((b, nk, hkv, d), generator=g, device=DEV).to(dtype)  # (B, Nk, Hkv, D)
    return q, k, v


def check_case(case: dict, cfg: Fa3Config | None = None) -> dict:
    """Run fa3 on one case; compare out and lse with the oracle (docs/design.md tolerance)."""
    opts = {
        "causal": case.get("causal", False),
        "window_size": case.get("window", (-1, -1)),
        "softcap": case.get("softcap", 0.0),
        "softmax_scale": case.get("scale"),
    }
    q, k, v = _inputs(
        case["b"], case["nq"], case["nk"], case["hq"], case["hkv"], case["d"], case["dtype"]
    )
    p = check_inputs(q, k, v, **opts)
    ok, reason = interface.supports(p, 90)
    if not ok:
        return {"status": "UNSUPPORTED", "reason": reason}
    out, lse = interface.forward(q, k, v, p, cfg=cfg)
    torch.cuda.synchronize()
    ref = reference_pair(q, k, v, **opts)
    c_out = compare("out", out, ref["out"][0], ref["out"][1], dtype=q.dtype)
    c_lse = compare("lse", lse, ref["lse"][0], ref["lse"][1], dtype=torch.float32)
    return {
        "status": "PASS" if (c_out.ok and c_lse.ok) else "FAIL",
        "out_err": c_out.err,
        "out_bound": c_out.bound,
        "lse_err": c_lse.err,
        "lse_bound": c_lse.bound,
    }


def correctness_cases() -> list[dict]:
    cases = [dict(b=1, nq=128, nk=128, hq=1, hkv=1, d=64, dtype=torch.float16)]  # smoke first
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 96, 128, 192, 256):
            for causal in (False, True):
                for nq, nk in ((1, 1), (17, 17), (1000, 1000), (17, 1000), (1000, 17), (128, 384)):
                    cases.append(
                        dict(b=2, nq=nq, nk=nk, hq=4, hkv=2, d=d, dtype=dtype, causal=causal)
                    )
    for d in (64, 128):
        base = dict(b=1, nq=777, nk=1000, hq=6, hkv=1, d=d, dtype=torch.bfloat16)  # MQA
        cases += [
            base,
            {**base, "window": (100, 50)},
            {**base, "window": (64, 0), "causal": True},
            {**base, "window": (-1, 7)},
            {**base, "softcap": 30.0},
            {**base, "scale": 0.3, "causal": True},
            {**base, "nq": 2000, "nk": 300, "causal": True},  # rows that see no key
        ]
    return cases


def _case_name(c: dict) -> str:
    extra = "".join(f" {k}={c[k]}" for k in ("causal", "window", "softcap", "scale") if k in c)
    dt = str(c["dtype"]).removeprefix("torch.")
    return f"B={c['b']} Nq={c['nq']} Nk={c['nk']} Hq={c['hq']}/{c['hkv']} D={c['d']} {dt}{extra}"


def run_correctness(limit: int | None = None) -> list[dict]:
    rows = []
    for c in correctness_cases()[:limit]:
        name = _case_name(c)
        try:
            r = check_case(c)
        except Exception as e:
            r = {"status": "ERROR", "error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        _log(f"[correctness] {r['status']:5s} {name} {_fmt_err(r)}")
        rows.append({"case": name, **r})
    return rows


def _fmt_err(r: dict) -> str:
    if "out_err" not in r:
        return r.get("reason", r.get("error", ""))
    return (
        f"out {r['out_err']:.3g} (<= {r['out_bound']:.3g}) lse {r['lse_err']:.3g} "
        f"(<= {r['lse_bound']:.3g})"
    )


def _bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _sdpa_fn(q, k, v, causal: bool, backend):
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return run


def bench_one(
    d: int, n: int, causal: bool, dtype=torch.bfloat16, cfg=None, peers=True, flash=True
) -> dict:
    """fa3 TFLOP/s at B*N = 16k tokens, Hq*D = 2048; with `peers` cuDNN (and SDPA flash)."""
    from torch.nn.attention import SDPBackend

    b, h = max(1, 16384 // n), 2048 // d
    q, k, v = _inputs(b, n, n, h, h, d, dtype)
    flops = attention_flops(b, h, n, n, d, causal=causal)
    p = check_inputs(q, k, v, causal=causal)
    row: dict[str, Any] = {"D": d, "N": n, "B": b, "H": h, "causal": causal}
    timings = {"fa3": lambda: interface.forward(q, k, v, p, cfg=cfg)}
    if peers:
        timings["cudnn"] = _sdpa_fn(q, k, v, causal, SDPBackend.CUDNN_ATTENTION)
        if flash:
            timings["flash"] = _sdpa_fn(q, k, v, causal, SDPBackend.FLASH_ATTENTION)
    for name, fn in timings.items():
        try:
            ms = _bench_ms(fn)
            row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
        except Exception as e:
            row[f"{name}_tflops"] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"
    for peer in ("cudnn", "flash"):
        a, b_ = row.get("fa3_tflops"), row.get(f"{peer}_tflops")
        row[f"ratio_vs_{peer}"] = a / b_ if a and b_ else None
    return row


def _fmt_bench(r: dict) -> str:
    def f(x):
        return "  n/a " if x is None else f"{x:6.1f}"

    def g(x):
        return " n/a" if x is None else f"{x:4.2f}"

    return (
        f"D={r['D']:3d} N={r['N']:5d} causal={r['causal']!s:5s} fa3 {f(r.get('fa3_tflops'))} "
        f"cudnn {f(r.get('cudnn_tflops'))} flash {f(r.get('flash_tflops'))} TFLOP/s  "
        f"x{g(r.get('ratio_vs_cudnn'))} cudnn x{g(r.get('ratio_vs_flash'))} flash"
    )


def run_bench() -> list[dict]:
    return bench_sweep(bench_one, lambda r: _fmt_bench(r) if "error" not in r else r)


def run_ablation(d: int = 128, n: int = 8192) -> list[dict]:
    rows = []
    small = dict(b=2, nq=1000, nk=1000, hq=4, hkv=2, d=d, dtype=torch.bfloat16)
    for name, cfg in ablation_configs(d).items():
        if not _compiles(d, False, cfg, rows, name):
            continue
        row: dict[str, Any] = {"variant": name, "config": asdict(cfg)}
        with hang_watchdog(4 * _HANG_S):
            try:
                chk = [check_case({**small, "causal": c}, cfg=cfg)["status"] for c in (False, True)]
                row["correct"] = chk
                if all(s == "PASS" for s in chk):
                    for causal in (False, True):
                        r = bench_one(d, n, causal, cfg=cfg, peers=False)
                        row[f"tflops_causal_{causal}"] = r.get("fa3_tflops")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        _log(
            f"[ablation] {name:28s} {row.get('correct')} "
            f"full {row.get('tflops_causal_False')} causal {row.get('tflops_causal_True')}"
        )
        rows.append(row)
    return rows


def _compiles(d: int, causal: bool, cfg: Fa3Config, rows: list, name: str) -> bool:
    """Compile before running: a config that fails to build is reported and skipped."""
    from flashsuite.fa3.compile import CompileKey, get_forward

    try:
        get_forward(CompileKey(torch.float16, d, causal, False, False, cfg))
        return True
    except Exception as e:
        rows.append({"variant": name, "D": d, "config": asdict(cfg), "compile_error": repr(e)})
        _log(f"[compile] {name} D={d}: FAILED {type(e).__name__}: {e}")
        return False


def final_cases(d: int) -> list[dict]:
    """8 small cases for a new variant: the tiny one first (a barrier bug hangs at once)."""
    f16, bf = torch.float16, torch.bfloat16
    # Three compile keys per variant (fp16 full, bf16 causal, bf16 causal + window) keep the
    # --final run short; fp16/bf16, causal or not, odd sizes and GQA are all covered.
    return [
        dict(b=1, nq=128, nk=128, hq=1, hkv=1, d=d, dtype=f16),
        dict(b=2, nq=17, nk=1000, hq=4, hkv=2, d=d, dtype=f16),
        dict(b=3, nq=300, nk=513, hq=4, hkv=4, d=d, dtype=f16),
        dict(b=2, nq=1000, nk=1000, hq=4, hkv=2, d=d, dtype=bf, causal=True),
        dict(b=1, nq=777, nk=1000, hq=6, hkv=1, d=d, dtype=bf, causal=True),  # MQA
        dict(b=2, nq=1000, nk=17, hq=4, hkv=2, d=d, dtype=bf, causal=True),  # keyless rows
        # More tiles than SMs: a persistent CTA runs several tiles (phases carried over).
        dict(b=2, nq=2000, nk=2000, hq=16, hkv=4, d=d, dtype=bf, causal=True),
        dict(b=2, nq=1500, nk=1500, hq=8, hkv=2, d=d, dtype=bf, causal=True, window=(64, 0)),
    ]


def _bench_vs_cudnn(
    name: str, d: int, n: int, causal: bool, cfg: Fa3Config, cudnn: dict, flash: bool
) -> dict:
    """Time one variant (bench_one, under the watchdog) and set its ratio to cuDNN. cuDNN is
    timed once per shape, with the first variant, and remembered in `cudnn`."""
    key = (d, causal, n)
    row: dict[str, Any] = {"variant": name, "config": asdict(cfg)}
    with hang_watchdog(_HANG_S):
        try:
            row.update(bench_one(d, n, causal, cfg=cfg, peers=key not in cudnn, flash=flash))
            if key not in cudnn:
                cudnn[key] = row.get("cudnn_tflops")
        except Exception as e:
            row.update(D=d, N=n, causal=causal, error=f"{type(e).__name__}: {e}")
    t, c = row.get("fa3_tflops"), cudnn.get(key)
    row["ratio_vs_cudnn"] = t / c if t and c else None
    _log(
        f"{d:4d} {causal!s:>6} {n:6d} {name:22s} "
        f"{'n/a' if t is None else f'{t:8.1f}':>8} "
        f"{'n/a' if c is None else f'{c:7.1f}':>7} "
        f"{'n/a' if row['ratio_vs_cudnn'] is None else f'{t / c:6.3f}':>6}"
    )
    return row


def _watched_check(case: dict, cfg: Fa3Config) -> dict:
    """check_case under a watchdog: a hang (a barrier bug cannot be caught in-process) ends the
    process after _HANG_S, after the JSON written so far; an exception becomes status ERROR."""
    with hang_watchdog(_HANG_S):
        try:
            return check_case(case, cfg=cfg)
        except Exception as e:
            return {"status": "ERROR", "error": f"{type(e).__name__}: {e}"}


def _check_variant(tag: str, d: int, cfg: Fa3Config, rows: list) -> bool:
    """final_cases for one config; a watchdog ends the process if a case hangs (a barrier bug
    cannot be caught in-process), after the JSON written so far."""
    statuses = []
    for c in final_cases(d):
        r = _watched_check(c, cfg)
        statuses.append(r["status"])
        rows.append({"variant": tag, "case": _case_name(c), **r})
        if r["status"] != "PASS":
            _log(f"[final] {tag}: {r['status']} {_case_name(c)} {_fmt_err(r)}")
    verdict = all(s == "PASS" for s in statuses)
    _log(f"[final] correctness {'PASS' if verdict else 'FAIL'} {tag} {statuses}")
    return verdict


def run_final(res: dict, save) -> None:
    """Correctness of each candidate config, then TFLOP/s next to cuDNN, into res["final"].

    Persistent variants (new barrier-phase logic, the likeliest to hang) run after all the
    others have been checked and timed; `save` is called after each stage.
    """
    res["final"] = fin = {"correctness": [], "bench": []}
    cudnn: dict[tuple, float | None] = {}
    _log(f"{'D':>4} {'causal':>6} {'N':>6} {'variant':22s} {'TFLOP/s':>8} {'cudnn':>7} {'x':>5}")
    for persistent in (False, True):
        ok = []
        for name, d, causal, cfg in final_variants():
            if cfg.persistent != persistent:
                continue
            tag = f"{name} D={d} {'causal' if causal else 'full'}"
            rows = fin["correctness"]
            passed = name == "shipped" or (
                _compiles(d, False, cfg, rows, tag) and _check_variant(tag, d, cfg, rows)
            )
            if passed:
                ok.append((name, d, causal, cfg))
            save()
        for name, d, causal, cfg in ok:
            for n in (8192, 16384) if causal else (16384,):
                fin["bench"].append(_bench_vs_cudnn(name, d, n, causal, cfg, cudnn, flash=True))
            save()


def persistent_cases(d: int, causal: bool) -> list[dict]:
    """8 small bf16 cases sharing one compile key per variant (the one the timing uses)."""
    bf = torch.bfloat16
    cases = [
        dict(b=1, nq=128, nk=128, hq=1, hkv=1),  # tiny first: a barrier bug hangs at once
        dict(b=2, nq=17, nk=1000, hq=4, hkv=2),  # odd lengths, GQA
        dict(b=3, nq=300, nk=513, hq=4, hkv=4),
        dict(b=2, nq=1000, nk=1000, hq=4, hkv=2),
        dict(b=1, nq=777, nk=1000, hq=6, hkv=1),  # MQA
        dict(b=2, nq=1000, nk=17, hq=4, hkv=2),  # causal: keyless rows, whole tiles with no block
        # More tiles than SMs: persistent CTAs run several tiles (phases carried across tiles,
        # tiles of different lengths, the balanced order's reversed sections).
        dict(b=2, nq=2000, nk=2000, hq=16, hkv=4),
        dict(b=4, nq=1500, nk=1100, hq=16, hkv=2),
    ]
    return [{**c, "d": d, "dtype": bf, "causal": causal} for c in cases]


def _persistent_shapes(d: int, causal: bool) -> tuple[int, ...]:
    return (4096, 8192, 16384) if causal else (16384,)


def run_persistent(
    res: dict,
    save,
    smoke: bool = False,
    only: list[str] | None = None,
    head_dims=None,
    seqlens: list[int] | None = None,
) -> None:
    """Correctness, then TFLOP/s vs cuDNN, of fa3_variants.persistent_variants into
    res["persistent"]: plain and old first, the new variants after them (the likeliest to hang).

    `smoke`: only the new variants on 3 cases (one tile, keyless tiles, several tiles per CTA)
    and no timing, for compute-sanitizer. `only` / `head_dims` keep those variant names / dims;
    `seqlens` replaces the timed N.
    """
    res["persistent"] = per = {"correctness": [], "bench": []}
    cudnn: dict[tuple, float | None] = {}
    tflops: dict[tuple, float | None] = {}
    _log(f"{'D':>4} {'causal':>6} {'N':>6} {'variant':10s} {'TFLOP/s':>8} {'cudnn':>7} {'x':>6}")
    for stage in ("new",) if smoke else ("baseline", "new"):
        ok = []
        for name, d, causal, cfg in persistent_variants():
            if (stage == "new") != cfg.overlap_tiles:
                continue
            if (only and name not in only) or (head_dims and d not in head_dims):
                continue
            tag = f"{name} D={d} {'causal' if causal else 'full'}"
            statuses = []
            cases = persistent_cases(d, causal)
            for c in [cases[i] for i in (0, 5, 6)] if smoke else cases:
                r = _watched_check(c, cfg)
                statuses.append(r["status"])
                per["correctness"].append({"variant": tag, "case": _case_name(c), **r})
                if r["status"] != "PASS":
                    _log(f"[persistent] {tag}: {r['status']} {_case_name(c)} {_fmt_err(r)}")
            passed = all(st == "PASS" for st in statuses)
            _log(f"[persistent] correctness {'PASS' if passed else 'FAIL'} {tag}")
            if passed and not smoke:
                ok.append((name, d, causal, cfg))
            save()
        for name, d, causal, cfg in ok:
            for n in seqlens or _persistent_shapes(d, causal):
                row = _bench_vs_cudnn(name, d, n, causal, cfg, cudnn, flash=False)
                tflops[(d, causal, n, name)] = row.get("fa3_tflops")
                per["bench"].append(row)
            save()
    # One row per shape: every variant's TFLOP/s and its ratio to cuDNN, side by side.
    order = [name for name, *_ in persistent_variants()]
    names = sorted({k[3] for k in tflops}, key=order.index)
    per["table"] = []
    for key, c in cudnn.items():
        row = {"D": key[0], "causal": key[1], "N": key[2], "cudnn": c}
        for name in names:
            if (*key, name) not in tflops:
                continue
            t = tflops[(*key, name)]
            row[name] = t
            row[f"{name}_x_cudnn"] = t / c if t and c else None
        per["table"].append(row)
        _log(
            "[persistent] "
            + " ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            )
        )
    save()


def run_overhead(calls: int = 2000) -> dict:
    """Host wall time per tiny call (B=1, N=128, H=1, D=64), fa3 vs SDPA's default path."""
    q, k, v = _inputs(1, 128, 128, 1, 1, 64, torch.bfloat16)
    p = check_inputs(q, k, v)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    fns = {
        "fa3_interface": lambda: interface.forward(q, k, v, p),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
    }
    res = {}
    for name, fn in fns.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        res[f"{name}_us"] = (time.perf_counter() - t0) / calls * 1e6
    _log(f"[overhead] {res}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for fa3_ablate.json")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-ablation", action="store_true")
    ap.add_argument(
        "--head-dim",
        type=int,
        action="append",
        help="head_dim of the ablation table (default 128; the first one given); with "
        "--persistent: only these (repeatable)",
    )
    ap.add_argument(
        "--final",
        action="store_true",
        help="only fa3_variants.final_variants: correctness, then TFLOP/s (< 2 min)",
    )
    ap.add_argument(
        "--persistent",
        action="store_true",
        help="plain vs old vs new persistent scheduler: correctness, then TFLOP/s (< 2 min)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        help="with --persistent: only these persistent_variants names (plain, old, new..)",
    )
    ap.add_argument(
        "--seqlen",
        type=int,
        action="append",
        help="with --persistent: time these N instead of 4k/8k/16k (causal) / 16k (repeatable)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="only the first 3 correctness cases (for compute-sanitizer), nothing else; with "
        "--persistent: the new persistent variants on 3 cases, no timing",
    )
    args = ap.parse_args(argv)
    if args.smoke and not args.persistent:
        args.skip_bench = args.skip_ablation = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok, reason = interface.available()
    _log(f"[fa3] available: {ok} ({reason}); {torch.cuda.get_device_name()}")
    if not ok:
        return 1
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    name = "fa3_persistent" if args.persistent else "fa3_final" if args.final else "fa3_ablate"
    path = out / f"{name}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1, default=str))

    if args.persistent:
        t0 = time.perf_counter()
        dims = args.head_dim
        run_persistent(
            result, save, smoke=args.smoke, only=args.variant, head_dims=dims, seqlens=args.seqlen
        )
        result["seconds"] = time.perf_counter() - t0
        save()
        _log(f"[fa3] wrote {path} ({result['seconds']:.0f} s)")
        return 0
    if args.final:
        t0 = time.perf_counter()
        run_final(result, save)
        try:
            result["overhead"] = run_overhead(500)
        except Exception as e:
            result["overhead"] = {"error": f"{type(e).__name__}: {e}"}
        result["seconds"] = time.perf_counter() - t0
        save()
        _log(f"[fa3] wrote {path} ({result['seconds']:.0f} s)")
        return 0
    if not args.skip_correctness:
        result["correctness"] = run_correctness(3 if args.smoke else None)
        save()
        bad = [r for r in result["correctness"] if r["status"] in ("FAIL", "ERROR")]
        _log(f"[correctness] {len(bad)} failing of {len(result['correctness'])}")
    if not args.skip_bench:
        result["bench"] = run_bench()
        save()
    if not args.skip_ablation:
        result["ablation"] = run_ablation(args.head_dim[0] if args.head_dim else 128)
        save()
    if not args.smoke:
        try:
            result["overhead"] = run_overhead()
        except Exception as e:
            result["overhead"] = {"error": f"{type(e).__name__}: {e}"}
        save()
    _log(f"[fa3] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
