"""Repeat fa3's backward with a launch mechanism (`--suffix`) against the shipped config
without it, on the GPU, looking for a read that runs ahead of what it depends on.

    python3 -m benchmarks.fa3_bwd_stress --suffix _pdl --repeats 50   # BwdConfig.pdl

`_pdl`: the main kernel may start while the preprocess still writes LSE, D and the zeroed dQ
accumulator, and the postprocess while the main kernel still adds dQ; each waits
(griddepcontrol.wait) before it reads them. A wait in the wrong place shows as a run whose
result differs from the plain build's: dK and dV are summed in registers in a fixed order,
so they must match bit for bit in every repeat; dQ is added by bulk reductions in whatever order
the column blocks arrive, so it must match within the spread of the plain build's own repeats
(a race on the accumulator or a lost row block gives errors of the size of dQ itself). Small
problems (N about 1k) run back to back, where the launches overlap the most and a CTA's last
row blocks are a large share of its work. Prints one line per case and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.fa3_bwd_check import _variant_backward
from benchmarks.fa3_bwd_variants import VARIANTS, variant
from flashsuite.common.testing import Case, make_grad_out, make_inputs

# (shipped variant, case): D = 128 non-causal / causal, D = 64.
CASES = (
    ("pipe80_wgs_wgdq_tma", Case(16, 1000, 1000, 16, 16, 128, dtype=torch.bfloat16)),
    ("pipe_sec4_wgdq_tma", Case(16, 1024, 1024, 16, 16, 128, dtype=torch.bfloat16, causal=True)),
    ("pipe128_dqm_tma", Case(16, 1024, 1024, 32, 32, 64, dtype=torch.bfloat16)),
)


def stress(name: str, suffix: str, case: Case, repeats: int) -> bool:
    """Run `name` and `name + suffix` `repeats` times each, interleaved; True when every run of
    the second matches (see the module docstring)."""
    q, k, v = make_inputs(case, "cuda")
    dout = make_grad_out(case, "cuda")
    plain, _ = _variant_backward(case, variant(name), q, k, v, dout)
    other, _ = _variant_backward(case, variant(name + suffix), q, k, v, dout)
    dq0, dk0, dv0 = (t.clone() for t in plain())
    spread, worst, bad_kv = 0.0, 0.0, 0
    for _ in range(repeats):
        dq_p, _, _ = plain()
        spread = max(spread, (dq_p.float() - dq0.float()).abs().max().item())
        dq, dk, dv = other()
        worst = max(worst, (dq.float() - dq0.float()).abs().max().item())
        bad_kv += int(not (torch.equal(dk, dk0) and torch.equal(dv, dv0)))
    torch.cuda.synchronize()
    scale = dq0.float().abs().max().item()
    ok = bad_kv == 0 and worst <= max(2 * spread, 1e-3 * scale)
    print(
        f"{name}{suffix} {case.id}: {repeats} repeats, dK/dV mismatches {bad_kv}, max |dQ - "
        f"plain| {worst:.3g} (plain's own spread {spread:.3g}, max |dQ| {scale:.3g}) "
        f"{'ok' if ok else 'MISMATCH'}",
        flush=True,
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--suffix", default="_pdl", help="variant name suffix: _pdl")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: expected >= 1, got {args.repeats}")
    missing = [n + args.suffix for n, _ in CASES if n + args.suffix not in VARIANTS]
    if missing:
        ap.error(f"--suffix: no variants {missing} in benchmarks/fa3_bwd_variants.py")
    results = [stress(name, args.suffix, case, args.repeats) for name, case in CASES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
