"""Where a forward's time goes, tile by tile, from the kernel's own clock stamps (a GPU run).

    python3 -m benchmarks.fa3_timeline --head-dim 128 --seqlen 1024 --seqlen 16384 \
        --variant p2:persistent=1,overlap_tiles=1,balanced_order=1,o_alias_q=0,q_stages=2

Each contender is the shipped config for the shape ("table") or a variant (fa3_fwd_ab's
NAME:FIELD=VALUE,... syntax) built with `Fa3Config.trace` (fa3/trace.py): every (tile, consumer
warpgroup) writes the SM's %clock64 at its CTA's start, the tile's start, Q's arrival, the end
of its K/V loop and of its epilogue, the producer's first and last load of the tile, and
%globaltimer at the CTA's start and the tile's end. Shapes: the standard sweep's B·N = 16k,
Hq·D = 2048, bf16, non-causal or --causal. Per contender and shape the tool times the build
with and without the stamps (CUDA events, medians of --reps calls: what the stamps cost), then
reads one traced call and prints, in SM cycles per tile (medians over tiles and warpgroups):

    launch     the previous CTA's last epilogue on the SM -> this CTA's first stamp (plain grid)
    prologue   CTA start -> the consumer warpgroup starts its first tile
    between    one tile's epilogue end -> the next tile's start, same warpgroup (persistent)
    q_wait     tile start -> Q waited for
    loop       Q -> the last P·V retired; loop_per_block: loop / the tile's K/V blocks
    epilogue   loop end -> O and LSE handed to their stores
    loads      the producer's first -> last load issue of the tile

and the share of the SMs' time (first CTA start to last tile end per SM, summed) that each
takes, with the tail: the time SMs sit idle at the end while others finish (from the
globaltimer). `analyse` is a pure function of the stamps (tests/test_fa3_trace.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from flashsuite.fa3.trace import FIELDS

F = {name: i for i, name in enumerate(FIELDS)}


def _median(xs: list) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def analyse(rows: list, wgs: int, n_blocks: list[int]) -> dict:
    """Summary of one traced call. `rows`: per tile, `wgs` records (lists of len(FIELDS) ints,
    consumer warpgroup 0 first; the producer's stamps in warpgroup 0's record); n_blocks: each
    tile's K/V blocks (the loop a block is the median of loop / blocks over tiles with any).
    Tiles whose records are all 0 (not run) are an error."""
    if len(n_blocks) != len(rows):
        raise ValueError(f"n_blocks: expected one per tile ({len(rows)}), got {len(n_blocks)}")
    tiles = []
    for t, recs in enumerate(rows):
        if len(recs) != wgs:
            raise ValueError(f"tile {t}: expected {wgs} warpgroup records, got {len(recs)}")
        if any(r[F["tile_start"]] == 0 or r[F["epilogue_end"]] == 0 for r in recs):
            raise ValueError(f"tile {t}: a warpgroup left no stamps (the kernel did not run it)")
        tiles.append(recs)
    by_sm: dict[int, list] = {}
    for recs in tiles:
        by_sm.setdefault(int(recs[0][F["smid"]]), []).append(recs)
    names = (
        "launch",
        "prologue",
        "between",
        "q_wait",
        "loop",
        "epilogue",
        "loads",
        "loop_per_block",
    )
    per: dict[str, list] = {k: [] for k in names}
    for recs, blocks in zip(tiles, n_blocks, strict=True):
        if blocks > 0:
            per["loop_per_block"] += [(r[F["loop_end"]] - r[F["q_ready"]]) / blocks for r in recs]
    totals = dict.fromkeys(("launch", "prologue", "between", "q_wait", "loop", "epilogue"), 0.0)
    span_total = 0.0
    ghz = []
    starts_ns, ends_ns = [], []  # per SM: its first CTA start, its last tile end
    for sm_tiles in by_sm.values():
        sm_tiles.sort(key=lambda recs: recs[0][F["tile_start"]])
        first = min(r[F["cta_start"]] for recs in sm_tiles for r in recs)
        last = max(r[F["epilogue_end"]] for recs in sm_tiles for r in recs)
        span_total += last - first
        first_ns = min(r[F["cta_start_ns"]] for recs in sm_tiles for r in recs)
        last_ns = max(r[F["epilogue_end_ns"]] for recs in sm_tiles for r in recs)
        starts_ns.append(first_ns)
        ends_ns.append(last_ns)
        if last > first and last_ns > first_ns:
            ghz.append((last - first) / (last_ns - first_ns))
        prev = None
        for recs in sm_tiles:
            new_cta = prev is None or recs[0][F["cta_start"]] != prev[0][F["cta_start"]]
            if new_cta and prev is not None:
                gap = recs[0][F["cta_start"]] - max(r[F["epilogue_end"]] for r in prev)
                per["launch"].append(gap)
                totals["launch"] += gap
            for w, r in enumerate(recs):
                share = 1.0 / wgs  # each phase counted once per SM: the warpgroups' mean
                if new_cta:
                    v = r[F["tile_start"]] - r[F["cta_start"]]
                    per["prologue"].append(v)
                    totals["prologue"] += v * share
                else:
                    v = r[F["tile_start"]] - prev[w][F["epilogue_end"]]
                    per["between"].append(v)
                    totals["between"] += v * share
                # A plain-grid tile without a K/V block never waits for Q (q_ready 0).
                q_ready = r[F["q_ready"]] or r[F["tile_start"]]
                for name, a, b in (
                    ("q_wait", r[F["tile_start"]], q_ready),
                    ("loop", q_ready, r[F["loop_end"]]),
                    ("epilogue", r[F["loop_end"]], r[F["epilogue_end"]]),
                ):
                    per[name].append(b - a)
                    totals[name] += (b - a) * share
            per["loads"].append(recs[0][F["loads_issued"]] - recs[0][F["load_start"]])
            prev = recs
    kernel_ns = max(ends_ns) - min(starts_ns)
    tail_ns = statistics.fmean(max(ends_ns) - e for e in ends_ns)
    med = {k: _median(v) for k, v in per.items()}
    return {
        "sms": len(by_sm),
        "tiles": len(tiles),
        "tiles_per_sm": len(tiles) / len(by_sm),
        "ghz": _median(ghz),
        "median_cycles": med,
        "share": {k: v / span_total for k, v in totals.items()},
        "span_ns": kernel_ns,
        "tail_share": tail_ns / kernel_ns if kernel_ns else float("nan"),
    }


def tile_blocks(n: int, tile_m: int, tile_n: int, causal: bool, tiles: int) -> list[int]:
    """K/V blocks of each of `tiles` trace tiles (tile_id order: m_block fastest) of N x N
    problems: all of them, or causal, the blocks up to the key of the tile's last row."""
    m_blocks = -(-n // tile_m)
    full = -(-n // tile_n)
    per_m = [-(-min(n, (m + 1) * tile_m) // tile_n) if causal else full for m in range(m_blocks)]
    return [per_m[t % m_blocks] for t in range(tiles)]


def _time(fn, reps: int) -> float:
    import torch

    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.fa3_fwd_ab import parse_sweep, variant_config
    from flashsuite.common.testing import Case, make_inputs
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface as fa3
    from flashsuite.fa3.configs import can_implement

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE,... (repeat)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, action="append", default=[], help="N (repeat)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="also write the summaries here")
    args = ap.parse_args(argv)
    seqlens, variants = parse_sweep(ap, args, [1024, 16384])
    variants = [("table", {}), *variants]
    d = args.head_dim
    heads = 2048 // d
    out = []
    for n in seqlens:
        case = Case(16384 // n, n, n, heads, heads, d, dtype=torch.bfloat16, causal=args.causal)
        q, k, v = make_inputs(case, "cuda")
        p = check_inputs(q, k, v, **case.options())
        for name, changes in variants:
            cfg = variant_config(p, changes)
            traced = dataclasses.replace(cfg, trace=True)
            ok, why = can_implement(traced, d, torch.bfloat16)
            if not ok:
                print(f"{name}: cannot build {traced}: {why}", flush=True)
                return 1
            m_blocks = -(-n // cfg.tile_m)
            rows = case.batch * heads * m_blocks * cfg.num_consumer_wgs
            buf = torch.zeros(rows, len(FIELDS), dtype=torch.int64, device="cuda")

            def plain(q=q, k=k, v=v, p=p, cfg=cfg):
                return fa3.forward(q, k, v, p, cfg=cfg)

            def stamped(q=q, k=k, v=v, p=p, traced=traced, buf=buf):
                return fa3.forward(q, k, v, p, cfg=traced, trace=buf)

            ref = plain()[0]
            if not torch.equal(stamped()[0], ref):
                print(f"{name} N {n}: the traced build's output differs from the plain one")
            us, us_traced = _time(plain, args.reps), _time(stamped, args.reps)
            buf.zero_()
            stamped()
            torch.cuda.synchronize()
            recs = buf.view(-1, cfg.num_consumer_wgs, len(FIELDS)).tolist()
            blocks = tile_blocks(n, cfg.tile_m, cfg.tile_n, args.causal, len(recs))
            summary = analyse(recs, cfg.num_consumer_wgs, blocks)
            summary.update(variant=name, seqlen=n, us=us, us_traced=us_traced)
            out.append(summary)
            med, share = summary["median_cycles"], summary["share"]
            print(
                f"{name:>8} N {n:5}: {us:7.1f} us ({us_traced:7.1f} traced), "
                f"{summary['ghz']:.2f} GHz, {summary['tiles_per_sm']:.1f} tiles/SM, "
                f"tail {summary['tail_share']:.1%}",
                flush=True,
            )
            print(
                "   cycles/tile: "
                + ", ".join(f"{k} {med[k]:.0f}" for k in med)
                + "\n   share: "
                + ", ".join(f"{k} {v:.1%}" for k, v in share.items()),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
