"""Dense problems with few query rows (a decode step or a short chunk against a long K/V)
through fa3's (or, with --version fa2, fa2's) forward (what `dispatch.attention` runs): on the
split-KV decode kernel (the version's interface.decode_route, its query and grid limits lifted
so that every point of up to 64 packed rows runs there) and on the forward kernel
(DECODE_ROUTE_MAX_ROWS = 0), next to SDPA's flash and cuDNN backends and FA4's forward on the
same tensors.

    python -m benchmarks.decode_route_ab [--version fa2] [--passes 3] [--point B,NQ,NK,HQ,HKV]

bf16, D 128, non-causal, k and v (B, Nk, Hkv, D); µs per CUDA-graph replay
(decode_bench._graph_ms: the kernels' GPU time), medians of interleaved passes, and per point
the faster peer's time over each fa3 build's (>= 1.0: fa3 as fast or faster), "table" being
the build fa3's policy picks. The dense and route outputs are compared (their largest
difference: the decode kernel splits the keys).
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch

# (B, Nq, Nk, Hq, Hkv): decode steps at GQA 32/8, then chunks of up to 64 packed rows.
POINTS = [
    (1, 1, 4096, 32, 8), (1, 1, 32768, 32, 8), (8, 1, 32768, 32, 8), (32, 1, 4096, 32, 8),
    (128, 1, 4096, 32, 8), (8, 4, 8192, 32, 8), (4, 16, 8192, 32, 8), (32, 16, 2048, 16, 16),
    (8, 64, 4096, 16, 16), (1, 1, 512, 32, 8),
]  # fmt: skip
D = 128


def main(argv: list[str] | None = None) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks import decode_bench as db
    from flashsuite.common.validation import check_inputs
    from flashsuite.dispatch.bench import fa4_function

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", choices=("fa3", "fa2"), default="fa3")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--point", action="append", default=[], help="B,NQ,NK,HQ,HKV")
    args = ap.parse_args(argv)
    interface = importlib.import_module(f"flashsuite.{args.version}.interface")
    points = [tuple(int(x) for x in s.split(",")) for s in args.point] or POINTS
    fa4, why = fa4_function()
    if fa4 is None:
        print(f"fa4: not timed ({why})"[:200], flush=True)
    names = ("DECODE_ROUTE_MAX_ROWS", "DECODE_ROUTE_MAX_NQ", "DECODE_ROUTE_MHA_MAX_CTAS")
    saved = {name: getattr(interface, name) for name in names}
    builds = {
        "dense": dict(saved, DECODE_ROUTE_MAX_ROWS=0),
        # every problem of up to 64 packed rows on the decode kernel, whatever the table's policy
        "route": dict(
            DECODE_ROUTE_MAX_ROWS=64, DECODE_ROUTE_MAX_NQ=64, DECODE_ROUTE_MHA_MAX_CTAS=2**31
        ),
        "table": dict(saved),  # what fa3 runs: the route where its policy takes the problem
    }

    def use(settings: dict) -> None:
        for name, value in settings.items():
            setattr(interface, name, value)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, nq, nk, hq, hkv in points:
        q = torch.randn(b, nq, hq, D, device="cuda", generator=gen).to(torch.bfloat16)
        k, v = (
            torch.randn(b, nk, hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2)
        )
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (B, H, N, D) views
        p = check_inputs(q, k, v)

        def sdpa(backend, qh=qh, kh=kh, vh=vh, gqa=hq != hkv):
            def run():
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qh, kh, vh, enable_gqa=gqa
                    )

            return run

        peers = {
            "flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        }
        if fa4 is not None:
            peers["fa4"] = lambda q=q, k=k, v=v: fa4(q, k, v)[0]
        res: dict[str, list[float]] = {}
        outs = {}
        try:
            with torch.no_grad():
                for _ in range(args.passes):
                    for name, settings in builds.items():
                        use(settings)
                        # the version's forward itself: dispatch's plans bind the route once
                        call = lambda q=q, k=k, v=v, p=p: interface.forward(q, k, v, p)[0]
                        res.setdefault(name, []).append(db._timed(call))
                        outs[name] = call()
                    use(saved)
                    for name, fn in peers.items():
                        res.setdefault(name, []).append(db._timed(fn))
        finally:
            use(saved)
        med = {}
        for name, times in res.items():
            ok = [t * 1e3 for t in times if isinstance(t, float)]
            med[name] = statistics.median(ok) if ok else None
            if not ok:
                print(f"   {name}: {times[0]}"[:200], flush=True)
        timed_peers = [med[n] for n in peers if med.get(n) is not None]
        best = min(timed_peers) if timed_peers else float("nan")
        diff = (outs["dense"].float() - outs["route"].float()).abs().max().item()
        ratio = {n: f"{best / med[n]:.3f}" if med.get(n) else "n/a" for n in builds}
        print(
            f"{args.version} B {b:3d} Nq {nq:2d} Nk {nk:6d} H {hq}/{hkv}: "
            + "  ".join(f"{n} {t:.1f}" for n, t in med.items() if t is not None)
            + f"  | best peer / dense {ratio['dense']}, / route {ratio['route']}, / table "
            + ratio["table"]
            + f"  max |dense - route| {diff:.2e}",
            flush=True,
        )
        del q, k, v, qh, kh, vh


if __name__ == "__main__":
    main()
