"""fa2's split dK/dV backward (BwdConfig.split_dkdv: a dV launch, then a dK launch) against
the oracle and against the one-launch kernel.

No table entry ships it (it exists for D = 192/256, where one launch holding both fp32
accumulators spills on every wgmma tile but one non-causal 16-query tile), so the shared suite
does not reach it: these cases
force it, on the CPU under the interpreter with small tiles, on an sm90 GPU with the tiles the
compile probe found spill-free (benchmarks/fa2_tune.py QUICK_BWD_CANDIDATES).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashsuite.common.testing import Case, compare, make_grad_out, make_inputs, reference_pair
from flashsuite.common.validation import check_inputs
from flashsuite.fa2 import interface
from flashsuite.fa2.configs import BwdConfig

from .conftest import DEVICE

BF16, F16 = torch.bfloat16, torch.float16
ON_GPU = DEVICE == "cuda"

CASES = [
    Case(1, 100, 77, 2, 1, 64, dtype=BF16),
    Case(2, 70, 130, 4, 2, 96, dtype=F16, causal=True),
    Case(1, 130, 60, 2, 2, 32, dtype=BF16, causal=True),
    Case(1, 96, 96, 2, 1, 64, dtype=F16, window_size=(20, 8), softcap=5.0),
    Case(1, 64, 80, 2, 2, 64, head_dim_v=32, dtype=BF16),
]
if ON_GPU:
    CASES += [
        Case(2, 1000, 1000, 4, 2, 256, dtype=BF16),
        Case(1, 777, 1031, 4, 4, 256, dtype=BF16, causal=True),
        Case(1, 512, 512, 2, 1, 192, dtype=F16, causal=True),
    ]


def _configs(case: Case) -> list[BwdConfig]:
    if not ON_GPU:
        # Interpreter: small tiles, so every stage (diagonal, full, tail) has several blocks.
        return [BwdConfig(32, 32, 32, 32, 4, 1, 4, 1, split_dkdv=True)]
    from benchmarks.fa2_tune import QUICK_BWD_CANDIDATES

    d = max(case.head_dim, case.dv)
    key = (256 if d > 128 else d, case.causal)
    found = [c for c in QUICK_BWD_CANDIDATES.get(key, []) if c.split_dkdv]
    return found or [BwdConfig(32, 64, 64, 32, 4, 2, 4, 2, split_dkdv=True)]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_split_dkdv_matches_oracle_and_one_launch(case: Case) -> None:
    q, k, v = make_inputs(case, DEVICE)
    p = check_inputs(q, k, v, **case.options())
    dout = make_grad_out(case, DEVICE)
    out, lse = interface.forward(q, k, v, p)
    ref = reference_pair(q, k, v, grad_out=dout, **case.options())
    for cfg in _configs(case):
        dq, dk, dv = interface.backward(dout, q, k, v, out, lse, p, config=cfg)
        for name, got in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            res = compare(name, got, *ref[name])
            assert res.ok, f"{case.id} {cfg}: {res}"
        if not ON_GPU:
            # The same tiles in one launch accumulate the same products in the same order:
            # bitwise equal under the interpreter (compiled code may order wgmma differently).
            one_cfg = replace(cfg, split_dkdv=False)
            one = interface.backward(dout, q, k, v, out, lse, p, config=one_cfg)
            for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), one, strict=True):
                assert torch.equal(a, b), f"{case.id}: split {name} differs from one launch"
