"""Tiles from a global counter (`Fa3Config.tile_counter`): the persistent CTAs take their next
tile with an atomic add instead of walking static rounds (fa3/kernels.py, "Tile counter").

On the CPU: the refusal on the plain grid, and the host's counters (one zeroed int32 pair per
device and stream, refused inside CUDA-graph capture). The builds compile for sm_90a with the
atomic add issued before the tile's loads and 0 spills (`pytest -m lab
tests/test_fa3_compile.py -k tile-counter`). On a GPU: the same bits as the static order (the
order only decides which CTA runs a tile), call after call (the last CTA leaves the counters
at zero for the next launch), on two streams, and the float64 oracle.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashsuite.fa3.configs import Fa3Config, can_implement


def test_tile_counter_needs_the_persistent_scheduler() -> None:
    ok, why = can_implement(Fa3Config(tile_counter=True), 128, torch.bfloat16)
    assert not ok and "tile_counter" in why and "persistent" in why, why
    assert can_implement(Fa3Config(persistent=True, tile_counter=True), 128, torch.bfloat16)[0]


def test_counters_are_zeroed_per_device_and_stream(monkeypatch) -> None:
    """One int32 pair per (device, stream), zero when made; the same pair on the next call."""
    from flashsuite.fa3 import interface

    made = []

    class Stream:
        def __init__(self, handle: int) -> None:
            self.cuda_stream = handle

    streams = iter([Stream(1), Stream(1), Stream(2)])
    monkeypatch.setattr(interface, "_counters", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: next(streams))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def zeros(*shape, dtype=None, device=None):
        made.append((shape, dtype))
        return torch.full(shape, 0, dtype=dtype)

    monkeypatch.setattr(torch, "zeros", zeros)
    dev = torch.device("cpu")
    a, b, c = (interface._tile_counters(dev) for _ in range(3))
    assert a is b and a is not c
    assert made == [((2,), torch.int32)] * 2
    assert a.tolist() == [0, 0]


def test_counters_are_not_made_inside_graph_capture(monkeypatch) -> None:
    from flashsuite.fa3 import interface

    class Stream:
        cuda_stream = 7

    monkeypatch.setattr(interface, "_counters", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        interface._tile_counters(torch.device("cpu"))


_CASES = [
    pytest.param(128, True, {}, id="D128-causal"),
    pytest.param(256, True, {}, id="D256-causal-o-on-q"),
    pytest.param(64, True, {}, id="D64-causal-3-wgs"),
    pytest.param(128, False, {}, id="D128-q-in-registers"),
    pytest.param(128, True, {"l2_section_mib": 1}, id="D128-causal-one-pair-a-section"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "causal", "changes"), _CASES)
def test_gpu_tile_counter_gives_the_static_order_bits(d: int, causal: bool, changes) -> None:
    """B 4 x 1500 queries x 1100 keys, GQA 16 / 4 (the test_fa3_q_stages problem: about six
    tiles a CTA, causal rows without a key): the counter's order against the static one, on
    each table entry's persistent build; three calls in a row (each launch must find the
    counters at zero) and the float64 oracle."""
    from flashsuite.common.testing import compare, reference_pair
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import config_for
    from tests.test_fa3_q_stages import _V2, _gpu_problem

    q, k, v, p, opts = _gpu_problem(d, torch.bfloat16, causal, 11)
    base = config_for(p)
    if not base.persistent:
        base = dataclasses.replace(base, **_V2)
    base = dataclasses.replace(base, **changes)
    out, lse = interface.forward(q, k, v, p, cfg=base)
    counted = dataclasses.replace(base, tile_counter=True)
    for _ in range(3):
        out_c, lse_c = interface.forward(q, k, v, p, cfg=counted)
        assert torch.equal(out, out_c), (out.float() - out_c.float()).abs().max()
        assert torch.equal(lse, lse_c), (lse - lse_c).abs().nan_to_num().max()
    assert interface._tile_counters(q.device).tolist() == [0, 0]
    refs = reference_pair(q, k, v, **opts)
    for res in (compare("out", out_c, *refs["out"]), compare("lse", lse_c, *refs["lse"])):
        assert res.ok, res


@pytest.mark.gpu
def test_gpu_tile_counter_on_two_streams_at_once() -> None:
    """Two launches that may overlap (two streams, no ordering between them) each have their
    own counters: both give the static order's bits."""
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import config_for
    from tests.test_fa3_q_stages import _gpu_problem

    q, k, v, p, _ = _gpu_problem(128, torch.bfloat16, True, 12)
    base = config_for(p)
    out, lse = interface.forward(q, k, v, p, cfg=base)
    counted = dataclasses.replace(base, tile_counter=True)
    streams = [torch.cuda.Stream() for _ in range(2)]
    results = []
    torch.cuda.synchronize()
    for s in streams:
        with torch.cuda.stream(s):
            results += [interface.forward(q, k, v, p, cfg=counted) for _ in range(2)]
    torch.cuda.synchronize()
    for out_c, lse_c in results:
        assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
