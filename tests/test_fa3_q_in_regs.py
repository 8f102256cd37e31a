"""Q·Kᵀ with Q in registers (`Fa3Config.q_in_regs`): the RS wgmma reads Q from the registers
ldmatrix filled once a tile instead of from shared memory at every K block.

On the CPU: the refusals (fp8, head_dim > 128, three consumer warpgroups, whose 160 registers
a thread spill with Q in them). The builds compile for sm_90a with every wgmma reading its A
operand from registers and 0 spills (benchmarks/fa3_variants.py, `pytest -m lab
tests/test_fa3_compile.py -k q-in-regs`; their loops: tests/test_fa3_softmax_overlap.py). On
a GPU: the same bits as the table's builds (the same products in the same order) and the
float64 oracle, on the plain grid, causal, D = 64 on two warpgroups and the persistent build,
with one Q buffer (released once loaded) and with two.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashsuite.fa3.configs import FP8_DTYPE, Fa3Config, can_implement


@pytest.mark.parametrize(
    ("cfg", "d", "dtype", "what"),
    [
        (Fa3Config(q_in_regs=True), 128, FP8_DTYPE, "float8_e4m3fn"),
        (Fa3Config(q_in_regs=True), 192, torch.bfloat16, "head_dim 192"),
        (Fa3Config(tile_m=192, num_consumer_wgs=3, q_in_regs=True), 64, torch.bfloat16, "3 WGs"),
    ],
)
def test_q_in_regs_refusals_name_the_field(cfg, d: int, dtype, what: str) -> None:
    ok, why = can_implement(cfg, d, dtype)
    assert not ok and "q_in_regs" in why and what in why, why


def test_q_in_regs_builds_where_it_is_meant_to() -> None:
    for d in (64, 96, 128):
        assert can_implement(Fa3Config(q_in_regs=True), d, torch.bfloat16)[0]
        assert can_implement(Fa3Config(q_in_regs=True), d, torch.float16)[0]


# The persistent build as Q in registers takes it: the softmax in place, no mask test in the
# loop (with the softmax apart the compiler computes most exponentials twice there).
_V2 = dict(
    persistent=True, overlap_tiles=True, balanced_order=True, o_alias_q=False, lse_tma=True,
    softmax_apart=False, loop_mask_test=False,
)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("d", "causal", "changes"),
    [
        pytest.param(128, False, {}, id="D128"),
        pytest.param(128, True, {}, id="D128-causal"),
        pytest.param(64, False, dict(tile_m=128, num_consumer_wgs=2), id="D64-two-wgs"),
        pytest.param(128, False, dict(_V2, q_stages=2), id="D128-persistent-two-q"),
        pytest.param(128, False, _V2, id="D128-persistent-q-released-at-load"),
    ],
)
def test_gpu_q_in_registers_gives_the_same_bits(d: int, causal: bool, changes) -> None:
    """B 4 x 1500 queries x 1100 keys, GQA 16 / 4 (768 row tiles, a partial last one; causal:
    the first 400 rows see no key): Q·Kᵀ from registers equals Q·Kᵀ from shared memory bit for
    bit and passes the float64 oracle. With one Q buffer on the persistent scheduler each warp
    releases sQ once Q is in its registers, and the next tile's Q lands under this tile's loop
    (about 6 tiles a CTA here): a release too early would show as another tile's Q."""
    from flashsuite.fa3.configs import config_for
    from tests.test_fa3_q_stages import _gpu_problem, _same_bits

    q, k, v, p, opts = _gpu_problem(d, torch.bfloat16, causal, 8)
    base = dataclasses.replace(config_for(p), **changes)
    _same_bits(q, k, v, p, opts, base, dict(q_in_regs=True), oracle=True)


@pytest.mark.parametrize(
    ("changes", "persistent", "sections"),
    [
        pytest.param({}, True, True, id="bf16"),
        pytest.param(dict(dtype=torch.float16), True, True, id="fp16"),
        pytest.param(dict(nq=1030), False, False, id="seqlen_q-not-a-multiple-of-4"),
        pytest.param(dict(causal=True), False, False, id="causal"),
        pytest.param(dict(softcap=30.0), False, False, id="softcap"),
        pytest.param(dict(window_size=(256, 0)), False, False, id="window"),
        pytest.param(dict(d=64), False, True, id="D64"),
        pytest.param(dict(d=64, nk=1024), True, True, id="D64-short"),
        pytest.param(dict(d=64, nk=1024, nq=1030), False, True, id="D64-short-nq-not-4"),
        pytest.param(dict(d=64, nk=8192), False, False, id="D64-long"),
        pytest.param(dict(fp8=True), False, False, id="e4m3"),
    ],
)
def test_dense_runs_the_persistent_q_in_registers_build(changes, persistent, sections) -> None:
    """config_for gives dense non-causal 16-bit D = 128 problems, and D = 64 ones up to
    SHORT_SEQLEN_K keys (on two warpgroups' 128-row tiles), with seqlen_q % 4 == 0 and no
    softcap or window, the persistent build with Q in registers and 8 MiB L2 sections; other
    dense D = 64 problems up to SECTIONS_MAX_SEQLEN_K keys the v2 build with those sections
    (longer ones, not timed with it, the plain grid); every other problem what it ran
    before: Nq % 4 != 0 cannot take the LSE's TMA store, softcap and windowed problems keep
    the builds the GPU suite checked with them, causal its own entry. explain() names it."""
    from flashsuite.common.fp8 import quantize_e4m3
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import interface
    from flashsuite.fa3.configs import L2_SECTION_MIB, config_for

    c = dict(dtype=torch.bfloat16, nq=1024, nk=2048, d=128, causal=False, fp8=False)
    c.update(changes)
    opts = {k: c.pop(k) for k in ("softcap", "window_size") if k in c}
    q = torch.randn(2, c["nq"], 4, c["d"], dtype=c["dtype"])
    k = torch.randn(2, c["nk"], 4, c["d"], dtype=c["dtype"])
    if c["fp8"]:
        (q, dq), (k, dk) = quantize_e4m3(q), quantize_e4m3(k)
        opts.update(descale_q=dq, descale_k=dk, descale_v=dk)
    p = check_inputs(q, k, k, causal=c["causal"], **opts)
    cfg = config_for(p)
    taken = cfg.persistent and cfg.q_in_regs and cfg.lse_tma and not cfg.o_alias_q
    assert taken == persistent, cfg
    assert not taken or cfg.num_consumer_wgs == 2, cfg
    assert (cfg.l2_section_mib == L2_SECTION_MIB) == sections, cfg
    assert not sections or cfg.persistent, cfg
    ok, reason = interface.supports(p, 90)
    assert ok and ("Q in registers" in reason) == persistent, reason


def test_ab_variants_can_start_from_the_table_entry() -> None:
    """`fa3_fwd_ab --variant NAME:table=1,...` times the table's entry (get_config), the build
    a dense problem ran before config_for's dense choices; a bad table value, or table=1 in a
    tool that replaces fields of its own config, is refused by name."""
    from benchmarks.fa3_fwd_ab import parse_variant, variant_config
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3.configs import config_for, get_config

    q = torch.zeros(1, 1024, 2, 64, dtype=torch.bfloat16)
    p = check_inputs(q, q, q)
    table = get_config(64, q.dtype, False, 1024)
    name, changes = parse_variant("plain:table=1,stages=2")
    assert name == "plain" and variant_config(p, changes) == dataclasses.replace(table, stages=2)
    assert variant_config(p, parse_variant("same:")[1]) == config_for(p) != table
    with pytest.raises(ValueError, match="table=1"):
        parse_variant("x:table=1", table_ok=False)
    with pytest.raises(ValueError, match="table expected 0 or 1, got 'yes'"):
        parse_variant("x:table=yes")
    with pytest.raises(ValueError, match="not in Fa3Config"):
        parse_variant("x:tabel=1")
