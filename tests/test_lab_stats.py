"""Lab tools' arithmetic on made-up inputs (no GPU, no compile): the paired ratios of the A/B
scripts and the softmax SASS report's dependency-chain depth."""

from __future__ import annotations

import pytest

from benchmarks.ab_stats import paired_ratios
from benchmarks.fa3_softmax_sass import chain_depths


def test_paired_ratios_pair_each_pass_and_order_the_peers() -> None:
    """Each pass's ratio, not the ratio of medians: contender A is 10 % ahead of the peer in
    every pass while the machine drifts by 20 %; a peer over another only as listed."""
    tflops = {("a", 8): [110.0, 132.0, 99.0], ("cudnn", 8): [100.0, 120.0, 90.0],
              ("fa4", 8): [105.0, 126.0, 94.5]}  # fmt: skip
    lines = paired_ratios(tflops, ["cudnn", "fa4"])
    assert any(line.strip().startswith("a / cudnn N     8: median 1.100 (min 1.100, max 1.100")
               for line in lines), lines  # fmt: skip
    assert any(line.strip().startswith("fa4 / cudnn") for line in lines), lines
    assert not any(line.strip().startswith("cudnn / fa4") for line in lines), lines
    assert len(lines) == 3, lines  # a / cudnn, fa4 / cudnn, a / fa4


def test_chain_depths_follow_registers_not_listing_order() -> None:
    """One chain of three FMNMX through R1 (interleaved with an independent pair), a register
    overwritten by another instruction breaking its chain, and two FADD chains of two."""
    listing = "\n".join(
        f"        /*{16 * i:04x}*/                   {text} ;"
        for i, text in enumerate([
            "FMNMX R1, R10, R11, !PT",
            "FMNMX R2, R12, R13, !PT",
            "FMNMX R1, R14, R1, !PT",
            "FMNMX R3, R2, R15, !PT",
            "FMNMX R1, R16, R1, !PT",
            "MOV R3, R20",
            "FMNMX R4, R3, R17, !PT",
            "FADD R5, R1, R2",
            "FADD R6, R5, R3",
            "FADD R7, RZ, R8",
            "FADD R9, R7, -R7",
        ])
    )  # fmt: skip
    assert chain_depths(listing) == {"fmnmx": 3, "fadd": 2}


def test_softmax_bound_cuts_edit_online_softmax_once() -> None:
    """benchmarks/softmax_bound's cuts find each of their texts in online_softmax exactly once
    (the tool refuses otherwise) and leave Python that compiles; `none` is the source itself."""
    pytest.importorskip("cutlass")
    from benchmarks.softmax_bound import CUTS, patched_source

    base = patched_source("none")
    for cut, edit in CUTS.items():
        src = patched_source(cut)
        compile(src, f"online_softmax_{cut}", "exec")
        if edit is None:
            assert src == base
        for old, new in edit or ():
            assert src.count(new) == 1 and old not in src.replace(new, "")
            src = src.replace(new, old)
        assert src == base
