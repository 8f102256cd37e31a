"""The fa3 forward's per-tile clock stamps (Fa3Config.trace, fa3/trace.py) and their reader
(benchmarks/fa3_timeline.py `analyse`).

On the CPU: `analyse` on hand-built stamps of a plain grid (two CTAs after each other on an
SM) and of a persistent CTA (two tiles), where every phase's length is known; the trace's
refusals. On a GPU: a traced build gives the same bits as the untraced one and fills every
row with stamps in order.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from benchmarks.fa3_timeline import FIELDS, analyse, tile_blocks
from flashsuite.fa3.configs import FP8_DTYPE, Fa3Config, can_implement


def _rec(smid, cta, tile, q, loop, epi, load=(0, 0), ns=(0, 0)):
    r = dict(zip(FIELDS, [0] * len(FIELDS), strict=True))
    r.update(smid=smid, cta_start=cta, tile_start=tile, q_ready=q, loop_end=loop)
    r.update(epilogue_end=epi, load_start=load[0], loads_issued=load[1])
    r.update(cta_start_ns=ns[0], epilogue_end_ns=ns[1])
    return [r[f] for f in FIELDS]


def test_analyse_plain_grid_phases() -> None:
    """SM 0 runs CTAs A then B (launch gap 300 cycles), SM 1 runs C and ends 1 µs early: the
    medians and shares are the constructed ones, the clock 2 cycles a ns."""
    rows = []
    for smid, cta, ns0 in ((0, 1000, 500), (0, 7300, 3650), (1, 1000, 500)):
        wg0 = _rec(smid, cta, cta + 200, cta + 700, cta + 5700, cta + 6000, (cta + 50, cta + 4000),
                   (ns0, ns0 + 3000))  # fmt: skip
        wg1 = _rec(smid, cta, cta + 200, cta + 700, cta + 5900, cta + 6000, ns=(ns0, ns0 + 3000))
        rows.append([wg0, wg1])
    s = analyse(rows, 2, [10, 10, 10])
    med = s["median_cycles"]
    assert (s["sms"], s["tiles"], s["tiles_per_sm"]) == (2, 3, 1.5)
    assert s["ghz"] == pytest.approx(2.0)
    assert med["launch"] == 300 and med["prologue"] == 200 and med["q_wait"] == 500
    assert med["loop"] == 5100 and med["loop_per_block"] == 510  # 5000 and 5200: the median
    assert med["epilogue"] == 200 and med["loads"] == 3950
    # SM spans: 12300 (two CTAs) and 6000 cycles; the launch gap is 300 of 18300.
    assert s["share"]["launch"] == pytest.approx(300 / 18300)
    assert s["share"]["loop"] == pytest.approx(3 * 5100 / 18300)
    assert sum(s["share"].values()) == pytest.approx(1.0)
    # The kernel ends at 6650 ns (SM 0), SM 1 at 3500: the mean idle at the end over the SMs.
    assert s["tail_share"] == pytest.approx((6650 - 3500) / 2 / (6650 - 500))


def test_analyse_persistent_between_tiles() -> None:
    """One persistent CTA with two tiles: the second tile's start counts from the first one's
    epilogue end of the same warpgroup ("between"), not as a launch."""
    t1 = [_rec(5, 0, 100, 400, 4400, 4600, ns=(0, 2300)), _rec(5, 0, 100, 400, 4500, 4700)]
    t2 = [_rec(5, 0, 4650, 4700, 8700, 8900, ns=(0, 4450)), _rec(5, 0, 4800, 4850, 8800, 9000)]
    s = analyse([t1, t2], 2, [8, 8])
    med = s["median_cycles"]
    assert med["between"] == 75  # 4650 - 4600 and 4800 - 4700
    assert math.isnan(med["launch"])  # no launch gap
    # The warpgroups' mean phases end at 8950, the SM's span at warpgroup 1's 9000.
    assert sum(s["share"].values()) == pytest.approx(8950 / 9000)


def test_analyse_plain_tile_without_a_block() -> None:
    """A plain-grid tile with no K/V block (a causal row tile above the diagonal) never waits
    for Q and leaves q_ready 0: its Q wait and loop count 0 cycles, not the clock's value."""
    rows = [[_rec(0, 100, 300, 0, 310, 900, ns=(10, 500)), _rec(0, 100, 300, 0, 310, 900)]]
    med = analyse(rows, 2, [0])["median_cycles"]
    assert (med["q_wait"], med["loop"], med["epilogue"]) == (0, 10, 590)
    assert math.isnan(med["loop_per_block"])


def test_analyse_refuses_tiles_without_stamps() -> None:
    rows = [[_rec(0, 1, 2, 3, 4, 5), _rec(0, 1, 2, 3, 4, 5)], [[0] * len(FIELDS)] * 2]
    with pytest.raises(ValueError, match="tile 1: a warpgroup left no stamps"):
        analyse(rows, 2, [1, 1])
    with pytest.raises(ValueError, match=r"n_blocks: expected one per tile \(2\), got 1"):
        analyse(rows, 2, [1])


def test_tile_blocks_follow_the_causal_diagonal() -> None:
    """1000 x 1000 in 128 x 128 tiles, two heads: 8 row tiles of 1 .. 8 key blocks causal
    (the last one's rows end at key 999), all 8 blocks without the mask."""
    assert tile_blocks(1000, 128, 128, True, 16) == [1, 2, 3, 4, 5, 6, 7, 8] * 2
    assert tile_blocks(1000, 128, 128, False, 16) == [8] * 16
    assert tile_blocks(1024, 192, 128, True, 6) == [2, 3, 5, 6, 8, 8]


def test_trace_is_refused_for_fp8() -> None:
    ok, why = can_implement(Fa3Config(trace=True), 128, FP8_DTYPE)
    assert not ok and "trace is for 16-bit inputs" in why, why
    assert can_implement(Fa3Config(trace=True), 128, torch.bfloat16)[0]


def test_trace_imports_without_the_dsl() -> None:
    """fa3/trace.py's field names load in a process where the CuTe DSL cannot be imported (the
    timeline's reader needs no DSL), and the consumer's stamps are the fields named."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['cutlass'] = None\n"
        "from flashsuite.fa3 import trace\n"
        "print([trace.FIELDS[i] for i in trace.CONSUMER_FIELDS])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(
        ["smid", "cta_start", "tile_start", "q_ready", "loop_end", "epilogue_end",
         "cta_start_ns", "epilogue_end_ns"]
    )  # fmt: skip


_V2 = dict(persistent=True, overlap_tiles=True, balanced_order=True, o_alias_q=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("d", "causal", "changes"),
    [
        pytest.param(128, False, {}, id="D128"),
        pytest.param(128, False, dict(_V2, q_stages=2), id="D128-persistent-two-q"),
        pytest.param(64, True, {}, id="D64-causal"),
    ],
)
def test_gpu_trace_keeps_the_bits_and_fills_every_row(d: int, causal: bool, changes) -> None:
    """B 2 x 1000 queries and keys, 8 heads: the traced build's out and lse equal the untraced
    build's; every (tile, warpgroup) row has its stamps in order on a real SM, and the traced
    forward refuses a trace tensor of the wrong shape by name."""
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import config_for

    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (
        torch.randn(2, 1000, 8, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(3)
    )
    p = check_inputs(q, k, v, causal=causal)
    cfg = dataclasses.replace(config_for(p), **changes)
    traced = dataclasses.replace(cfg, trace=True)
    rows = 2 * 8 * -(-1000 // cfg.tile_m) * cfg.num_consumer_wgs
    buf = torch.zeros(rows, len(FIELDS), dtype=torch.int64, device="cuda")
    out, lse = interface.forward(q, k, v, p, cfg=cfg)
    out_t, lse_t = interface.forward(q, k, v, p, cfg=traced, trace=buf)
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)
    f = {name: i for i, name in enumerate(FIELDS)}
    recs = buf.cpu()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert bool((recs[:, f["smid"]] < sms).all())
    for a, b in (("cta_start", "tile_start"), ("tile_start", "q_ready"),
                 ("q_ready", "loop_end"), ("loop_end", "epilogue_end"),
                 ("cta_start_ns", "epilogue_end_ns")):  # fmt: skip
        assert bool((recs[:, f[a]] > 0).all()) and bool((recs[:, f[a]] <= recs[:, f[b]]).all()), a
    wg0 = recs.view(-1, cfg.num_consumer_wgs, len(FIELDS))[:, 0]
    assert bool((wg0[:, f["load_start"]] > 0).all())
    assert bool((wg0[:, f["load_start"]] <= wg0[:, f["loads_issued"]]).all())
    with pytest.raises(ValueError, match=r"trace expected a contiguous CUDA int64"):
        interface.forward(q, k, v, p, cfg=traced, trace=buf[:-1])
    with pytest.raises(ValueError, match=r"trace tensor given: True, cfg\.trace: False"):
        interface.forward(q, k, v, p, cfg=cfg, trace=buf)
