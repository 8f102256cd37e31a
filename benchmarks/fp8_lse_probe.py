"""How far fa3's fp8 LSE is from the float64 oracle, next to emulations of the fp8 wgmma's
reduced-precision accumulation, on tests/test_fp8.py's cases (a GPU run; the emulations run on
the same device).

    python3 -m benchmarks.fp8_lse_probe --json OUT.json

Two accumulator models, each at several mantissa widths:
- "sum": common.testing.mma_truncated, the suite's FP8_ACC_BITS rule (addends aligned and
  cut as in "align", then the step's sum cut to `bits` bits: benchmarks/fp8_acc_probe.py);
- "align": in every k = 32 step the accumulator and the 32 exact products are aligned to the
  largest exponent among them and each is cut (toward zero) to `bits` bits below it, then
  summed exactly: a model of a tensor core that adds fixed-point addends of one alignment.
One line per (case, model, bits): max and mean |lse - oracle| of the emulation, and the
kernel's, so the rule's baseline can be checked against what the hardware does.
"""

from __future__ import annotations

import argparse
import json

import torch

from flashsuite.common.fp8_reference import scores_capped_and_masked
from flashsuite.common.testing import FP8_MMA_K, mma_truncated


def _aligned(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int) -> torch.Tensor:
    """acc + a @ b in k = FP8_MMA_K steps, each step's addends aligned to their largest
    exponent and truncated to `bits` bits below it (float64 sums of exact products)."""
    acc = acc.double()
    a, b = a.double(), b.double()
    for k0 in range(0, a.shape[-1], FP8_MMA_K):
        prods = a[..., :, None, k0 : k0 + FP8_MMA_K] * b[..., None, :, k0 : k0 + FP8_MMA_K]
        terms = torch.cat([acc[..., None], prods], dim=-1)  # (..., M, N, 1 + K)
        _, exp = torch.frexp(terms.abs().amax(-1, keepdim=True))
        ulp = torch.ldexp(torch.ones_like(terms[..., :1]), exp - bits)
        acc = (torch.trunc(terms / ulp) * ulp).sum(-1).float().double()
    return acc.float()


def emulated_lse(q8, k8, ds, model: str, bits: int, causal: bool) -> torch.Tensor:
    b, nq, hq, d = q8.shape
    g = hq // k8.shape[2]
    qf = q8.float().transpose(1, 2)
    kf = k8.float().repeat_interleave(g, 2).transpose(1, 2)
    out = []
    for h in range(hq):  # one head at a time: the aligned model holds (Nq, Nk, 33) float64
        qh, kh = qf[:, h : h + 1], kf[:, h : h + 1]
        zero = torch.zeros(b, 1, nq, kh.shape[2], device=q8.device)
        if model == "sum":
            s = mma_truncated(zero, qh, kh.transpose(-1, -2), bits)
        else:
            s = torch.cat([_aligned(zero[i], qh[i], kh[i], bits)[None] for i in range(b)])
        out.append(s)
    s = torch.cat(out, dim=1).double()
    descale = (ds[0] * ds[1]).repeat_interleave(g, 1)[:, :, None, None].double()
    s = scores_capped_and_masked(s * descale * d**-0.5, {"causal": causal})
    return torch.logsumexp(s, dim=-1).float()


def main(argv: list[str] | None = None) -> int:
    from flashsuite import dispatch
    from flashsuite.common.testing import reference_pair
    from tests.test_fp8 import FP8_CASES, _fp8_inputs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    dev = "cuda"
    rows = []
    for b, nq, nk, hq, hkv, d, causal, _ in FP8_CASES:
        cid = f"b{b}-q{nq}-k{nk}-h{hq}-{hkv}-d{d}" + ("-causal" if causal else "")
        q8, k8, v8, ds = _fp8_inputs(b, nq, nk, hq, hkv, d, dev)
        kw = dict(descale_q=ds[0], descale_k=ds[1], descale_v=ds[2])
        _, lse = dispatch.attention(q8, k8, v8, causal=causal, return_lse=True, version="fa3", **kw)
        ref = reference_pair(q8, k8, v8, causal=causal, **kw)["lse"][0].double()
        fin = torch.isfinite(ref)

        def errs(x: torch.Tensor, ref=ref, fin=fin) -> tuple[float, float]:
            e = (x.double() - ref)[fin].abs()
            return e.max().item(), e.mean().item()

        kmax, kmean = errs(lse)
        print(f"{cid:34s} kernel            max {kmax:.3g} mean {kmean:.3g}", flush=True)
        rows.append({"case": cid, "model": "kernel", "bits": None, "max": kmax, "mean": kmean})
        for model, widths in (("sum", (11, 12, 13, 14, 23)), ("align", (12, 13, 14, 15))):
            for bits in widths:
                emax, emean = errs(emulated_lse(q8, k8, ds, model, bits, causal))
                print(
                    f"{cid:34s} {model:5s} bits {bits:2d}     max {emax:.3g} mean {emean:.3g}"
                    f"  kernel/emulation max {kmax / emax:.2f} mean {kmean / emean:.2f}",
                    flush=True,
                )
                rows.append({"case": cid, "model": model, "bits": bits, "max": emax,
                             "mean": emean})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
