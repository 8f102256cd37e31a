"""fa3's decode with one `fa3/decode_configs.py` switch off and on, next to SDPA's flash and cuDNN
backends, at the decode sweep's points (GQA 32/8, D 128, bf16, Nq 1, contiguous cache).

    python -m benchmarks.decode_switch_ab --switch DECODE_KV_EVICT_FIRST [--passes 5]
    python -m benchmarks.decode_switch_ab --switch DECODE_PAGED_BOXES --page 64

µs per CUDA-graph replay (decode_bench._graph_ms), medians of interleaved passes (the switch set
before each of its timings); the faster SDPA backend's time over each build's (>= 1.0: fa3 as
fast or faster), from the medians and pass by pass (`ab_stats.paired_ratios`: each pass's
faster SDPA time over the build's). The outputs are compared bit for bit and by their largest
difference (a switch that changes the key tiles or the split count changes the order of the
sums). With `--page N` the two builds read
the same tokens on shuffled N-token pages (decode_bench's paged copy), and the contiguous
cache through the shipped build is timed beside them ("contig").
"""

from __future__ import annotations

import argparse
import statistics

import torch

POINTS = [(1, 4096), (1, 32768), (1, 131072), (8, 32768), (32, 4096), (32, 32768),
          (32, 131072), (128, 4096), (128, 32768)]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from torch.nn.attention import SDPBackend

    from benchmarks import decode_bench as db
    from benchmarks.ab_stats import paired_ratios
    from flashsuite.fa3 import decode_configs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", required=True, help="a boolean in fa3/decode_configs.py")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--page", type=int, default=0, help="page size of a paged cache (0: none)")
    args = ap.parse_args(argv)
    if not isinstance(getattr(decode_configs, args.switch, None), bool):
        raise SystemExit(
            f"--switch: expected a boolean of fa3/decode_configs.py, got {args.switch!r}"
        )
    saved = getattr(decode_configs, args.switch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, n in POINTS:
        q = torch.randn(b, 1, db.HQ, db.D, device="cuda", generator=gen).to(db.DTYPE)
        k, v = (
            torch.randn(b, n, db.HKV, db.D, device="cuda", generator=gen).to(db.DTYPE)
            for _ in range(2)
        )
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        cache = (k, v, None)
        if args.page:
            cache = _paged(k, v, args.page, gen)
        res: dict[str, list[float]] = {}
        outs = {}
        try:
            for _ in range(args.passes):
                for name, flag in (("off", False), ("on", True)):
                    setattr(decode_configs, args.switch, flag)
                    call = db._decode("fa3", q, *cache[:2], lens, cache[2])
                    res.setdefault(name, []).append(db._graph_ms(call) * 1e3)
                    outs[name] = call()
                setattr(decode_configs, args.switch, saved)
                if args.page:
                    call = db._decode("fa3", q, k, v, lens, None)
                    res.setdefault("contig", []).append(db._graph_ms(call) * 1e3)
                for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                      ("cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip
                    res.setdefault(name, []).append(db._sdpa_ms(q, k, v, backend) * 1e3)
        finally:
            setattr(decode_configs, args.switch, saved)
        med = {name: statistics.median(t) for name, t in res.items()}
        best = min(med["flash"], med["cudnn"])
        print(
            f"B {b:3d} Nk {n:6d}: "
            + "  ".join(f"{name} {t:.1f}" for name, t in med.items())
            + f"  | best SDPA / off {best / med['off']:.3f}, / on {best / med['on']:.3f}"
            + f"  bitwise equal {torch.equal(outs['off'], outs['on'])}"
            + f"  max |off - on| {(outs['off'].float() - outs['on'].float()).abs().max():.2e}",
            flush=True,
        )
        # Per pass: the faster SDPA backend's time of that pass over each build's (passes
        # interleave, so a pass's pair shares the machine's state).
        best_pass = [min(a, c) for a, c in zip(res["flash"], res["cudnn"], strict=True)]
        rates = {name: [1.0 / t for t in times] for name, times in res.items()}
        rates["best SDPA"] = [1.0 / t for t in best_pass]
        for line in paired_ratios({(k, n): v for k, v in rates.items()}, ["best SDPA"]):
            if line.split("/")[0].strip() in ("off", "on", "contig"):
                print("   " + line.strip(), flush=True)
        del q, k, v, cache


def _paged(k, v, page: int, gen) -> tuple:
    """(k_pages, v_pages, block_table): the tokens of contiguous caches k, v (B, N, Hkv, D) on
    shuffled page-token pages, N a multiple of page."""
    b, n, hkv, d = k.shape
    if n % page:
        raise SystemExit(f"--page: expected a divisor of every point's cache length, got {page}")
    pages = b * n // page
    table = torch.randperm(pages, device=k.device, generator=gen).to(torch.int32)
    table = table.reshape(b, n // page)
    out = []
    for t in (k, v):
        t_pages = torch.empty(pages, page, hkv, d, dtype=t.dtype, device=t.device)
        t_pages[table.long()] = t.view(b, n // page, page, hkv, d)
        out.append(t_pages)
    return (*out, table)


if __name__ == "__main__":
    main()
