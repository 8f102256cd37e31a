"""Compile probe of fa3's KV-cache decode kernel (fa3/decode.py) for sm_90a, no GPU needed.

    python -m benchmarks.fa3_decode_probe               # the CI set, a table
    python -m benchmarks.fa3_decode_probe --all         # every head dim x cache layout x split
    python -m benchmarks.fa3_decode_probe --json out.json

Per build: the PTX instruction counts of benchmarks.fa3_probe (wgmma, TMA, setmaxnreg, ...),
the TMA rank of the K/V loads (5-D ragged views), vectorised Q loads, and ptxas' registers,
spills and C75xx remarks. Sets CUTE_DSL_* before importing cutlass: run it in its own process.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from benchmarks.fa3_probe import _capture_fd2, parse_ptxas, ptx_counts

# (head_dim, causal, local, softcap, page_size (0: contiguous), split, fused combine): the CI
# set covers every flag, both cache layouts, a page smaller than the default key tile, and the
# three outputs (final, partials, partials merged in the kernel).
CI_CASES = [
    (128, False, False, False, 0, False, False),
    (128, True, False, False, 64, True, False),
    (64, True, True, True, 16, False, False),
    (256, False, True, False, 0, True, False),
    (128, False, False, False, 0, True, True),
    (64, True, False, False, 16, True, True),
]


def all_cases() -> list[tuple]:
    return [
        (d, causal, False, False, page, split, fused)
        for d in (64, 96, 128, 192, 256)
        for page in (0, 16, 48, 64, 192, 256)
        for split, fused in ((False, False), (True, False), (True, True))
        for causal in (False, True)
    ]


def case_name(case: tuple) -> str:
    d, causal, local, softcap, page, split, fused = case
    flags = [f for f, on in (("causal", causal), ("local", local), ("softcap", softcap)) if on]
    cache = f"paged{page}" if page else "contiguous"
    out = "fused" if fused else "split" if split else "final"
    return "-".join([f"D{d}", cache, out, *flags])


def probe(
    case: tuple,
    ctas_per_sm: int = 1,
    paged_boxes: bool = False,
    evict_first: bool = False,
    leftpad: bool = False,
) -> dict:
    """Compile one decode build (`ctas_per_sm` 2: the two-CTAs-per-SM build; `paged_boxes`: a
    paged build on the contiguous tiles, one TMA box per page, decode_host.plan's choice under
    decode_configs.DECODE_PAGED_BOXES; `evict_first`: K and V loads with the L2 evict-first hint,
    decode_configs.DECODE_KV_EVICT_FIRST; `leftpad`: a contiguous cache whose rows start at a
    slot of their own, cache_leftpad); its PTX and ptxas facts."""
    import torch

    from flashsuite.fa3 import decode_configs
    from flashsuite.fa3.compile import DecodeKey, compile_decode
    from flashsuite.fa3.decode import L2_EVICT_FIRST
    from flashsuite.fa3.decode_host import _tiles

    d, causal, local, softcap, page, split, fused = case
    decode_configs.DECODE_PAGED_BOXES = paged_boxes
    cfg, box = _tiles(d, page, ctas_per_sm)
    key = DecodeKey(
        torch.bfloat16, d, causal, local, softcap, page > 0, split, cfg, fused, ctas_per_sm, box,
        evict_first, leftpad,
    )  # fmt: skip
    t0 = time.perf_counter()
    compiled, log = _capture_fd2(lambda: compile_decode(key))
    ptx = getattr(compiled, "__ptx__", None) or ""
    return {
        "name": case_name(case)
        + ("-2cta" if ctas_per_sm == 2 else "")
        + (f"-box{box}" if box else "")
        + ("-evict1st" if evict_first else "")
        + ("-leftpad" if leftpad else ""),
        "config": cfg.__dict__,
        "compile_s": round(time.perf_counter() - t0, 2),
        "ptx": ptx_counts(ptx),
        "tma_5d": len(re.findall(r"cp\.async\.bulk\.tensor\.5d", ptx)),
        # The .L2::cache_hint operand is always there (0 without a policy); the evict-first
        # builds load CUTLASS's EVICT_FIRST policy into it.
        "evict_first_policies": ptx.count(f"{L2_EVICT_FIRST};"),
        "q_loads_v4": len(re.findall(r"ld\.global\.v4", ptx)),
        "merge_loads": len(re.findall(r"ld\.global\.cg\.v4\.f32", ptx)),
        "counter_atoms": len(re.findall(r"atom\.acq_rel\.gpu\.global\.add\.s32", ptx)),
        "setmaxnreg": re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx),
        **parse_ptxas(log),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--all", action="store_true", help="every head dim, layout and output")
    ap.add_argument(
        "--two-ctas", action="store_true",
        help="the builds two CTAs of which share an SM (D <= 128; decode_configs.decode_config)",
    )  # fmt: skip
    ap.add_argument(
        "--paged-boxes", action="store_true",
        help="paged builds on the contiguous tiles, one TMA box per page (DECODE_PAGED_BOXES)",
    )  # fmt: skip
    ap.add_argument(
        "--evict-first", action="store_true",
        help="K and V loads with the L2 evict-first hint (DECODE_KV_EVICT_FIRST)",
    )  # fmt: skip
    ap.add_argument(
        "--leftpad", action="store_true",
        help="the contiguous builds whose rows start at a slot of their own (cache_leftpad)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    cases = all_cases() if args.all else CI_CASES
    if args.two_ctas:
        cases = [c for c in cases if c[0] <= 128]
    if args.paged_boxes:
        cases = [c for c in cases if c[4]]
    if args.leftpad:
        cases = [c for c in cases if not c[4]]
    results = [
        probe(c, 2 if args.two_ctas else 1, args.paged_boxes, args.evict_first, args.leftpad)
        for c in cases
    ]
    for r in results:
        print(
            f"{r['name']:40s} regs={r['registers']} spill={r['spill_stores']}/{r['spill_loads']} "
            f"remarks={r['remarks']} tma5d={r['tma_5d']} evict1st={r['evict_first_policies']} "
            f"{r['compile_s']}s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
