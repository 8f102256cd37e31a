"""What Hopper's e4m3 wgmma keeps of a dot product, read off fa3's fp8 forward (a GPU run).

    python3 -m benchmarks.fp8_acc_probe [--json OUT.json]

With one key, softmax_scale 1 and descales of 1, a row's LSE is its raw score S = q·k as the
Q·Kᵀ wgmma accumulated it (exp(S - S) = 1), up to the float32 rounding of the log2-unit
round trip (a few 1e-5 at |S| ~ 256). The rows are crafted dot products (k all ones, so S is
the sum of q's row): one large addend of 256 and small ones of 2^-3 .. 2^-9 placed in the
same 8-, 16- or 32-element part of a k = 32 step as the large one or in the next step,
of either sign, and random rows of mixed magnitudes. Each accumulator model (below, at
several widths) predicts every row's S; the model that matches the kernel on every row to the
round trip's precision describes the hardware, and the suite's fp8 LSE baseline
(common.testing.mma_truncated) should follow it.

Models, for every k = 32 step of the dot product (D = 64: two steps):
- sum B:     the float32 accumulator plus the step's exact sum, cut toward zero to B mantissa
             bits (the suite's FP8_ACC_BITS rule);
- align B/G: in each group of G products (G = 8, 16 or 32) the accumulator and the products
             are aligned to the largest exponent among them and each addend cut toward zero
             to B bits below that exponent's leading bit, then summed exactly;
- suite B:   align B/32 with the sum cut to B bits as well (common.testing.mma_truncated,
             the suite's fp8 LSE baseline): on an H100 at B = 13 it matched all 166 rows.
"""

from __future__ import annotations

import argparse
import json

import torch

from flashsuite.common.testing import mma_truncated

D = 64
BIG = 256.0


def _rows() -> tuple[torch.Tensor, list[str]]:
    """(R, D) float32 rows of e4m3-exact values and a label each."""
    rows, labels = [], []

    def add(vals: dict[int, float], label: str) -> None:
        r = torch.zeros(D)
        for i, x in vals.items():
            r[i] = x
        rows.append(r)
        labels.append(label)

    for sign in (1.0, -1.0):
        for j in range(3, 10):
            small = 2.0**-j
            for name, idx in (
                ("same 8", range(1, 8)),
                ("next 8", range(8, 16)),
                ("other 16", range(16, 32)),
                ("next step", range(32, 63)),
            ):
                add({0: sign * BIG, **{i: small for i in idx}}, f"{sign * BIG:+g} at 0, "
                    f"{len(idx)} x 2^-{j} in {name}")  # fmt: skip
            add({31: sign * BIG, **{i: small for i in range(31)}}, f"{sign * BIG:+g} at 31, "
                f"31 x 2^-{j} before it")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for t in range(96):
        mag = torch.exp2(torch.randint(-9, 8, (D,), generator=gen).float())
        sign = torch.where(torch.rand(D, generator=gen) < 0.5, -1.0, 1.0)
        r = (mag * sign * (1 + torch.randint(0, 8, (D,), generator=gen) / 8)).to(
            torch.float8_e4m3fn
        )
        rows.append(r.float())
        labels.append(f"random {t}")
    return torch.stack(rows), labels


def _cut(x: torch.Tensor, ulp: torch.Tensor) -> torch.Tensor:
    return torch.trunc(x / ulp) * ulp


def model_sum(rows: torch.Tensor, bits: int) -> torch.Tensor:
    acc = torch.zeros(rows.shape[0], dtype=torch.float64)
    for k0 in range(0, D, 32):
        s = acc + rows[:, k0 : k0 + 32].double().sum(-1)
        _, e = torch.frexp(s.abs().clamp_min(1e-30))
        acc = _cut(s, torch.ldexp(torch.ones_like(s), e - 1 - bits))
    return acc


def model_align(rows: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    acc = torch.zeros(rows.shape[0], dtype=torch.float64)
    for k0 in range(0, D, group):
        terms = torch.cat([acc[:, None], rows[:, k0 : k0 + group].double()], dim=-1)
        _, e = torch.frexp(terms.abs().amax(-1, keepdim=True).clamp_min(1e-30))
        acc = _cut(terms, torch.ldexp(torch.ones_like(terms[:, :1]), e - 1 - bits)).sum(-1)
        acc = acc.float().double()
    return acc


def kernel_scores(rows: torch.Tensor) -> torch.Tensor:
    from flashsuite import dispatch

    r = rows.shape[0]
    q = rows.to(torch.float8_e4m3fn).reshape(1, r, 1, D).cuda()
    k = torch.ones(1, 1, 1, D).to(torch.float8_e4m3fn).cuda()
    v = torch.zeros(1, 1, 1, D).to(torch.float8_e4m3fn).cuda()
    _, lse = dispatch.attention(q, k, v, softmax_scale=1.0, return_lse=True, version="fa3")
    return lse[0, 0].double().cpu()  # (R,)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write the rows, the kernel's S and each model's error here")
    args = ap.parse_args(argv)
    rows, labels = _rows()
    assert torch.equal(rows.to(torch.float8_e4m3fn).float(), rows), "rows must be e4m3-exact"
    exact = rows.double().sum(-1)
    s = kernel_scores(rows)
    # float32 ulps of the log2-unit round trip, per row (half the smallest addend at |S| 256)
    tol = 32 * 2.0**-23 * s.abs().clamp_min(1.0)
    zeros, ones = torch.zeros(rows.shape[0], 1), torch.ones(D, 1)
    models = {f"sum {b}": model_sum(rows, b) for b in range(11, 17)}
    for b in range(11, 17):
        for g in (8, 16, 32):
            models[f"align {b}/{g}"] = model_align(rows, b, g)
        models[f"suite {b}"] = mma_truncated(zeros, rows, ones, b)[:, 0].double()
    print(f"{len(labels)} rows; kernel vs exact: max {(s - exact).abs().max():.4g}; "
          f"round-trip tolerance up to {tol.max():.2g}")  # fmt: skip
    ranked = sorted(models.items(), key=lambda kv: (kv[1] - s).abs().max().item())
    for name, pred in ranked:
        err = (pred - s).abs()
        bad = int((err > tol).sum())
        print(f"  {name:>12}: max |model - kernel| {err.max():.4g}, rows off {bad}/{len(labels)}")
    best = ranked[0][1]
    off = [(lab, s[i].item(), exact[i].item(), best[i].item())
           for i, lab in enumerate(labels) if abs(best[i] - s[i]) > tol[i]]  # fmt: skip
    for lab, ker, ex, pr in off[:12]:
        print(
            f"    off under {ranked[0][0]}: {lab}: kernel {ker:.6f} exact {ex:.6f} model {pr:.6f}"
        )
    for i in range(35):  # the crafted rows of +256: what the kernel kept of the small addends
        print(f"  {labels[i]:>44}: kernel - exact {s[i] - exact[i]:+.6f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"labels": labels, "kernel": s.tolist(), "exact": exact.tolist(),
                       "models": {n: p.tolist() for n, p in models.items()}}, f)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
