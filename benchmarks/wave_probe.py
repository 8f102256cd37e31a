"""Whether a kernel's time follows its waves: forward and backward at B 1, N 8k, D 128,
non-causal, bf16, with Hq = Hkv in {30, 31, 32, 33}, for fa3, FA4 and SDPA's cuDNN backend.

    python -m benchmarks.wave_probe [--passes 3]     # on the H200

The backward's grid is 64 column blocks per head (128 keys each): 1,920 / 1,984 / 2,048 / 2,112
CTAs at one per SM over 132 SMs are 14.5 / 15.0 / 15.5 / 16.0 waves. If the time were set by
whole waves it would go 15 : 16 : 16 : 16 over the four head counts (the last wave's idle SMs
cost as much as busy ones); if by work, 30 : 31 : 32 : 33. The table prints each time per head
relative to H = 32's: about 1.0 everywhere is the second case.
"""

from __future__ import annotations

import argparse
import statistics

import torch

HEADS = (30, 31, 32, 33)
CONTENDERS = ("fa3", "fa4", "sdpa-cudnn")


def main(argv: list[str] | None = None) -> None:
    from flashsuite.common.testing import Case, make_grad_out, make_inputs
    from flashsuite.dispatch.bench import make_callable, time_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args(argv)
    res: dict[tuple, list] = {}
    for _ in range(args.passes):
        for h in HEADS:
            case = Case(1, 8192, 8192, h, h, 128, dtype=torch.bfloat16)
            for c in CONTENDERS:
                q, k, v = make_inputs(case, "cuda", requires_grad=True)
                run, leaves = make_callable(c, case, q, k, v)
                out = run()
                dout = make_grad_out(case, "cuda")
                if out.shape != dout.shape:  # SDPA works in (B, H, N, D)
                    dout = dout.transpose(1, 2).contiguous()
                fwd = time_ms(run)
                bwd = time_ms(lambda o=out, x=leaves, g=dout: torch.autograd.grad(o, x, g, True))
                res.setdefault((c, h), []).append((fwd, bwd))
                del q, k, v, out, dout, run, leaves
                torch.cuda.empty_cache()
    print(f"B 1, N 8k, D 128, non-causal: medians of {args.passes} passes, us fwd / bwd")
    for c in CONTENDERS:
        med = {
            h: [statistics.median(x[i] for x in res[(c, h)]) * 1e3 for i in (0, 1)] for h in HEADS
        }
        times = "  ".join(f"H{h} {med[h][0]:.0f}/{med[h][1]:.0f}" for h in HEADS)
        per_head = "  ".join(
            f"H{h} {med[h][0] / med[32][0] * 32 / h:.3f}/{med[h][1] / med[32][1] * 32 / h:.3f}"
            for h in HEADS
        )
        print(f"{c:>11}: {times}\n{'':>11}  time per head / H32's: {per_head}")


if __name__ == "__main__":
    main()
