"""FP8 forward accuracy per scaling mode, with and without the Hadamard rotation of q and k,
against the float64 oracle and next to bf16 (CPU, a few minutes).

    python -m benchmarks.fp8_scaling_study [--out FILE.md] [--quick]

Inputs are bf16 q, k, v (what a model hands the fp8 path to quantise); the oracle is the
float64 attention of those values. Each fp8 column quantises them (common.fp8.quantize:
"tensor", "head" with q per kv head as fa3 takes it, "block" with 128 query rows and fa3's fp8
key tile per descale), optionally after rotating q and k by a Hadamard matrix
(common.hadamard.rotate), and runs the reference fp8 attention (common.fp8_reference:
P rounded to e4m3, bf16 out). The bf16 columns are PyTorch's bf16 attention (the suite's
yardstick, docs/testing.md: S, P and O rounded to bf16) and a bf16 flash kernel's numerics
(S and the row sums in float32, P rounded to bf16 for P·V, bf16 out).

Input kinds (`make_qkv`): "randn" (standard normal), "channels" (4 channels of each of q, k
and v, drawn per tensor, the same for every token and head, x20: LLM-style outlier
channels), "tokens" (4 keys x20 over the sequence, the suite's `spikes`), "sparse" (N(0, 1)
plus N(0, 100) on 0.1 % of the entries: the outlier model of the FlashAttention-3 paper's
error study). Errors relative to the oracle: max |out - ref| / max |ref| and
mean |out - ref| / mean |ref|.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from flashsuite.common.fp8 import quantize
from flashsuite.common.fp8_reference import attention_fp8, scores_capped_and_masked
from flashsuite.common.hadamard import rotate
from flashsuite.common.reference import attention_reference

KINDS = ("randn", "channels", "tokens", "sparse")
OUTLIERS, OUTLIER_FACTOR = 4, 20.0
SPARSE_P = 0.001  # "sparse": the share of entries that get N(0, 100) added
Q_BLOCK = 128  # query rows per descale in "block" mode: fa3's fp8 tile_m
# (B, Nq, Nk, Hq, Hkv, D, causal): the GPU sizes of tests/test_fp8.py (GQA, MQA, odd lengths,
# causal with Nq != Nk), D 64 / 128 / 256.
CASES = [
    (3, 1000, 1000, 6, 2, 64, False),
    (2, 777, 1031, 8, 2, 128, True),
    (2, 1031, 777, 4, 4, 128, False),
    (1, 513, 700, 8, 1, 256, True),
    (2, 600, 600, 4, 2, 256, False),
]
QUICK_CASES = [(1, 300, 333, 4, 2, 64, True), (1, 200, 190, 2, 1, 128, False)]
SCALINGS = [(mode, rot) for mode in ("tensor", "head", "block") for rot in (False, True)]


def kv_block(head_dim: int) -> int:
    """Keys per descale in "block" mode: fa3's fp8 key tile (fa3/configs.py FP8_CONFIGS)."""
    from flashsuite.fa3.configs import FP8_CONFIGS

    return FP8_CONFIGS[head_dim].tile_n


def outlier_channels(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """x (B, N, H, D) with OUTLIERS channels (the same for every token and head) x20."""
    idx = torch.randperm(x.shape[-1], generator=gen)[:OUTLIERS]
    x = x.clone()
    x[..., idx] *= OUTLIER_FACTOR
    return x


def _bernoulli(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(x.shape, generator=gen) < SPARSE_P).float()


def make_qkv(case: tuple, kind: str, seed: int = 0, dtype=torch.bfloat16):
    """q (B, Nq, Hq, D), k, v (B, Nk, Hkv, D) in `dtype` for one input kind (module docstring)."""
    b, nq, nk, hq, hkv, d = case[:6]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, hq, d, generator=gen)
    k = torch.randn(b, nk, hkv, d, generator=gen)
    v = torch.randn(b, nk, hkv, d, generator=gen)
    if kind == "channels":
        q, k, v = (outlier_channels(t, gen) for t in (q, k, v))
    elif kind == "tokens":
        k[:, torch.linspace(0, nk - 1, OUTLIERS).round().long()] *= OUTLIER_FACTOR
    elif kind == "sparse":
        q, k, v = (
            t + 10.0 * torch.randn(t.shape, generator=gen) * _bernoulli(t, gen) for t in (q, k, v)
        )
    elif kind != "randn":
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def fp8_forward(q, k, v, mode: str, rotated: bool, causal: bool) -> torch.Tensor:
    """bf16 out of the reference fp8 attention of q, k, v quantised in `mode`."""
    g = q.shape[2] // k.shape[2]
    xq, xk = (rotate(t) for t in (q, k)) if rotated else (q.float(), k.float())
    if mode == "block":
        bk = kv_block(q.shape[-1])
        q8 = quantize(xq, "block", block=Q_BLOCK)
        k8, v8 = quantize(xk, "block", block=bk), quantize(v.float(), "block", block=bk)
    else:
        q8 = quantize(xq, mode, group=g)
        k8, v8 = quantize(xk, mode), quantize(v.float(), mode)
    return attention_fp8(q8, k8, v8, causal=causal)


def bf16_flash(q, k, v, causal: bool) -> torch.Tensor:
    """A bf16 flash kernel's numerics: S, row max and sums in float32, P rounded to bf16 for
    P·V (float32 accumulation), bf16 out. (B, Nq, Hq, D)."""
    g = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)  # (B, Hq, Nq, D)
    kf = k.float().repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, D)
    vf = v.float().repeat_interleave(g, 2).transpose(1, 2)  # (B, Hq, Nk, D)
    s = scores_capped_and_masked(qf @ kf.mT / math.sqrt(q.shape[-1]), dict(causal=causal))
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)  # (B, Hq, Nq, 1)
    p = torch.exp(s - m)  # (B, Hq, Nq, Nk)
    out = p.bfloat16().float() @ vf / p.sum(-1, keepdim=True).clamp_min(1e-30)
    return out.transpose(1, 2).bfloat16()


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref| / max |ref|, mean |out - ref| / mean |ref|)."""
    err, mag = (out.double() - ref).abs(), ref.abs()
    return (err.max() / mag.max()).item(), (err.mean() / mag.mean()).item()


def study(cases: list, kinds=KINDS) -> list[dict]:
    rows = []
    for case in cases:
        causal = case[6]
        for kind in kinds:
            t0 = time.perf_counter()
            q, k, v = make_qkv(case, kind)
            ref = attention_reference(q, k, v, causal=causal, compute_dtype=torch.float64)[0]
            pt = attention_reference(q, k, v, causal=causal, compute_dtype=None)[0]
            row = dict(case=case, kind=kind)
            row["bf16 pytorch"] = errors(pt, ref)
            row["bf16 flash"] = errors(bf16_flash(q, k, v, causal), ref)
            for mode, rot in SCALINGS:
                out = fp8_forward(q, k, v, mode, rot, causal)
                row[mode + ("+H" if rot else "")] = errors(out, ref)
            rows.append(row)
            print(f"{case} {kind}: {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def _fmt(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.2g} / {pair[1]:.2g}"


def table(rows: list[dict]) -> str:
    cols = ["bf16 pytorch", "bf16 flash"] + [m + ("+H" if r else "") for m, r in SCALINGS]
    head = "| inputs | B, Nq, Nk, Hq, Hkv, D | causal | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (3 + len(cols))]
    for r in rows:
        b, nq, nk, hq, hkv, d, causal = r["case"]
        shape = f"{b}, {nq}, {nk}, {hq}, {hkv}, {d}"
        cells = " | ".join(_fmt(r[c]) for c in cols)
        lines.append(f"| {r['kind']} | {shape} | {'yes' if causal else 'no'} | {cells} |")
    lines.append("")
    lines.append("Geometric mean over the cases of (fp8 error / bf16 flash error), max / mean:")
    lines.append("")
    lines.append("| inputs | " + " | ".join(cols[2:]) + " |")
    lines.append("|" + "---|" * (1 + len(cols) - 2))
    for kind in dict.fromkeys(r["kind"] for r in rows):
        sub = [r for r in rows if r["kind"] == kind]
        cells = []
        for c in cols[2:]:
            gm = [
                math.exp(sum(math.log(r[c][i] / r["bf16 flash"][i]) for r in sub) / len(sub))
                for i in (0, 1)
            ]
            cells.append(f"{gm[0]:.1f} / {gm[1]:.1f}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--quick", action="store_true", help="two small cases (seconds)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    text = table(study(QUICK_CASES if args.quick else CASES))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
