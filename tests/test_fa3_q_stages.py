"""The fa3 forward's tile boundaries: how Q reaches a tile early, two Q buffers in the
persistent forward (Fa3Config.q_stages) and the plain grid's L2 prefetch of the next wave's Q
(Fa3Config.prefetch_next_q), how O leaves it without a store to wait for
(Fa3Config.o_direct_store), and the LSE leaving it by TMA (Fa3Config.lse_tma). Where each
option is allowed, what the second buffer costs in shared memory, and on a GPU that they
change when Q arrives or O and the LSE leave, not the result: the same bits as the build
without them on problems of many tiles per CTA or many waves (so both buffers and both phases
of their barriers are used) and with a partial last row tile, and the float64 oracle's
agreement."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashsuite.fa3.configs import Fa3Config, can_implement, smem_bytes

_V2 = dict(persistent=True, overlap_tiles=True, balanced_order=True, o_alias_q=False)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(_V2, q_stages=3), "q_stages"),
        (dict(_V2, q_stages=0), "q_stages"),
        (dict(_V2, overlap_tiles=False, balanced_order=False, q_stages=2), "overlap_tiles"),
        (dict(_V2, o_alias_q=True, q_stages=2), "o_alias_q"),
        (dict(q_stages=2), "persistent"),
    ],
    ids=["three", "zero", "no-overlap", "o-on-q", "plain-grid"],
)
def test_q_stages_outside_the_persistent_overlap_are_refused(changes: dict, named: str) -> None:
    ok, why = can_implement(Fa3Config(**changes), 128, torch.bfloat16)
    assert not ok and named in why, why


@pytest.mark.parametrize(
    "changes",
    [dict(persistent=True), dict(lpt_grid=True), dict(head_section=4)],
    ids=["persistent", "lpt-grid", "head-section"],
)
def test_next_q_prefetch_outside_the_dense_plain_grid_is_refused(changes: dict) -> None:
    ok, why = can_implement(Fa3Config(prefetch_next_q=True, **changes), 128, torch.bfloat16)
    assert not ok and "prefetch_next_q" in why, why
    assert can_implement(Fa3Config(prefetch_next_q=True), 128, torch.bfloat16)[0]


@pytest.mark.parametrize(
    "changes", [dict(persistent=True), dict(lpt_grid=True)], ids=["persistent", "lpt-grid"]
)
def test_direct_o_store_outside_the_dense_plain_grid_is_refused(changes: dict) -> None:
    ok, why = can_implement(Fa3Config(o_direct_store=True, **changes), 128, torch.bfloat16)
    assert not ok and "o_direct_store" in why, why
    assert can_implement(Fa3Config(o_direct_store=True), 128, torch.bfloat16)[0]


def test_direct_o_store_is_refused_for_packed_sequences() -> None:
    from flashsuite.fa3.varlen_configs import can_implement_varlen

    ok, why = can_implement_varlen(Fa3Config(o_direct_store=True), torch.bfloat16)
    assert not ok and "o_direct_store" in why, why


@pytest.mark.parametrize(
    "changes",
    [dict(), dict(persistent=True), {**_V2, "o_alias_q": True}],
    ids=["plain", "persistent-v1", "sO-on-sQ"],
)
def test_lse_by_tma_outside_the_per_wg_epilogue_is_refused(changes: dict) -> None:
    ok, why = can_implement(Fa3Config(lse_tma=True, **changes), 128, torch.bfloat16)
    assert not ok and "lse_tma" in why, why
    assert can_implement(Fa3Config(lse_tma=True, **_V2), 128, torch.bfloat16)[0]


def test_lse_by_tma_costs_no_shared_memory() -> None:
    """sLSE (TILE_M fp32) lies inside the barriers' 1 KiB: the two-Q-buffer builds count
    1 KiB + Q + K/V + sO and nothing more (D = 128: 225 KiB), 192-row tiles included
    (compile.py checks the count against the kernel's struct)."""
    for d, tile_m, wgs in ((128, 128, 2), (64, 192, 3)):
        cfg = Fa3Config(tile_m=tile_m, num_consumer_wgs=wgs, q_stages=2, lse_tma=True, **_V2)
        kv = 2 * cfg.stages * cfg.tile_n * d * 2
        assert smem_bytes(cfg, d) == 1024 + 2 * tile_m * d * 2 + kv + tile_m * d * 2
        assert can_implement(cfg, d, torch.bfloat16)[0]
    assert smem_bytes(Fa3Config(q_stages=2, **_V2), 128) == 225 * 1024


def test_lse_by_tma_needs_rows_in_16_byte_strides() -> None:
    """The LSE's TMA needs each (batch, head) row of Nq floats to start 16 bytes apart: a
    query length that is not a multiple of 4 is refused by name before any compile."""
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface

    q = torch.randn(1, 77, 2, 128, dtype=torch.bfloat16)
    k = v = torch.randn(1, 80, 2, 128, dtype=torch.bfloat16)
    p = check_inputs(q, k, v)
    with pytest.raises(ValueError, match=r"lse_tma.*seqlen_q=77"):
        interface._launch_plan(p, Fa3Config(lse_tma=True, **_V2), torch.device("cpu"))


@pytest.mark.parametrize(
    ("causal", "n", "two"),
    [
        (False, 1024, False),
        (False, 1022, True),
        (False, 2048, True),
        (True, 2048, True),
        (True, 4096, False),
    ],
)
def test_explain_names_the_second_q_buffer(causal: bool, n: int, two: bool) -> None:
    """The table's D = 64 entries say they run two Q buffers, where they do: non-causal dense
    problems but those with Q in registers (seqlen_q % 4 == 0 up to SHORT_SEQLEN_K keys: one
    buffer, released once loaded), causal ones up to SHORT_CAUSAL_TWO_Q keys."""
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface

    q = torch.randn(1, n, 2, 64, dtype=torch.bfloat16)
    ok, reason = interface.supports(check_inputs(q, q, q, causal=causal), 90)
    assert ok and ("two Q buffers" in reason) == two, reason


def test_next_q_prefetch_is_refused_for_packed_sequences() -> None:
    """The packed build's grid is not the dense launch order the prefetch walks."""
    from flashsuite.fa3.varlen_configs import can_implement_varlen

    ok, why = can_implement_varlen(Fa3Config(prefetch_next_q=True), torch.bfloat16)
    assert not ok and "prefetch_next_q" in why, why


def test_second_q_buffer_is_counted_in_shared_memory() -> None:
    """One more TILE_M x D buffer and one more full/empty barrier pair; at D = 256 (Q 64 KiB)
    the second buffer does not fit beside two K/V stages and is refused."""
    one = Fa3Config(**_V2)
    two = dataclasses.replace(one, q_stages=2)
    for d in (64, 128):
        extra = smem_bytes(two, d) - smem_bytes(one, d)
        assert extra == 128 * d * 2, (d, extra)  # the mbarriers fit the 1 KiB alignment
        assert can_implement(two, d, torch.bfloat16)[0]
    ok, why = can_implement(dataclasses.replace(two, tile_n=80), 256, torch.bfloat16)
    assert not ok and "shared memory" in why, why


def _gpu_problem(d: int, dtype, causal: bool, seed: int):
    """(q, k, v, p, opts) of the GPU cases: B 4 x 1500 queries x 1100 keys, GQA 16 / 4
    (12 row tiles of 128 x 16 heads x 4 = 768 tiles); `dtype` torch.bfloat16 / float16 or
    "e4m3" (quantized per (batch, kv head), descales in opts)."""
    from flashsuite.common.fp8 import quantize_e4m3
    from flashsuite.common.validation import check_inputs

    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, nq, nk, hq, hkv = 4, 1500, 1100, 16, 4
    base = torch.bfloat16 if dtype == "e4m3" else dtype
    q, k, v = (
        torch.randn(b, n, h, d, device="cuda", generator=gen, dtype=base)
        for n, h in ((nq, hq), (nk, hkv), (nk, hkv))
    )
    opts: dict = {"causal": causal}
    if dtype == "e4m3":
        (q, dq), (k, dk), (v, dv) = (
            quantize_e4m3(t, group=g) for t, g in ((q, hq // hkv), (k, 1), (v, 1))
        )
        opts.update(descale_q=dq, descale_k=dk, descale_v=dv)
    return q, k, v, check_inputs(q, k, v, **opts), opts


def _same_bits(q, k, v, p, opts: dict, cfg, changes: dict, oracle: bool) -> None:
    """`cfg` and `cfg` with `changes` give the same out and lse bits; with `oracle`, the
    changed build also passes the suite's comparison with the float64 oracle."""
    from flashsuite.common.testing import compare, reference_pair
    from flashsuite.fa3 import interface

    out, lse = interface.forward(q, k, v, p, cfg=cfg)
    out_c, lse_c = interface.forward(q, k, v, p, cfg=dataclasses.replace(cfg, **changes))
    assert torch.equal(out, out_c), (out.float() - out_c.float()).abs().max()
    assert torch.equal(lse, lse_c), (lse - lse_c).abs().nan_to_num().max()
    if oracle:
        refs = reference_pair(q, k, v, **opts)
        for res in (compare("out", out_c, *refs["out"]), compare("lse", lse_c, *refs["lse"])):
            assert res.ok, res


_GPU_CASES = [
    pytest.param(64, False, False, id="D64"),
    pytest.param(64, False, True, id="D64-causal"),
    pytest.param(128, False, False, id="D128"),
    pytest.param(128, False, True, id="D128-causal"),
    pytest.param(128, True, True, id="D128-e4m3-causal"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "fp8", "causal"), _GPU_CASES)
def test_gpu_two_q_buffers_give_the_same_bits(d: int, fp8: bool, causal: bool) -> None:
    """B 4 x 1500 queries x 1100 keys, GQA 16 / 4: 12 row tiles x 16 heads x 4 = 768 tiles,
    about 6 per CTA on 132 SMs; causal (bottom-right aligned) gives the first 400 rows no key,
    so whole tiles run no K/V block and still load and release their Q. The two-buffer build
    equals the one-buffer build bit for bit (the same arithmetic on the same operands) and,
    16-bit, passes the suite's comparison with the float64 oracle (e4m3's accuracy is the fp8
    suite's: tests/test_fp8.py)."""
    from flashsuite.fa3.configs import config_for

    q, k, v, p, opts = _gpu_problem(d, "e4m3" if fp8 else torch.bfloat16, causal, 3)
    one = dataclasses.replace(config_for(p), **_V2, q_stages=1)
    _same_bits(q, k, v, p, opts, one, dict(q_stages=2), oracle=not fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_next_q_prefetch_gives_the_same_bits(d: int) -> None:
    """The plain grid with the L2 prefetch of the next wave's Q, on 768 row tiles (about 6
    waves, the last partial, so some CTAs have no next tile to prefetch): the same bits as the
    table build."""
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import get_config

    gen = torch.Generator(device="cuda").manual_seed(4)
    b, nq, nk, hq, hkv = 4, 1500, 1100, 16, 4
    q, k, v = (
        torch.randn(b, n, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        for n, h in ((nq, hq), (nk, hkv), (nk, hkv))
    )
    p = check_inputs(q, k, v)
    table = get_config(d, torch.bfloat16, False, nk)  # the plain entry (config_for: persistent)
    assert not table.persistent, table
    out, lse = interface.forward(q, k, v, p, cfg=table)
    cfg = dataclasses.replace(table, prefetch_next_q=True)
    out_p, lse_p = interface.forward(q, k, v, p, cfg=cfg)
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)


_DIRECT_CASES = [
    pytest.param(d, torch.bfloat16, False, id=f"D{d}") for d in (64, 96, 128, 192, 256)
] + [
    pytest.param(128, torch.float16, True, id="D128-fp16-causal"),
    pytest.param(128, "e4m3", False, id="D128-e4m3"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "dtype", "causal"), _DIRECT_CASES)
def test_gpu_direct_o_store_gives_the_same_bits(d: int, dtype, causal: bool) -> None:
    """O stored by the consumer threads (16-byte vectors, rows past Nq left out) against the
    TMA store, on the plain grid: B 4 x 1500 queries (the last row tile partial at every tile
    height: 1500 = 11 x 128 + 92 = 7 x 192 + 156), so an unguarded row would overwrite the
    next batch's first rows; causal leaves the first 400 rows without a key. The same bits,
    and (16-bit) the float64 oracle's agreement."""
    from flashsuite.fa3.configs import get_config

    q, k, v, p, opts = _gpu_problem(d, dtype, causal, 5)
    # The table's tiles (get_config: config_for's dense builds are persistent) on the plain grid.
    table = get_config(p.head_dim, p.dtype, p.causal, p.seqlen_k)
    plain = dataclasses.replace(table, persistent=False, overlap_tiles=False, balanced_order=False)
    _same_bits(q, k, v, p, opts, plain, dict(o_direct_store=True), oracle=dtype != "e4m3")


_LSE_CASES = [
    pytest.param(128, False, False, 1, id="D128"),
    pytest.param(128, False, False, 2, id="D128-two-q"),
    pytest.param(128, False, True, 1, id="D128-causal"),
    pytest.param(64, False, True, 2, id="D64-causal-two-q"),
    pytest.param(128, True, True, 1, id="D128-e4m3-causal"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "fp8", "causal", "q_stages"), _LSE_CASES)
def test_gpu_lse_by_tma_gives_the_same_bits(d: int, fp8: bool, causal: bool, q_stages: int):
    """The LSE through sLSE and a TMA store against the consumer threads' stores, on the
    persistent build with its own sO: B 4 x 1500 queries (1500 = 23 x 64 + 28: the last slab
    partial, its rows past Nq clipped by the TMA), 768 row tiles over 132 CTAs; causal rows
    without a key (LSE -inf). The same bits for out and lse, and (16-bit) the float64
    oracle's agreement."""
    from flashsuite.fa3.configs import config_for

    q, k, v, p, opts = _gpu_problem(d, "e4m3" if fp8 else torch.bfloat16, causal, 6)
    base = dataclasses.replace(config_for(p), **_V2, q_stages=q_stages)
    _same_bits(q, k, v, p, opts, base, dict(lse_tma=True), oracle=not fp8)


def test_l2_sections_of_less_than_one_mib_are_refused() -> None:
    ok, why = can_implement(Fa3Config(persistent=True, l2_section_mib=0), 128, torch.bfloat16)
    assert not ok and "l2_section_mib" in why and "got 0" in why, why


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("d", "causal", "mib"),
    [
        pytest.param(128, False, 3, id="D128-sections-of-5-pairs"),
        pytest.param(128, True, 1, id="D128-causal-one-pair-a-section"),
        pytest.param(64, True, 3, id="D64-causal-sections-of-11-pairs"),
    ],
)
def test_gpu_l2_sections_reorder_tiles_not_results(d: int, causal: bool, mib: int) -> None:
    """The persistent order with smaller L2 sections (`l2_section_mib`): at D = 128, 3 MiB is
    5 (batch, head) pairs of 1100 keys a section, so the 64 pairs end in a short section of 4;
    1 MiB is one pair a section. Every tile runs once whatever CTA takes it: the same bits as
    the 32 MiB order (one section here) and the float64 oracle's agreement."""
    from flashsuite.fa3.configs import config_for

    q, k, v, p, opts = _gpu_problem(d, torch.bfloat16, causal, 9)
    base = dataclasses.replace(config_for(p), **_V2)
    _same_bits(q, k, v, p, opts, base, dict(l2_section_mib=mib), oracle=True)
