"""The oracle itself, FLOP/byte counting, and the tolerance check."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from flashsuite.common.flops import attention_flops, attention_min_bytes, visible_pairs
from flashsuite.common.reference import attention_reference, visibility_mask
from flashsuite.common.testing import compare


def test_reference_matches_pytorch_sdpa() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 33, 4, 16), torch.randn(2, 33, 2, 16), torch.randn(2, 33, 2, 8)
    out, lse = attention_reference(q, k, v, causal=True, compute_dtype=torch.float64)
    want = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, want)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, 2)) / 4
    s = s.masked_fill(~visibility_mask(33, 33, causal=True), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


def test_visibility_mask_brute_force() -> None:
    for nq, nk, causal, window in [
        (5, 9, True, (-1, -1)),
        (9, 5, True, (-1, -1)),
        (7, 7, False, (2, 1)),
        (6, 10, False, (0, 3)),
    ]:
        left, right = window
        if causal:
            right = 0
        mask = visibility_mask(nq, nk, causal=causal, window_size=window)
        for i in range(nq):
            for j in range(nk):
                d = i + nk - nq
                want = (right < 0 or j <= d + right) and (left < 0 or j >= d - left)
                assert bool(mask[i, j]) == want, (nq, nk, causal, window, i, j)
        assert visible_pairs(nq, nk, causal, window) == int(mask.sum())


def test_reference_empty_rows_are_zero_with_neg_inf_lse() -> None:
    q, k, v = torch.randn(1, 6, 1, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    out, lse = attention_reference(q, k, v, causal=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[..., :4]).all() and torch.isfinite(lse[..., 4:]).all()


def test_reference_softcap_and_fp8() -> None:
    q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    out, _ = attention_reference(q, k, v, softcap=1e-4)  # |s| <= 1e-4: uniform to ~2e-4
    torch.testing.assert_close(out, v.mean(1, keepdim=True).expand_as(out), atol=1e-3, rtol=0)
    f8 = torch.float8_e4m3fn
    ds = torch.full((1, 2), 0.5)
    out8, _ = attention_reference(q.to(f8), k.to(f8), v.to(f8), descale_v=ds)
    plain, _ = attention_reference(q.to(f8).float(), k.to(f8).float(), v.to(f8).float())
    torch.testing.assert_close(out8, plain * 0.5)


def test_flops_conventions() -> None:
    full = attention_flops(2, 16, 1024, 1024, 128)
    assert full == 4 * 2 * 16 * 1024 * 1024 * 128
    causal = attention_flops(2, 16, 1024, 1024, 128, causal=True)
    assert causal == pytest.approx(full / 2, rel=2e-3)
    assert attention_flops(2, 16, 1024, 1024, 128, backward=True) == 2.5 * full
    windowed = attention_flops(1, 1, 100, 100, 64, window_size=(9, 0))
    assert windowed == 4 * 64 * (10 * 100 - 45)
    assert visible_pairs(4, 10, causal=True) == 7 + 8 + 9 + 10


def test_min_bytes() -> None:
    fwd = attention_min_bytes(1, 2, 1, 10, 20, 8, elem_size=2)
    assert fwd == (10 * 2 * 8 + 20 * 8 + 20 * 8 + 10 * 2 * 8) * 2 + 2 * 10 * 4
    bwd = attention_min_bytes(1, 2, 1, 10, 20, 8, elem_size=2, backward=True)
    assert bwd > fwd


def test_compare_semantics() -> None:
    ref = torch.tensor([1.0, -math.inf, 2.0], dtype=torch.float64)
    pt = torch.tensor([1.01, -math.inf, 2.0])
    assert compare("out", torch.tensor([1.025, -math.inf, 2.0]), ref, pt).ok  # within 3x, 2.5x
    assert not compare("out", torch.tensor([1.05, -math.inf, 2.0]), ref, pt).ok  # max > 3x
    assert not compare("out", torch.tensor([1.0, 0.0, 2.0]), ref, pt).ok  # -inf must stay -inf
    assert not compare("out", torch.tensor([math.nan, -math.inf, 2.0]), ref, pt).ok  # NaN never
    with pytest.raises(AssertionError, match="lse: expected float32"):
        compare("lse", torch.tensor([1.0], dtype=torch.bfloat16), ref[:1], pt[:1])


def test_compare_catches_drift_that_the_max_lets_through() -> None:
    """A 1 % drift on every element, or an LSE shifted by 0.01, is beyond 2.5x the mean error
    of the input dtype's rounding (whatever the max says)."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=gen, dtype=torch.float64)
    pt = ref.to(torch.bfloat16)  # the input dtype's rounding: mean error ~ 2^-10 |x|
    assert compare("out", ref.to(torch.bfloat16), ref, pt).ok
    res = compare("out", (ref * 1.01).to(torch.bfloat16), ref, pt)
    assert res.mean_err > res.mean_bound, res
    lse = torch.randn(4096, generator=gen, dtype=torch.float64) + 5
    assert not compare("lse", (lse + 0.01).float(), lse, lse.float()).ok


def test_traffic_models_follow_the_loop_orders() -> None:
    from flashsuite.common import traffic

    b, h, n, d, e = 1, 1, 1024, 64, 2
    fa2 = traffic.fa2_forward(b, h, n, n, d, e, 128, 64)
    assert fa2.read == n * d * e + (n // 128) * n * 2 * d * e  # Q once, K/V once per Q tile
    assert fa2.written == n * d * e + n * 4  # O and LSE once
    fa1 = traffic.fa1_forward(b, h, n, n, d, e, 32, 256)
    tc = n // 256
    assert fa1.written == (tc - 1) * n * (d + 2) * 4 + n * (d * e + 4)  # state per K/V block
    # FA1's writes grow with N²/BN; FA2's do not grow with N² at all.
    big1 = traffic.fa1_forward(b, h, 4 * n, 4 * n, d, e, 32, 256)
    big2 = traffic.fa2_forward(b, h, 4 * n, 4 * n, d, e, 128, 64)
    assert big1.written > 15 * fa1.written and big2.written == 4 * fa2.written
    naive = traffic.naive_forward(b, h, n, n, d, e)
    assert naive.written >= 2 * n * n * e  # S and P go through HBM
    floor = traffic.compulsory_forward(b, h, n, n, d, e)
    assert floor.read == 3 * n * d * e and floor.written == fa2.written
    assert all(m.read >= floor.read for m in (fa1, fa2, naive))


def test_traffic_model_launches_fa1s_q_splits() -> None:
    from flashsuite.common import traffic
    from flashsuite.fa1 import configs

    for bh, n, sms in ((16, 16384, 132), (128, 2048, 132), (1024, 512, 132), (3, 100, 8)):
        nqb = -(-n // 32)
        assert traffic._splits(bh, n, 32, sms) == configs.q_splits(bh, nqb, sms)


def test_hang_watchdog_ends_a_hung_process_and_lets_a_quick_one_go() -> None:
    """The GPU scripts' guard against barrier hangs: past its deadline the process exits with
    every thread's traceback; within it, nothing happens."""
    import subprocess
    import sys

    code = (
        "import time\n"
        "from flashsuite.common.testing import hang_watchdog\n"
        "with hang_watchdog({s}):\n"
        "    time.sleep({t})\n"
        "print('finished')\n"
    )
    hung = subprocess.run(
        [sys.executable, "-c", code.format(s=0.5, t=30)], capture_output=True, text=True, timeout=25
    )
    assert hung.returncode != 0 and "finished" not in hung.stdout
    assert "Timeout" in hung.stderr, hung.stderr[-500:]  # faulthandler's dump
    quick = subprocess.run(
        [sys.executable, "-c", code.format(s=5, t=0.1)], capture_output=True, text=True, timeout=25
    )
    assert quick.returncode == 0 and "finished" in quick.stdout, quick.stderr[-500:]
    # FLASHSUITE_HANG_SCALE stretches the deadline (sanitizer runs): 0.5 s x 20 outlasts 1 s.
    env = {**os.environ, "FLASHSUITE_HANG_SCALE": "20"}
    scaled = subprocess.run(
        [sys.executable, "-c", code.format(s=0.5, t=1)],
        capture_output=True,
        text=True,
        timeout=25,
        env=env,
    )
    assert scaled.returncode == 0 and "finished" in scaled.stdout, scaled.stderr[-500:]


def test_ncu_csv_is_split_into_cases_at_the_marker_kernels() -> None:
    """common/ncu.py: the GPU scripts' ncu parsing (kernels before the first marker dropped,
    thousands separators and units read)."""
    from flashsuite.common import ncu

    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'

    def row(i, name, metric, unit, value):
        return f'"{i}","{name}","S","{metric}","{unit}","{value}"'

    stdout = "\n".join(
        [
            "==PROF== Connected to process",
            head,
            row(0, "warmup_leftover", "dram__bytes_read.sum", "byte", "5"),
            row(1, ncu.MARKER, "dram__bytes_read.sum", "byte", "1"),
            row(2, "attn_fwd", "dram__bytes_read.sum", "Kbyte", "1,500"),
            row(2, "attn_fwd", "Duration", "us", "12.5"),
            row(3, "lse_fix", "dram__bytes_read.sum", "byte", "250"),
            row(4, ncu.MARKER, "dram__bytes_read.sum", "byte", "1"),
            row(5, "attn_fwd", "dram__bytes_read.sum", "Mbyte", "2"),
        ]
    )
    cases = ncu.cases(stdout)
    assert [[k["name"] for k in c] for c in cases] == [["attn_fwd", "lse_fix"], ["attn_fwd"]]
    scales = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6}
    read = [sum(ncu.value(k["metrics"]["dram__bytes_read.sum"], scales) for k in c) for c in cases]
    assert read == [1_500_250.0, 2_000_000.0]
    assert cases[0][0]["metrics"]["Duration"] == ("12.5", "us")


def test_ncu_source_page_is_summed_per_kernel_opcode_and_instruction() -> None:
    """common/ncu.py: the source page's warp-state samples, per kernel (the busiest first),
    per opcode (predicate and modifiers dropped) and per instruction; the not-issued column
    is not mistaken for the all-samples one; the kernel named by a plain line before its block
    or by ncu's "Kernel Name" CSV line."""
    from flashsuite.common import ncu

    head = '"# Address","Source","Warp Stall Sampling (Not-issued Samples)",'
    head += '"Warp Stall Sampling (All Samples)"'
    text = "\n".join(
        [
            "  small_kernel",
            head,
            '"0x10","MUFU.EX2 R1, R2","5","10"',
            '"Kernel Name","main_kernel",',
            head,
            '"0x100","@P0 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24","1,100","1,200"',
            '"0x110","FFMA R1, R2, R3, R4","200","300"',
            '"0x120","@!P1 HGMMA.64x128x16.F32.BF16 R88, R8, gdesc[UR8]","0","0"',
            '"0x130","BAR.SYNC.DEFER_BLOCKING 0x1, 0x100","500","500"',
        ]
    )
    blocks = ncu.source_blocks(text)
    assert [len(b["rows"]) for b in blocks] == [1, 4]
    assert blocks[1]["title"].startswith("main_kernel")
    summary = ncu.source_summary(text, top=2).splitlines()
    assert summary[0].startswith("== main_kernel") and "2000 samples" in summary[0]
    assert summary[1] == "  by opcode: HGMMA 60.0%, BAR 25.0%, FFMA 15.0%"
    assert "60.0%" in summary[2] and "0x100" in summary[2] and "0x130" in summary[3]
    assert summary[4].startswith("== small_kernel") and "MUFU 100.0%" in summary[5]
    assert ncu.source_summary("no csv here") == "no source page with warp-state samples found\n"


def test_ncu_source_page_stall_reasons_are_summed_per_kernel_and_instruction() -> None:
    """common/ncu.py: the "stall_*" columns (not their not-issued twins) are kept per row,
    summed per kernel as shares of its samples and named per instruction, largest first."""
    from flashsuite.common import ncu

    head = '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier",'
    head += '"stall_mio","stall_barrier (Not Issued)"'
    text = "\n".join(
        [
            '"Kernel Name","k",',
            head,
            '"0x10","STS.128 [R4], R24","100","10","90","1,000"',
            '"0x20","BAR.SYNC 0x1, 0x100","300","300","0","7"',
        ]
    )
    ((block),) = ncu.source_blocks(text)
    assert block["rows"][0][3] == {"barrier": 10.0, "mio": 90.0}
    summary = ncu.source_summary(text).splitlines()
    assert summary[2] == "  by stall: barrier 77.5%, mio 22.5%"
    assert summary[3].endswith("BAR.SYNC 0x1, 0x100  [barrier 300]")
    assert summary[4].endswith("STS.128 [R4], R24  [mio 90, barrier 10]")
