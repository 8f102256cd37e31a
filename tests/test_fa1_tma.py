"""fa1's sm90 path (TMA descriptors, one or two K/V halves per block) against the oracle.

The shared suite runs the table's entry for the machine: the pointer path under the CPU
interpreter, the TMA entry on an H200. These cases force the TMA configurations on the CPU too
(the interpreter emulates host descriptors: zero-filled tails, clipped stores), so the halves,
the four compile-time loop ranges and the GQA / causal / odd-size bounds are checked in CI.
"""

from __future__ import annotations

import pytest
import torch

from flashsuite.common.testing import Case, compare, make_inputs, reference_pair
from flashsuite.common.validation import check_inputs
from flashsuite.fa1 import interface
from flashsuite.fa1.configs import Fa1Config

from .conftest import DEVICE

BF16, F16 = torch.bfloat16, torch.float16

# (case, config): small tiles keep the interpreter fast while every tile count stays > 1.
CASES = [
    (Case(1, 100, 77, 2, 1, 64, dtype=BF16), Fa1Config(32, 64, 4, 1, use_tma=True, split_kv=True)),
    (Case(2, 70, 130, 4, 2, 96, dtype=F16, causal=True), Fa1Config(32, 64, 4, 2, True, True)),
    (Case(1, 130, 60, 2, 2, 32, dtype=BF16, causal=True), Fa1Config(64, 32, 4, 1, use_tma=True)),
    (Case(1, 200, 333, 2, 1, 64, dtype=BF16, causal=True), Fa1Config(32, 64, 4, 2, True, True)),
    (Case(1, 333, 200, 2, 1, 64, dtype=F16, causal=True), Fa1Config(64, 32, 4, 2, use_tma=True)),
    (Case(2, 64, 256, 2, 1, 16, dtype=BF16, causal=True), Fa1Config(16, 64, 4, 2, True, True)),
]


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter check of the TMA path (the GPU runs "
                    "it through the shared suite, where it is the table's entry)")  # fmt: skip
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize(("case", "cfg"), CASES, ids=[c.id for c, _ in CASES])
def test_tma_path_matches_oracle(case: Case, cfg: Fa1Config, splits: int) -> None:
    q, k, v = make_inputs(case, DEVICE)
    p = check_inputs(q, k, v, **case.options())
    out, lse = interface.forward(q, k, v, p, cfg=cfg, splits=splits)
    ref = reference_pair(q, k, v, **case.options())
    for name, ours in (("out", out), ("lse", lse)):
        res = compare(name, ours, *ref[name])
        assert res.ok, f"{case.id} {cfg} splits={splits}: {res}"


@pytest.mark.skipif(
    DEVICE != "cuda" or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm90 GPU"
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tma_entry_launch_spills_are_pinned(head_dim: int, causal: bool) -> None:
    """The shipped sm90 entry compiles for a real launch with at most the spill measured on
    the H200 (configs.TMA_STACK_BYTES; it is the fastest tile there, spill included). Triton's
    n_spills counts 4-byte words of local memory."""
    from flashsuite.fa1.configs import TMA_STACK_BYTES, fwd_config

    # The standard-sweep shape the pins (and benchmarks/fa1_probe.py's launch_probe) were taken
    # at: the frame depends on the launch's integer specialisation (e.g. one Q block per program).
    case = Case(8, 2048, 2048, 2048 // head_dim, 2048 // head_dim, head_dim, dtype=BF16)
    q, k, v = make_inputs(case, DEVICE)
    p = check_inputs(q, k, v, causal=causal)
    cfg = fwd_config(head_dim, BF16, 90, causal)
    assert cfg.use_tma
    _, _, kern = interface._forward(q, k, v, p, None, None)
    assert kern.n_spills * 4 <= TMA_STACK_BYTES[(head_dim, causal)], (cfg, kern.n_spills)


def test_tma_alignment_check() -> None:
    """Descriptors only for 16-byte aligned, positive outer strides; the rest takes pointers."""
    q = torch.zeros(2, 8, 4, 64, dtype=BF16)
    assert interface._tma_ok(q)
    assert interface._tma_ok(q.transpose(1, 2))  # any order of aligned strides
    assert not interface._tma_ok(torch.zeros(2, 8, 4, 4, dtype=BF16))  # 8-byte rows
    assert not interface._tma_ok(torch.zeros(2, 8, 1, 64, dtype=BF16).expand(2, 8, 4, 64))
    assert not interface._tma_ok(torch.zeros(2 * 8 * 4 * 64 + 1, dtype=BF16)[1:].view(2, 8, 4, 64))


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter check of the fallback")
def test_unaligned_inputs_fall_back_to_pointers() -> None:
    """A TMA config on tensors TMA cannot describe (4-wide heads: 8-byte rows) still computes
    the right answer, through the pointer kernel with the block's halves as one tile."""
    case = Case(1, 40, 70, 2, 1, 4, dtype=F16, causal=True)
    q, k, v = make_inputs(case, DEVICE)
    assert not interface._tma_ok(q)
    p = check_inputs(q, k, v, **case.options())
    out, lse = interface.forward(q, k, v, p, cfg=Fa1Config(16, 64, 4, 1, True, True))
    ref = reference_pair(q, k, v, **case.options())
    for name, ours in (("out", out), ("lse", lse)):
        res = compare(name, ours, *ref[name])
        assert res.ok, res
