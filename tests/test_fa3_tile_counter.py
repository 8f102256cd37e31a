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


def test_counters_are_the_decode_combines(monkeypatch) -> None:
    """A launch's (next tile, CTAs done) pair is decode_host.split_counters(2): zeros the
    kernels leave zeroed, one buffer per stream, a capture-pool slice of its own for each call
    captured into a CUDA graph (tests/test_fa3_kvcache.py tests that pool)."""
    from flashsuite.fa3 import decode_host, interface

    asked = []

    def split_counters(n, device):
        asked.append((n, device))
        return torch.zeros(n, dtype=torch.int32)

    monkeypatch.setattr(decode_host, "split_counters", split_counters)
    dev = torch.device("cpu")
    assert interface._tile_counters(dev).tolist() == [0, 0]
    assert asked == [(2, dev)]


def test_table_takes_the_counter_where_measured() -> None:
    """Dense causal 16-bit problems up to each head dim's key length run the counter build
    with its sections; longer ones, softcap, windows, fp8 and non-causal ones do not."""
    from flashsuite.common.validation import AttnParams
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import _TILE_COUNTER, config_for, get_config

    def problem(d, n, causal=True, dtype=torch.bfloat16, softcap=0.0, left=-1):
        window = (left, 0 if causal else -1)
        cpu = torch.device("cpu")
        return AttnParams(1, n, n, 8, 8, d, d, dtype, cpu, causal, *window, softcap, 1.0)

    for d, (limit, mib) in _TILE_COUNTER.items():
        cfg = config_for(problem(d, limit))
        assert cfg.tile_counter and cfg.persistent and cfg.l2_section_mib == mib, (d, cfg)
        ok, why = interface.supports(problem(d, limit), 90)  # explain() names both
        sections = mib == 32 or f"{mib} MiB L2 sections" in why  # 32: the default, not named
        assert ok and "tiles from a global counter" in why and sections, why
        assert config_for(problem(d, limit, dtype=torch.float16)) == cfg
        for p in (
            problem(d, limit + 1),
            problem(d, 512, softcap=5.0),
            problem(d, 512, causal=False),
        ):
            assert not config_for(p).tile_counter, (d, p)
    # Causal D = 64 up to SHORT_SEQLEN_K keys: two warpgroups' 128-row tiles, Q in registers.
    short, longer = config_for(problem(64, 1024)), config_for(problem(64, 1025))
    assert (short.tile_m, short.num_consumer_wgs, short.q_in_regs) == (128, 2, True), short
    assert (longer.tile_m, longer.num_consumer_wgs, longer.q_in_regs) == (192, 3, False), longer
    assert not config_for(problem(128, 512, left=64)).tile_counter
    assert not config_for(problem(96, 512)).tile_counter
    assert not config_for(problem(96, 0)).tile_counter  # no key: still the table's entry
    f8 = problem(128, 512, dtype=torch.float8_e4m3fn)
    assert not config_for(f8).tile_counter
    # Causal D = 256 up to 4k keys: 64-key tiles, with the counter (to 1k) or without; 80-key
    # tiles (the table's) past 4k keys, with softcap or a window, and non-causal.
    assert get_config(256, torch.bfloat16, True).tile_n == 80
    for n, counter in ((512, True), (1024, True), (2048, False), (4096, False)):
        cfg = config_for(problem(256, n))
        assert (cfg.tile_n, cfg.tile_counter, cfg.persistent) == (64, counter, True), (n, cfg)
    for p in (problem(256, 4097), problem(256, 2048, softcap=5.0), problem(256, 2048, left=64),
              problem(256, 2048, causal=False)):  # fmt: skip
        assert config_for(p).tile_n == 80, p


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
    base = dataclasses.replace(base, tile_counter=False, **changes)
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
    base = dataclasses.replace(config_for(p), tile_counter=False)
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


@pytest.mark.gpu
def test_gpu_tile_counter_under_cuda_graph_capture() -> None:
    """dispatch.attention on a table entry with the counter (causal D = 128, 1k keys) captured
    into a CUDA graph: the captured launch takes counters no other call has (a capture-pool
    slice, left at zero by each replay), and every replay gives the eager call's bits."""
    from flashsuite import dispatch
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import decode_host
    from flashsuite.fa3.configs import config_for

    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (
        torch.randn(2, 1024, 8, 128, generator=gen, device="cuda").bfloat16() for _ in range(3)
    )
    assert config_for(check_inputs(q, k, v, causal=True)).tile_counter
    ref = dispatch.attention(q, k, v, causal=True, version="fa3")
    handed = decode_host._capture_pool[q.device][1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dispatch.attention(q, k, v, causal=True, version="fa3")
    assert decode_host._capture_pool[q.device][1] == handed + 2
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
