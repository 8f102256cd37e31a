"""The softmax options of the fa3 forward: softmax.exp2_poly, the exponential on the FMA pipe
(Fa3Config.ex2_emu), through its CPU model (`exp2_poly_model`: the same float32 operations in
the same order, fma with one rounding); the options' range checks in can_implement and where
they ship; on a GPU, rescale_threshold against the oracle while a row's max keeps growing,
skip_unit_rescale, row_chains and the schedule options (wg_slice, loop_mask_test,
split_loops) against the table build within rounding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")


def test_exp2_poly_is_within_its_stated_error_on_the_softmax_range() -> None:
    from flashsuite.fa3.softmax import exp2_poly_model

    x = np.linspace(-126.0, 0.0, 1_000_003).astype(np.float32)
    rel = np.abs(exp2_poly_model(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= 1.02e-4, rel.max()
    assert exp2_poly_model(np.float32(0.0)) == np.float32(1.0)
    # At the integer points f = 0, so the result is a power of two exactly.
    ints = np.arange(-126, 1, dtype=np.float32)
    assert np.array_equal(exp2_poly_model(ints), np.exp2(ints))


def test_exp2_poly_gives_zero_for_masked_scores_and_never_wraps() -> None:
    """-inf (a masked score) and anything at or below the floor give +0 exactly, so a fully
    masked row's sum stays 0; between the floor and -126 the result is a tiny non-negative
    subnormal; the function is monotone (no wrap of the exponent bits)."""
    from flashsuite.fa3.softmax import EXP2_POLY_FLOOR, exp2_poly_model

    low = np.array([-np.inf, -1e30, -300.0, -128.0, EXP2_POLY_FLOOR], dtype=np.float32)
    out = exp2_poly_model(low)
    assert np.array_equal(out.view(np.uint32), np.zeros(len(low), dtype=np.uint32)), out
    x = np.linspace(EXP2_POLY_FLOOR, 0.0, 400_001).astype(np.float32)
    y = exp2_poly_model(x)
    assert (y >= 0).all() and (np.diff(y) >= 0).all()
    assert (y[x < -126] < np.float32(2.0**-126)).all()


def test_emulated_share() -> None:
    from flashsuite.fa3.softmax import emulated

    assert [k for k in range(12) if emulated(k, 4)] == [3, 7, 11]
    assert not any(emulated(k, 0) for k in range(64))


@pytest.mark.parametrize(("field", "value"), [("rescale_threshold", 9), ("rescale_threshold", -1),
                                              ("ex2_emu", -1)])  # fmt: skip
def test_softmax_options_out_of_range_are_refused(field: str, value: int) -> None:
    import torch

    from flashsuite.fa3.configs import can_implement, get_config

    cfg = dataclasses.replace(get_config(128, torch.bfloat16, False), **{field: value})
    ok, why = can_implement(cfg, 128, torch.bfloat16)
    assert not ok and field in why and str(value) in why, why


@pytest.mark.parametrize(
    "changes",
    [dict(softmax_apart=True), dict(intra_wg_overlap=False), dict(pin_pv_wait=True)],
    ids=["apart", "no-overlap", "pinned"],
)
def test_pv_wait_after_max_needs_the_in_place_overlap_softmax(changes: dict) -> None:
    """pv_wait_after_max moves the in-place overlap softmax's P·V wait: a build whose softmax
    is apart, not overlapped or already pinned would ignore it, so it is refused, named."""
    import torch

    from flashsuite.fa3.configs import can_implement, get_config

    cfg = get_config(64, torch.bfloat16, False)
    assert can_implement(dataclasses.replace(cfg, pv_wait_after_max=True), 64, torch.bfloat16)[0]
    bad = dataclasses.replace(cfg, pv_wait_after_max=True, **changes)
    ok, why = can_implement(bad, 64, torch.bfloat16)
    assert not ok and "pv_wait_after_max" in why, why


@pytest.mark.parametrize(
    "changes",
    [
        dict(rescale_threshold=0),
        dict(softmax_apart=True),
        dict(pv_wait_after_max=True),
        dict(pin_pv_wait=True),
        dict(intra_wg_overlap=False),
    ],
    ids=["no-threshold", "apart", "wait-after-max", "pinned", "no-overlap"],
)
def test_spec_exps_needs_a_threshold_and_the_in_place_overlap_softmax(changes: dict) -> None:
    """spec_exps keeps P against the running max only where no row's max grew past
    rescale_threshold, and takes the in-place overlapped softmax's place: without a threshold
    every block would take its exponentials twice, and the other softmax forms would ignore
    it, so those builds are refused, named. The e4m3 D = 128 and 256 entries take it."""

    from flashsuite.fa3.configs import FP8_DTYPE, can_implement, get_config

    for d in (128, 256):
        cfg = dataclasses.replace(get_config(d, FP8_DTYPE, False), spec_exps=True)
        assert can_implement(cfg, d, FP8_DTYPE) == (True, "")
    bad = dataclasses.replace(cfg, **changes)
    ok, why = can_implement(bad, 256, FP8_DTYPE)
    assert not ok and "spec_exps" in why, why


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("growth", [0.05, 3.0, 12.0], ids=lambda g: f"grow{g}")
def test_gpu_rescale_threshold_against_the_oracle_while_the_max_grows(
    growth: float, causal: bool
) -> None:
    """The shipped D = 256 build (rescale_threshold 8) on scores whose row max grows by about
    `growth` bits from one 80-key block to the next in the order the kernel visits them (the
    newest block first, down to key 0, so the scores rise towards key 0): 0.05 keeps the first
    block's max for the whole row (P climbs towards 2^8 and the row sum with it), 3 keeps it
    for a few blocks and then rescales, 12 rescales every block. Out and LSE against the
    float64 oracle under the suite's rule."""
    from flashsuite import dispatch
    from flashsuite.common.testing import compare, reference_pair
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.configs import config_for

    q, k, v = _growing_max_bf16(growth)
    assert config_for(check_inputs(q, k, v, causal=causal)).rescale_threshold == 8
    out, lse = dispatch.attention(q, k, v, causal=causal, return_lse=True, version="fa3")
    ref = reference_pair(q, k, v, causal=causal)
    for res in (compare("out", out, *ref["out"]), compare("lse", lse, *ref["lse"])):
        assert res.ok, res


def _growing_max_bf16(growth: float) -> tuple:
    """bf16 q (1 x 300 x 2 heads), k, v (1000 keys), D = 256, whose scores' row max grows by
    about `growth` bits per 80-key block in the order the kernel visits the blocks."""
    import torch

    b, nq, nk, h, d = 1, 300, 1000, 2, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(d, device="cuda", generator=gen), dim=0)
    amp = 4.0  # q's component along u
    # Key j's component along u falls with j so that the scores (scale 1/16, log2 e) grow by
    # `growth` bits per 80 keys from the last key to the first: the order of the kernel's
    # K / V blocks.
    per_key = growth / (80 * amp * d**-0.5 * 1.4426950408889634)
    ramp = per_key * torch.arange(nk - 1, -1, -1, device="cuda", dtype=torch.float32)
    q = torch.randn(b, nq, h, d, device="cuda", generator=gen) + amp * u
    k = torch.randn(b, nk, h, d, device="cuda", generator=gen) + ramp[None, :, None, None] * u
    v = torch.randn(b, nk, h, d, device="cuda", generator=gen)
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("growth", [0.05, 3.0, 12.0], ids=lambda g: f"grow{g}")
def test_gpu_spec_exps_gives_the_same_bits_in_bf16(growth: float, causal: bool) -> None:
    """Fa3Config.spec_exps on bf16 D = 256 (rescale_threshold 8, one chain per row sum), the
    table's entry with the in-place softmax (softmax_apart and pv_wait_after_max off), on
    scores whose row max grows by `growth` bits a block (kept, kept for a few blocks, grown
    every block): out and LSE bit for bit those of the same build without it."""
    import torch

    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import config_for

    q, k, v = _growing_max_bf16(growth)
    p = check_inputs(q, k, v, causal=causal)
    base = dataclasses.replace(config_for(p), softmax_apart=False, pv_wait_after_max=False)
    assert base.rescale_threshold == 8 and not base.row_chains, base
    want = interface.forward(q, k, v, p, cfg=base)
    got = interface.forward(q, k, v, p, cfg=dataclasses.replace(base, spec_exps=True))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _agree_with_the_table_build(
    d: int, fp8: bool, causal: bool, base: dict, option: dict, cfg=None
) -> None:
    """The table's config for a 700 x 3001 problem (16-bit or e4m3, causal or not, GQA 4 / 2,
    ragged lengths over enough key blocks for the options to matter; `cfg` in its place if
    given) with `base`'s fields replaced, against the same with `option`'s on top: out and
    LSE within rounding of each other (out: 2 bf16 ulps of each element, LSE: 1e-5
    relative; an option that drops a needed rescale or a chain of the row sum moves them by
    the size of O itself)."""
    import torch

    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import config_for

    gen = torch.Generator(device="cuda").manual_seed(1)
    b, nq, nk, hq, hkv = 2, 700, 3001, 4, 2

    def rnd(n: int, h: int) -> torch.Tensor:
        t = torch.randn(b, n, h, d, device="cuda", generator=gen)
        return t.to(torch.float8_e4m3fn) if fp8 else t.to(torch.bfloat16)

    q, k, v = rnd(nq, hq), rnd(nk, hkv), rnd(nk, hkv)
    p = check_inputs(q, k, v, causal=causal)
    table = dataclasses.replace(config_for(p) if cfg is None else cfg, **base)
    out, lse = interface.forward(q, k, v, p, cfg=table)
    out_o, lse_o = interface.forward(q, k, v, p, cfg=dataclasses.replace(table, **option))
    o, o_o = out.float(), out_o.float()
    assert ((o_o - o).abs() <= 2**-7 * o.abs() + 2**-14).all(), (o_o - o).abs().max()
    lse_ok = (lse_o - lse).abs() <= 1e-5 * (lse.abs() + 1)
    assert (lse_ok | (lse.isinf() & (lse_o == lse))).all(), (lse_o - lse).abs().max()


# e4m3 at D = 256: on the H200 the causal case below fails (commit d836f76: max difference
# 1.0e-3), and the same problem non-causal (commit edeb6c2) has 786 of 1.4M outputs more than
# 2 bf16 ulps of their own value from the table build's, at most 9.8e-4 where the row's
# largest |out| is 0.14 (one ulp of it); the LSE agrees to 4e-6. P·V's fp8 wgmma adds into O
# with fewer bits than float32 (common.testing's FP8_ACC_BITS), so O's rounding follows its
# scale, not each element's, and a factor a few ulps from 1 moves it by more than the
# element's own rounding. 16-bit and e4m3 D = 128 pass.
_SKIP_UNIT_FP8_D256 = pytest.mark.xfail(
    strict=True, reason="e4m3 D 256: fp8 wgmma's coarse accumulation of O (see above)"
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("d", "fp8", "causal"),
    [(64, False, False), (128, False, False), (128, False, True), (128, True, False),
     pytest.param(256, True, True, marks=_SKIP_UNIT_FP8_D256)],
    ids=lambda x: str(x),
)  # fmt: skip
def test_gpu_skip_unit_rescale_matches_the_table_build(d: int, fp8: bool, causal: bool) -> None:
    """Fa3Config.skip_unit_rescale skips O's rescale only where every row of the warp kept its
    max, whose rescale is exactly 1.0; the table build multiplies O there by exp2 of the
    rounding residual of max * scale_log2 - max * scale_log2 (ptxas contracts the pair into an
    FFMA), a factor within a few float32 ulps of 1. So out and LSE agree with the table
    build's (without its rescale threshold) to within rounding, except in e4m3 at D = 256."""
    _agree_with_the_table_build(
        d, fp8, causal, {"rescale_threshold": 0}, {"skip_unit_rescale": True}
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("d", "fp8", "causal"),
    [(64, False, False), (128, False, True), (128, True, False), (256, True, True)],
    ids=lambda x: str(x),
)  # fmt: skip
def test_gpu_row_chains_match_the_table_build(d: int, fp8: bool, causal: bool) -> None:
    """Fa3Config.row_chains takes the in-place softmax's row max and row sum in four chains:
    the max is the same in any order, so P is bit for bit the table build's, and only the
    row sum's rounding order differs: out and LSE agree with the in-place table build's to
    within rounding."""
    base = {"softmax_apart": False, "row_chains": False}
    _agree_with_the_table_build(d, fp8, causal, base, {"row_chains": True})


# Options that change what ptxas schedules, not the arithmetic: descriptors from the
# warpgroup's slice with no runtime mask test in the loop (non-causal; at D = 128 also with
# the in-place softmax, at D = 256 also without ping-pong, FA4's D = 256 schedule), and the
# causal loop split in two. The builds scripts/gpu_check.sh's fwd-candidates part times.
_NEW = {"wg_slice": True, "loop_mask_test": False}
_SPLIT = {"split_loops": True, "wg_slice": True}


_PV_MAX = {"pv_wait_after_max": True, "softmax_apart": False}
_STAGE_DESC_BUILDS = ((128, False), (128, True), (256, False), (192, True), (96, False))


def _case(d: int, fp8: bool, causal: bool, name: str, option: dict):
    kind = ("-e4m3" if fp8 else "") + ("-causal" if causal else "")
    return pytest.param(d, fp8, causal, option, id=f"{name}-D{d}{kind}")


_SCHEDULE_CASES = [
    *[_case(d, False, False, "new", _NEW) for d in (64, 96, 128, 192, 256)],
    *[_case(d, True, False, "new", _NEW) for d in (128, 256)],
    _case(128, False, False, "new_inplace", {**_NEW, "softmax_apart": False}),
    _case(256, False, False, "new_nopp", {**_NEW, "pingpong": False}),
    *[_case(d, False, True, "split", _SPLIT) for d in (64, 96, 128, 192, 256)],
    *[_case(d, True, True, "split", _SPLIT) for d in (128, 256)],
    _case(256, False, True, "split_nopp", {**_SPLIT, "pingpong": False}),
    # pin_pv_wait: a never-taken branch before P·V's wait (the in-place softmax's builds).
    _case(64, False, False, "pin", {"pin_pv_wait": True, "pv_wait_after_max": False}),
    _case(128, False, True, "pin", {"pin_pv_wait": True}),
    *[_case(d, True, False, "pin", {"pin_pv_wait": True}) for d in (128, 256)],
    # pv_wait_after_max: P·V's wait between the row max and the exponentials (in place).
    _case(64, False, False, "pvmax", _PV_MAX),
    _case(128, False, True, "pvmax", _PV_MAX),
    _case(256, False, False, "pvmax", _PV_MAX),
    # FA4's loop (non-causal D = 64's table build) and stage_desc alone: descriptors advanced
    # from the stage's first; a wrong offset reads another block or stage.
    _case(64, False, False, "fa4loop", {**_PV_MAX, **_NEW, "stage_desc": True}),
    # pv_wait_exps: some exponentials before P·V's wait, the rest after (one taken twice or
    # for the wrong element moves out by the size of O).
    *[
        _case(
            64,
            False,
            False,
            f"fa4loop-exps{e}",
            {**_PV_MAX, **_NEW, "stage_desc": True, "pv_wait_exps": e},
        )
        for e in (4, 32)
    ],
    *[_case(d, False, c, "stage", {"stage_desc": True}) for d, c in _STAGE_DESC_BUILDS],
    *[_case(d, True, False, "stage", {"stage_desc": True}) for d in (128, 256)],
    *[_case(d, True, False, "pvmax", _PV_MAX) for d in (128, 256)],
    # o_zero_init: the tile's first P·V overwrites acc_O (no zeroing before the loop).
    *[_case(d, False, False, "zi", {"o_zero_init": True}) for d in (64, 128, 256)],
    *[_case(d, False, True, "zi", {"o_zero_init": True}) for d in (64, 128, 192)],
    _case(128, True, False, "zi", {"o_zero_init": True}),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "fp8", "causal", "option"), _SCHEDULE_CASES)
def test_gpu_schedule_options_match_the_table_build(
    d: int, fp8: bool, causal: bool, option: dict
) -> None:
    """Fa3Config.wg_slice, loop_mask_test = False, split_loops, pin_pv_wait and
    pv_wait_after_max change where ptxas puts the wgmma waits and how it builds the
    descriptors, not the operations: out and LSE agree with the table build's to within
    rounding (a dropped mask or a wrong descriptor moves them by the size of O). The
    reference is the table build with the option's fields at their defaults, so an entry
    that ships the option is still compared with the build without it."""
    from flashsuite.fa3.configs import Fa3Config

    without = {field: getattr(Fa3Config(), field) for field in option}
    _agree_with_the_table_build(d, fp8, causal, without, option)


@pytest.mark.gpu
def test_gpu_d64_plain_grid_table_build_agrees_without_fa4s_loop() -> None:
    """Non-causal D = 64's plain-grid table build (what dense problems past
    SECTIONS_MAX_SEQLEN_K keys run, the 700 x 3001 case above takes the persistent one) with
    FA4's loop against the same build without it: out and LSE within rounding."""
    import torch

    from flashsuite.fa3.configs import get_config

    plain = get_config(64, torch.bfloat16, False)
    old = dict(pv_wait_after_max=False, wg_slice=False, loop_mask_test=True, stage_desc=False)
    assert not plain.persistent and all(getattr(plain, f) != v for f, v in old.items()), plain
    _agree_with_the_table_build(64, False, False, old, {f: getattr(plain, f) for f in old}, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_o_zero_init_zeroes_tiles_without_a_block(d: int) -> None:
    """o_zero_init on causal problems with more queries than keys (bottom-right aligned: the
    first Nq - Nk rows see no key, so whole row tiles run no P·V, and at D = 64 the
    skip_masked_wg build passes blocks): the same bits as the table build, rows without a key
    0 with an LSE of -inf (an acc_O left unzeroed would show there)."""
    import torch

    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import config_for

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("fa3 runs on an sm90 GPU")
    gen = torch.Generator(device="cuda").manual_seed(2)
    b, nq, nk, hq, hkv = 2, 1000, 300, 4, 2
    q = torch.randn(b, nq, hq, d, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", generator=gen).bfloat16() for _ in "kv")
    p = check_inputs(q, k, v, causal=True)
    table = config_for(p)
    out, lse = interface.forward(q, k, v, p, cfg=table)
    out_z, lse_z = interface.forward(q, k, v, p, cfg=dataclasses.replace(table, o_zero_init=True))
    assert torch.equal(out_z, out) and torch.equal(lse_z, lse)
    assert (out[:, : nq - nk] == 0).all() and lse[:, :, : nq - nk].isneginf().all()


def test_rescale_options_ship_where_they_were_measured() -> None:
    """rescale_threshold 8 ships for 16-bit D = 256 alone (its measurement and GPU oracle cases,
    configs._tiles); the fp8 table rescales O when a row's max grows by more than 1 bit, with
    the row max and sum in four chains, at D = 256 and non-causal D = 128 (configs._FP8_SOFTMAX:
    its 142 oracle cases and its timing; 8 bits failed 6 of them) and at causal D = 128 past
    1k keys, every block elsewhere; D = 128's three-WG host-Vᵀ builds (non-causal, and causal
    past 1k keys) permute V's keys, and none takes the other options."""
    import torch

    from flashsuite.fa3.configs import FP8_DTYPE, HEAD_DIMS, get_config
    from flashsuite.fa3.varlen_configs import varlen_config

    for d in HEAD_DIMS:
        for causal in (False, True):
            for dtype in (torch.bfloat16, torch.float16):
                cfg = get_config(d, dtype, causal)
                assert cfg.rescale_threshold == (8 if d == 256 else 0), (d, causal, dtype)
                assert varlen_config(d, dtype, causal).rescale_threshold == cfg.rescale_threshold
                assert not (cfg.skip_unit_rescale or cfg.permute_v_keys or cfg.ex2_emu)
                assert not cfg.row_chains, (d, causal, dtype)
            for n in (1024, 4096, 16384):
                try:
                    cfg = get_config(d, FP8_DTYPE, causal, n)
                except ValueError:  # a head dim without an fp8 entry
                    continue
                # causal D = 128 past FP8_CAUSAL_SHORT's 1k keys takes the non-causal build
                d128_entry = d == 128 and (not causal or n > 1024)
                fp8_softmax = d == 256 or d128_entry
                assert cfg.rescale_threshold == (1 if fp8_softmax else 0), (d, causal, n)
                assert not (cfg.skip_unit_rescale or cfg.ex2_emu)
                assert cfg.row_chains == fp8_softmax, (d, causal, n)
                # V's keys permuted where the three-WG D = 128 tile reads a host Vᵀ
                permuted = d128_entry and cfg.v_transpose == "host"
                assert cfg.permute_v_keys == permuted, (d, causal, n)
                three = permuted or (d == 64 and not causal)
                assert cfg.num_consumer_wgs == (3 if three else 2), (d, causal, n)
