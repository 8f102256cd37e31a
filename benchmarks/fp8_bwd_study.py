"""FP8 backward error study: which of the five backward GEMMs can take fp8 operands while the
gradients stay within 2x the bf16 backward's error (CPU, minutes).

    python -m benchmarks.fp8_bwd_study [--out FILE.md] [--quick] [--acc-bits 23 13]

The backward of a flash kernel, emulated tile by tile on bf16 q, k, v, dO, with O and the LSE
from the forward (the float64 oracle's O rounded to bf16, its LSE in float32), is five GEMMs:

    S  = Q Kᵀ        (recompute; P = exp(S·scale - LSE))    operands Q, K     e4m3, e4m3
    dP = dO Vᵀ                                              operands dO, V    e5m2, e4m3
    dV = Pᵀ dO       (reduced over query blocks)            operands P, dO    e4m3, e5m2
    dK = dSᵀ Q·scale (reduced over query blocks)            operands dS, Q    e5m2, e4m3
    dQ = dS K·scale  (reduced over key blocks)              operands dS, K    e5m2, e4m3

with dS = P ∘ (dP - Δ), Δ = rowsum(dO ∘ O). A GEMM in fp8 sees its operands quantised with
per-block scales (common.fp8.quantize, "block" mode): Q and dO per BLOCK_M query rows, K and V
per BLOCK_N keys, P and dS per (BLOCK_M x BLOCK_N) tile, each per (batch, head); forward-type
operands in e4m3, gradients (dO, dS) in e5m2. Products of a reduction that crosses blocks are
scaled per block and summed in float32 (a kernel applies the scales between wgmmas, as the
forward rescales O between key blocks). `acc_bits` < 23 also accumulates every k = 32 step
within a block with that many bits (common.testing.mma_truncated; 13 models the
reduced-precision accumulation of Hopper's fp8 wgmma, the LSE check's FP8_ACC_BITS).

The bf16 backward is the same emulation with every GEMM on bf16 operands (P and dS rounded to
bf16, float32 accumulation), the numerics of fa3's and fa2's backward. dq, dk, dv are delivered
in bf16 by both. Errors are relative to the float64 oracle's gradients: max |g - ref| / max |ref|
and mean |g - ref| / mean |ref|; a subset "fits" when on every case, input kind and gradient
both are within 2x the bf16 backward's.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from benchmarks.fp8_scaling_study import make_qkv
from flashsuite.common.fp8 import E4M3, E5M2, FP8_MAX, quantize
from flashsuite.common.reference import attention_reference, visibility_mask
from flashsuite.common.testing import mma_truncated

GEMMS = ("S", "dP", "dV", "dK", "dQ")
# Each GEMM alone, then the combinations an FA3-style fp8 backward would use: the two score
# recomputations (operands straight from memory, quantised once like the fp8 forward's), the two
# key-side accumulations (P and dS quantised in registers), the three gradient GEMMs, all but
# dP (the choice of SageAttention's 8-bit backward, which keeps dO Vᵀ in 16 bits), all five.
SUBSETS = [
    ("S",),
    ("dP",),
    ("dV",),
    ("dK",),
    ("dQ",),
    ("S", "dP"),
    ("dV", "dK"),
    ("dV", "dK", "dQ"),
    ("S", "dV", "dK", "dQ"),
    GEMMS,
]
# S in fp8 with P normalised by the bf16 forward's LSE instead of its own (a bf16 forward
# followed by an fp8 recomputation).
S_BF16_LSE = "S, bf16 forward's LSE"
BLOCK_M, BLOCK_N = 128, 128  # query rows, keys per scale block (fa3's backward: 64-128 x 128)
KINDS = ("randn", "channels")
# (B, Nq, Nk, Hq, Hkv, D, causal): tests/test_attention.py's backward cases at D 64 / 256
# (causal with Nq < Nk, MQA, GQA, odd lengths) and tests/test_fp8.py's GPU sizes.
CASES = [
    (2, 128, 128, 2, 2, 64, False),
    (2, 128, 128, 2, 2, 64, True),
    (1, 113, 113, 2, 2, 64, False),
    (1, 77, 100, 2, 2, 64, True),
    (1, 65, 70, 4, 1, 64, True),
    (1, 40, 48, 1, 1, 256, False),
    (3, 1000, 1000, 6, 2, 64, False),
    (2, 777, 1031, 8, 2, 128, True),
    (2, 1031, 777, 4, 4, 128, False),
    (1, 513, 700, 8, 1, 256, True),
    (2, 600, 600, 4, 2, 256, False),
]
QUICK_CASES = [(1, 200, 260, 4, 2, 64, True), (1, 150, 150, 2, 2, 128, False)]


def quantize_tiles(x: torch.Tensor, bm: int, bn: int, dtype: torch.dtype) -> torch.Tensor:
    """x (B, H, M, N) float32 -> the values an fp8 GEMM sees with one scale per (bm x bn) tile
    (amax / fp8_max, 1 for an all-zero tile), float32 (B, H, M, N)."""
    b, h, m, n = x.shape
    mt, nt = math.ceil(m / bm), math.ceil(n / bn)
    padded = torch.nn.functional.pad(x, (0, nt * bn - n, 0, mt * bm - m))
    tiles = padded.reshape(b, h, mt, bm, nt, bn)
    amax = tiles.abs().amax(dim=(3, 5), keepdim=True)  # (B, H, mt, 1, nt, 1)
    ds = torch.where(amax > 0, amax / FP8_MAX[dtype], torch.ones_like(amax))
    fmax = FP8_MAX[dtype]
    deq = (tiles / ds).clamp(-fmax, fmax).to(dtype).float() * ds
    return deq.reshape(b, h, mt * bm, nt * bn)[..., :m, :n]


def gemm(a: torch.Tensor, b: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N) in float32; with bits < 23 the accumulator is cut to `bits`
    mantissa bits every k = 32 step inside each `block` of K, blocks summed in float32."""
    if bits >= 23:
        return a @ b
    out = torch.zeros(*a.shape[:-1], b.shape[-1])
    for k0 in range(0, a.shape[-1], block):
        blk = mma_truncated(
            torch.zeros_like(out), a[..., k0 : k0 + block], b[..., k0 : k0 + block, :], bits
        )
        out = out + blk
    return out


def _heads_first(x: torch.Tensor, g: int = 1) -> torch.Tensor:
    """(B, N, H, D) -> float32 (B, H·g, N, D), each head repeated g times (GQA expansion)."""
    return x.float().repeat_interleave(g, dim=2).transpose(1, 2)


def backward(
    q, k, v, do, out, lse, *, causal: bool, fp8=(), acc_bits: int = 23, lse_of_s: bool = True
):
    """(dq, dk, dv) in bf16, API layout, of the tile emulation with the GEMMs in `fp8` on fp8
    operands (module docstring) and the others on bf16 ones.

    With S in fp8 and `lse_of_s`, P is normalised by the LSE of the fp8 scores themselves (what
    an fp8 forward on the same quantised q, k saves); otherwise by `lse`, the bf16 forward's."""
    b, nq, hq, d = q.shape
    g = hq // k.shape[2]
    scale = d**-0.5
    fp8 = frozenset(fp8)
    bits = {name: acc_bits if name in fp8 else 23 for name in GEMMS}

    def operand(x, gemm_names, dtype, block, group=1):
        """x's values as GEMMs `gemm_names` see them (all fp8 or all bf16 by construction)."""
        if not fp8 & set(gemm_names):
            return _heads_first(x, group)
        deq = quantize(x.float(), "block", block=block, dtype=dtype).dequantize()
        return _heads_first(deq, group)

    qs, qk_ = operand(q, ("S",), E4M3, BLOCK_M), operand(q, ("dK",), E4M3, BLOCK_M)
    ks, kq = operand(k, ("S",), E4M3, BLOCK_N, g), operand(k, ("dQ",), E4M3, BLOCK_N, g)
    vp = operand(v, ("dP",), E4M3, BLOCK_N, g)
    dop, dov = operand(do, ("dP",), E5M2, BLOCK_M), operand(do, ("dV",), E5M2, BLOCK_M)
    visible = visibility_mask(nq, k.shape[1], causal=causal)  # (Nq, Nk)
    s = gemm(qs, ks.mT, d, bits["S"])  # (B, Hq, Nq, Nk)
    lse_ = lse[..., None].float()  # (B, Hq, Nq, 1)
    if "S" in fp8 and lse_of_s:
        masked = (s * scale).masked_fill(~visible, -math.inf)
        lse_ = torch.logsumexp(masked, dim=-1, keepdim=True)  # (B, Hq, Nq, 1)
    p = torch.where(visible & torch.isfinite(lse_), torch.exp(s * scale - lse_), 0.0)
    dp = gemm(dop, vp.mT, v.shape[-1], bits["dP"])  # (B, Hq, Nq, Nk)
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2)[..., None]  # (B, Hq, Nq, 1)
    ds = p * (dp - delta)  # (B, Hq, Nq, Nk)
    p_v = quantize_tiles(p, BLOCK_M, BLOCK_N, E4M3) if "dV" in fp8 else p.bfloat16().float()
    ds_k = quantize_tiles(ds, BLOCK_M, BLOCK_N, E5M2) if "dK" in fp8 else ds.bfloat16().float()
    ds_q = quantize_tiles(ds, BLOCK_M, BLOCK_N, E5M2) if "dQ" in fp8 else ds.bfloat16().float()
    dv = gemm(p_v.mT, dov, BLOCK_M, bits["dV"])  # (B, Hq, Nk, Dv)
    dk = gemm(ds_k.mT, qk_, BLOCK_M, bits["dK"]) * scale  # (B, Hq, Nk, D)
    dq = gemm(ds_q, kq, BLOCK_N, bits["dQ"]) * scale  # (B, Hq, Nq, D)
    hkv, nk = k.shape[2], k.shape[1]
    dk = dk.reshape(b, hkv, g, nk, d).sum(2)  # (B, Hkv, Nk, D): the group's heads added
    dv = dv.reshape(b, hkv, g, nk, v.shape[-1]).sum(2)
    return tuple(t.transpose(1, 2).bfloat16() for t in (dq, dk, dv))


def oracle(q, k, v, do, causal: bool):
    """Float64 gradients, the forward's bf16 O and float32 LSE, PyTorch's bf16 gradients."""
    grads = {}
    for tag, dtype in (("ref", torch.float64), ("pt", None)):
        qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        o, lse = attention_reference(qs, ks, vs, causal=causal, compute_dtype=dtype)
        grads[tag] = torch.autograd.grad(o, (qs, ks, vs), do.to(o.dtype))
        if tag == "ref":
            fwd = (o.detach().bfloat16(), lse.detach().float())
    return grads["ref"], grads["pt"], fwd


def rel_errors(g: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |g - ref| / max |ref|, mean |g - ref| / mean |ref|)."""
    err, mag = (g.double() - ref).abs(), ref.abs()
    return (err.max() / mag.max()).item(), (err.mean() / mag.mean()).item()


def study(cases: list, acc_bits: int, kinds=KINDS) -> list[dict]:
    rows = []
    for case in cases:
        causal = case[6]
        for kind in kinds:
            t0 = time.perf_counter()
            q, k, v = make_qkv(case, kind)
            gen = torch.Generator().manual_seed(1)
            do = torch.randn(q.shape, generator=gen).bfloat16()
            ref, pt, (out, lse) = oracle(q, k, v, do, causal)
            row = dict(case=case, kind=kind, acc_bits=acc_bits, errors={})
            row["errors"]["bf16 pytorch"] = [rel_errors(a, r) for a, r in zip(pt, ref, strict=True)]
            variants = [("+".join(x), x, True) for x in SUBSETS]
            for name, subset, lse_of_s in [
                ("bf16", (), True),
                *variants,
                (S_BF16_LSE, ("S",), False),
            ]:
                grads = backward(
                    q, k, v, do, out, lse, causal=causal, fp8=subset, acc_bits=acc_bits,
                    lse_of_s=lse_of_s,
                )  # fmt: skip
                row["errors"][name] = [rel_errors(a, r) for a, r in zip(grads, ref, strict=True)]
            rows.append(row)
            print(
                f"acc_bits {acc_bits} {case} {kind}: {time.perf_counter() - t0:.1f} s", flush=True
            )
    return rows


def _ratios(row: dict, name: str) -> list[tuple[float, float]]:
    """(max ratio, mean ratio) of dq, dk, dv against the bf16 backward."""
    base = row["errors"]["bf16"]
    return [(e[0] / b[0], e[1] / b[1]) for e, b in zip(row["errors"][name], base, strict=True)]


def summary(rows: list[dict]) -> str:
    """Per subset: the worst ratio to the bf16 backward over cases and kinds, per gradient."""
    names = ["+".join(s) for s in SUBSETS] + [S_BF16_LSE]
    lines = [
        "| fp8 GEMMs | dq max / mean | dk max / mean | dv max / mean | within 2x |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        worst = [[0.0, 0.0] for _ in range(3)]
        for r in rows:
            for i, (mx, mn) in enumerate(_ratios(r, name)):
                worst[i] = [max(worst[i][0], mx), max(worst[i][1], mn)]
        ok = all(w <= 2.0 for pair in worst for w in pair)
        cells = " | ".join(f"{w[0]:.3g}x / {w[1]:.3g}x" for w in worst)
        lines.append(f"| {name} | {cells} | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def bf16_errors(rows: list[dict]) -> str:
    """The range over cases of the bf16 backward's and PyTorch's bf16 relative errors."""
    lines = ["| backward | inputs | dq max / mean | dk max / mean | dv max / mean |"]
    lines.append("|---|---|---|---|---|")
    for name in ("bf16", "bf16 pytorch"):
        for kind in KINDS:
            errs = [r["errors"][name] for r in rows if r["kind"] == kind]
            cells = []
            for i in range(3):
                mx, mn = [e[i][0] for e in errs], [e[i][1] for e in errs]
                cells.append(f"{min(mx):.2g}-{max(mx):.2g} / {min(mn):.2g}-{max(mn):.2g}")
            lines.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail(rows: list[dict]) -> str:
    """Every case: the errors of the bf16 backward, PyTorch's bf16 autograd and each subset."""
    names = ["bf16", "bf16 pytorch"] + ["+".join(s) for s in SUBSETS] + [S_BF16_LSE]
    lines = []
    for r in rows:
        b, nq, nk, hq, hkv, d, causal = r["case"]
        lines += [
            "",
            f"{r['kind']}, B {b}, Nq {nq}, Nk {nk}, Hq {hq}, Hkv {hkv}, D {d}"
            + (", causal" if causal else "")
            + f", acc_bits {r['acc_bits']} (relative errors, max / mean):",
            "",
            "| backward | dq | dk | dv |",
            "|---|---|---|---|",
        ]
        for name in names:
            cells = " | ".join(f"{mx:.2g} / {mn:.2g}" for mx, mn in r["errors"][name])
            lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the summary and every case's table here (markdown)")
    parser.add_argument("--json", help="write the raw errors here")
    parser.add_argument("--quick", action="store_true", help="two small cases (seconds)")
    parser.add_argument("--acc-bits", type=int, nargs="+", default=[23, 13])
    args = parser.parse_args()
    cases = QUICK_CASES if args.quick else CASES
    parts, all_rows = [], []
    for bits in args.acc_bits:
        rows = study(cases, bits)
        all_rows += rows
        for kind in KINDS:
            sub = [r for r in rows if r["kind"] == kind]
            head = f"acc_bits {bits}, {kind} inputs: worst ratio to the bf16 backward's error"
            parts.append(f"{head}\n\n{summary(sub)}")
        parts.append(f"bf16 backward's own errors (acc_bits {bits}):\n\n{bf16_errors(rows)}")
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n" + detail(all_rows) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)


if __name__ == "__main__":
    main()
