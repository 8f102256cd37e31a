"""fa1 forward tuning on a GPU: tile shapes, warps, stages and Q splits, next to the competition.

    python -m benchmarks.fa1_tune --out DIR [--quick]      # on the GPU; writes DIR/fa1_tune.json
    python -m benchmarks.fa1_tune --out DIR --tma [--causal] [--allow-spill N] [--per-sm 8]
                                                           # the sm90 TMA tiles (fa1_tune_tma*.json)
    python -m benchmarks.fa1_tune --out DIR --shipped --seqlen 2048 --seqlen 16384  # table only

FA1's loop order re-reads and re-writes the fp32 running output O_i (and m_i, l_i) at every
(K/V block j, Q block i) step, so a step moves ~10·B_r·D bytes for 4·B_r·B_c·D FLOPs: at
B_c = 128 that is ~51 FLOP/byte, far under the H200's ~200 FLOP/byte ridge, so the kernel is
meant to be bandwidth-bound, not latency-bound. The levers: a wide B_c (fewer round trips),
enough warps in flight per SM to cover the load latency of each step (tile footprint in
registers and shared memory, Q splits: programs per SM), and software pipelining of the inner
loop (num_stages: the next step's Q_i, O_i, m_i, l_i are independent of this step's stores).

Shapes: bf16, B·N = 16k tokens, Hq·D = 2048, non-causal (and causal with --causal), D 64 and
128. Every candidate is checked against the materialising reference (max abs error) and timed
with `triton.testing.do_bench` (median) next to materialising PyTorch attention (softmax(q·kᵀ)·v
in bf16, the baseline fa1 is measured against) and fa2, in the same run. Registers and
spills come from the compiled kernel.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from flashsuite.common.flops import attention_flops
from flashsuite.common.testing import make_inputs
from flashsuite.common.validation import check_inputs
from flashsuite.dispatch.bench import materialising, standard_sweep, time_ms
from flashsuite.fa1 import interface
from flashsuite.fa1.configs import Fa1Config, fwd_config, q_splits

# (block_m, block_n, num_warps, num_stages): the shipped entry is added per head_dim.
CANDIDATES = [
    Fa1Config(bm, bn, w, s)
    for bm, bn, w in (
        (32, 128, 4),
        (32, 128, 8),
        (32, 256, 8),
        (64, 64, 4),
        (64, 128, 4),
        (64, 128, 8),
        (64, 256, 8),
        (128, 64, 8),
        (128, 128, 8),
    )
    for s in (1, 2, 3)
]
QUICK = [c for c in CANDIDATES if c.num_stages in (1, 2) and c.block_m in (32, 64)]
# sm90 TMA path (kernels.py USE_DESC): one 64-row wgmma tile per warpgroup.
TMA_CANDIDATES = [
    Fa1Config(bm, bn, w, s, use_tma=True, split_kv=split)
    for bm, bn, w, split, stages in (
        (64, 128, 4, False, (1, 2, 3)),
        (128, 128, 8, False, (1,)),
        (64, 256, 4, True, (1, 2, 3)),  # B_c 256 in two 128-wide halves
        (128, 256, 8, True, (1, 2)),
    )
    for s in stages
]
PER_SM_CANDIDATES = (1, 2, 4, 8)  # programs per SM to try (configs.q_splits)


def _log(msg: str) -> None:
    print(msg, flush=True)


def _inputs(n: int, d: int, causal: bool):
    (case,) = standard_sweep(head_dims=(d,), seqlens=(n,), causals=(causal,))
    q, k, v = make_inputs(case, "cuda")  # (B, N, H, D) bf16
    return q, k, v, check_inputs(q, k, v, causal=causal)


def _time(fn) -> float:
    return time_ms(fn, warmup_ms=5, rep_ms=40)


def _one_shape(
    d: int,
    n: int,
    causal: bool,
    cands: list[Fa1Config],
    shipped,
    allow_spill: int = 0,  # spill bytes a candidate may have and still be timed
    per_sm_candidates: tuple[int, ...] = PER_SM_CANDIDATES,
) -> list[dict]:
    from flashsuite import dispatch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v, p = _inputs(n, d, causal)
    flops = attention_flops(q.shape[0], q.shape[2], n, n, d, causal=causal)
    naive = materialising(q, k, v, causal)
    ref = naive().transpose(1, 2)  # (B, N, H, D)
    base = {"D": d, "N": n, "causal": causal}
    naive_ms = _time(naive)
    fa2_ms = _time(lambda: dispatch.attention(q, k, v, causal=causal, version="fa2"))
    rows = [
        {**base, "name": "naive", "ms": naive_ms, "tflops": round(flops / naive_ms / 1e9, 1)},
        {**base, "name": "fa2", "ms": fa2_ms, "tflops": round(flops / fa2_ms / 1e9, 1)},
    ]
    _log(f"[peer] D={d} N={n} naive {rows[0]['tflops']} fa2 {rows[1]['tflops']} TFLOP/s")
    bh = q.shape[0] * q.shape[2]
    for cfg in cands:
        nqb = -(-n // cfg.block_m)
        for per_sm in per_sm_candidates:
            splits = q_splits(bh, nqb, sms, per_sm)
            row = {**base, "name": "fa1", "cfg": asdict(cfg), "per_sm": per_sm}
            row.update(splits=splits, shipped=cfg == shipped)
            try:
                out, _, kern = interface._forward(q, k, v, p, cfg, splits)
                row["regs"], row["spills"] = kern.n_regs, kern.n_spills
                row["err"] = (out.float() - ref.float()).abs().max().item()
                if row["spills"] > allow_spill or row["err"] > 0.05:
                    row["skipped"] = "spills" if row["spills"] > allow_spill else "wrong"
                else:
                    ms = _time(
                        lambda cfg=cfg, splits=splits: interface._forward(q, k, v, p, cfg, splits)
                    )
                    tf = round(flops / ms / 1e9, 1)
                    row.update(ms=ms, tflops=tf, x_naive=round(naive_ms / ms, 3))
            except Exception as e:  # a config the compiler refuses (smem, regs)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            shown = ("regs", "spills", "tflops", "x_naive", "skipped", "error")
            _log(
                f"[fa1] D={d} N={n} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} "
                f"s{cfg.num_stages} per_sm={per_sm} splits={splits} "
                + " ".join(f"{key}={row[key]}" for key in shown if key in row)
            )
            if splits == nqb or "tflops" not in row:
                break  # more programs per SM would not change the grid (or it cannot run)
    return rows


def sweep(
    head_dims,
    seqlens,
    causal: bool,
    quick: bool,
    tma: bool = False,
    shipped_only: bool = False,
    allow_spill: int = 0,
    per_sm_candidates: tuple[int, ...] = PER_SM_CANDIDATES,
) -> list[dict]:
    rows = []
    for d in head_dims:
        shipped = fwd_config(d, torch.bfloat16, 90, causal)
        pool = [] if shipped_only else TMA_CANDIDATES if tma else QUICK if quick else CANDIDATES
        cands = [shipped] + [c for c in pool if c != shipped]
        for n in seqlens:
            rows += _one_shape(d, n, causal, cands, shipped, allow_spill, per_sm_candidates)
            torch.cuda.empty_cache()
    return rows


def best(rows: list[dict]) -> None:
    """Per (D, N): the fastest fa1 row, the shipped one and the peers."""
    keys = sorted({(r["D"], r["N"], r["causal"]) for r in rows})
    for key in keys:
        mine = [r for r in rows if (r["D"], r["N"], r["causal"]) == key]
        fa1 = [r for r in mine if r["name"] == "fa1" and "tflops" in r]
        peers = {r["name"]: r["tflops"] for r in mine if r["name"] != "fa1"}
        if not fa1:
            continue
        top = max(fa1, key=lambda r: r["tflops"])
        ship = [r for r in fa1 if r["shipped"]]
        ship_best = max(ship, key=lambda r: r["tflops"]) if ship else None
        _log(
            f"[best] D={key[0]} N={key[1]} causal={key[2]} peers {peers} "
            f"best {top['cfg']} per_sm={top['per_sm']} {top['tflops']} "
            f"(x naive {top['x_naive']}); shipped best "
            + (f"per_sm={ship_best['per_sm']} {ship_best['tflops']}" if ship_best else "-")
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="stages 1-2, 32/64-row tiles only")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tma", action="store_true", help="the sm90 TMA candidates only")
    ap.add_argument("--shipped", action="store_true", help="only the table's config")
    ap.add_argument(
        "--allow-spill",
        type=int,
        default=0,
        help="also time configs with Triton's n_spills <= N (4-byte words of local memory)",
    )
    ap.add_argument("--per-sm", type=int, action="append", help="programs per SM to try")
    ap.add_argument("--head-dim", type=int, action="append")
    ap.add_argument("--seqlen", type=int, action="append")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = sweep(
        args.head_dim or [64, 128],
        args.seqlen or [2048, 16384],
        args.causal,
        args.quick,
        args.tma,
        args.shipped,
        args.allow_spill,
        tuple(args.per_sm or PER_SM_CANDIDATES),
    )
    best(rows)
    res = {"device": torch.cuda.get_device_name(), "rows": rows}
    res["seconds"] = time.perf_counter() - t0
    tag = "_shipped" if args.shipped else "_tma" if args.tma else ""
    (out / f"fa1_tune{tag}{'_causal' if args.causal else ''}.json").write_text(
        json.dumps(res, indent=1)
    )
    _log(f"[fa1] done ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
