"""fa3's own varlen backward (packed sequences: fa3/bwd_varlen.py on the dense backward's loops).

On the CPU: the packed-sequence builds of `benchmarks/fa3_bwd_probe.py --varlen` compile for
sm_90a (both loops, windows, softcap, the atomic dQ route) with the dense builds' wgmma counts,
the sequence search's ballot and no spills; varlen is part of the backward's compile key; the
preprocess writes every padded row (LSE in base 2, D = rowsum(dO·O), +inf / 0 on padding); the
host path around a stand-in kernel that keeps the compiled one's argument contract (the padded
LSE / D / dQ rows, cu_seqlens, window scalars of the totals); and dispatch's wiring: fa3's
own varlen backward by default (bwd_configs.VARLEN_BWD_AUTO), fa2's with that default off
unless FLASHSUITE_FA3_VARLEN_BWD=1, refused under FLASHSUITE_FA3_BWD=0; under deterministic
algorithms the ordered build (turn counters per padded row block, started at each sequence's
first visiting column block).
On an sm90 GPU: dq, dk, dv against the per-sequence float64 oracle (common.testing.compare),
written into views of NaN-filled buffers whose guard rows must stay NaN, inputs read from views
with NaN guard rows; lengths 0 to 1000, Lq != Lk, GQA / MQA, causal, windows, softcap, every
head_dim, random batch compositions with empty sequences; autograd through dispatch.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.arch import override_arch
from flashsuite.common.reference import visibility_mask
from flashsuite.common.validation import check_varlen_inputs
from flashsuite.dispatch import registry
from tests.conftest import GPU_MEMORY, HAS_CUDA
from tests.test_fa3_varlen import (
    EDGE_K,
    EDGE_Q,
    GUARD,
    MIXED_K,
    MIXED_Q,
    _bounds,
    _check,
    _oracle_pieces,
    _packed,
    gpu_fa3,
    needs_dsl,
)

F16, BF16 = torch.float16, torch.bfloat16


# ------------------------------------------------------------------------------------------
# CPU: compile for sm_90a
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def varlen_probes(tmp_path_factory) -> list[dict]:
    from tests.test_fa3_bwd_compile import SHARDS, _probe_in_parallel

    runs = [["--varlen", "--shard", f"{i}/{SHARDS}"] for i in range(SHARDS)]
    return _probe_in_parallel(tmp_path_factory.mktemp("fa3_bwd_probe_varlen"), runs)


@needs_dsl
def test_varlen_bwd_compiles_with_hopper_machinery(varlen_probes) -> None:
    from benchmarks.fa3_bwd_probe import varlen_cases
    from tests.test_fa3_bwd_compile import _assert_fits_registers, _expected_wgmma

    assert len(varlen_probes) == len(varlen_cases())
    for r in varlen_probes:
        ptx, d, cfg = r["ptx"], r["head_dim"], r["config"]
        where = f"varlen D{d} causal={r['causal']} softcap={r['softcap']} local={r['local']}"
        assert r["varlen"], where
        assert (ptx["wgmma"], ptx["wgmma_rs"]) == _expected_wgmma(d, cfg), f"{where}: {ptx}"
        assert ptx["tma_load"] >= 6 and ptx["setmaxnreg"] == 2, f"{where}: {ptx}"
        assert ptx["vote_ballot"] >= 1, f"{where}: no ballot (the column block's sequence)"
        if cfg["dq_mode"] == "warp":  # one bulk reduce per tile, or per warpgroup's chunk
            bulk = 2 if cfg["dq_handoff"] == "wg" else 1
            assert ptx["dq_bulk"] == bulk and ptx["dq_atomic"] == 0, f"{where}: {ptx}"
        else:
            assert ptx["dq_bulk"] == 0 and ptx["dq_atomic"] > 0, f"{where}: {ptx}"
        # dK and dV by TMA stores through the ragged views ("dkv_t", dkv_tma), else from
        # registers with a row bound (the softcap builds of "sdp_t").
        if cfg["layout"] == "dkv_t" or cfg["dkv_tma"]:
            assert ptx["tma_store"] >= 2, f"{where}: {ptx}"
        else:
            assert ptx["tma_store"] == 0, f"{where}: {ptx}"
        assert (ptx["tanh"] > 0) == r["softcap"], f"{where}: {ptx}"
        if cfg["deterministic"]:  # the turn's acquiring spin (maybe peeled) and its release
            assert ptx["sem_acquire"] >= 1 and ptx["sem_release"] == 1, f"{where}: {ptx}"
        else:
            assert ptx["sem_acquire"] == ptx["sem_release"] == 0, f"{where}: {ptx}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (where, r["ptxas_lines"])
        _assert_fits_registers(r)
        for code in ("C7508", "C7512", "C7515", "C7519"):
            assert code not in r["remarks"], f"{where}: ptxas remark {code}"


@needs_dsl
@pytest.mark.parametrize(
    ("causal", "window"), [(False, (-1, -1)), (True, (-1, -1)), (True, (100, 0)), (False, (70, 30))]
)
def test_varlen_turn_counters_start_at_each_sequences_first_column_block(causal, window) -> None:
    """bwd_host.varlen_turn_counters against the kernel's own row-block ranges
    (BwdBlocks.row_blocks, called with each sequence's lengths): every row block some column
    block of its sequence visits has its counter, at padded block Q_b + m, start at the first
    of those column blocks, and they are consecutive; empty sequences, Lq above and below Lk,
    one counter row per query head."""
    from types import SimpleNamespace

    from flashsuite.fa3.bwd_blocks import BwdBlocks
    from flashsuite.fa3.bwd_host import varlen_turn_counters
    from flashsuite.fa3.compile import kernel_scalars

    lens_q, lens_k = [70, 0, 300, 1, 129, 64], [64, 5, 100, 0, 700, 200]
    cq, ck = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
              for ls in (lens_q, lens_k))  # fmt: skip
    tm, tn = 64, 128
    key = SimpleNamespace(cfg=SimpleNamespace(tile_m=tm, tile_n=tn), local=window != (-1, -1),
                          causal=causal)  # fmt: skip
    total_q, total_k = int(cq[-1]), int(ck[-1])
    sem = varlen_turn_counters(key, 3, cq, ck, window, total_q, total_k)
    assert sem.dtype == torch.int32 and sem.shape[0] == 3 and bool((sem == sem[0]).all())
    blocks = SimpleNamespace(TILE_M=tm, TILE_N=tn, LOCAL=key.local, CAUSAL=causal)
    win = kernel_scalars(1.0, 0.0, window, causal, total_q, total_k)[2:] if key.local else None
    row_blocks = BwdBlocks.row_blocks.__wrapped__
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
        first_block = (int(cq[b]) + b * tm) // tm  # Q_b: the padded rows' layout
        visits: dict[int, list[int]] = {}
        for n in range(-(-nk // tn)):
            m_min, count, _ = row_blocks(blocks, n, nq, nk, 1, win)
            for m in range(m_min, m_min + count):
                visits.setdefault(m, []).append(n)
        for m, ns in visits.items():
            assert ns == list(range(ns[0], ns[0] + len(ns))), (b, m, ns)
            assert int(sem[0, first_block + m]) == ns[0], (b, m, ns, sem[0])


def test_varlen_is_part_of_the_backward_compile_key() -> None:
    from flashsuite.fa3 import disk_cache
    from flashsuite.fa3.bwd_configs import bwd_config_for
    from flashsuite.fa3.bwd_host import BwdCompileKey

    cfg = bwd_config_for(128, BF16, True, varlen=True)
    dense, packed = (BwdCompileKey(BF16, 128, True, cfg, varlen=v) for v in (False, True))
    assert dense != packed and hash(dense) != hash(packed)
    assert "varlen=True" in disk_cache.key_text(packed)


@needs_dsl
def test_varlen_kernel_refuses_lpt_head_section_and_ordered_bulk_adds() -> None:
    """lpt and head_section order a dense grid; the deterministic build's ordered dQ takes the
    MMA threads' atomics ("det") on packed sequences, not the writer warp's bulk adds
    ("det_pipe")."""
    import cutlass

    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.fa3.bwd_kernel import Fa3Backward

    for name in ("pipe_lpt", "pipe_sec4_tma"):
        with pytest.raises(ValueError, match="varlen takes neither lpt nor head_section"):
            Fa3Backward(cutlass.BFloat16, 128, variant(name), True, varlen=True)
    with pytest.raises(ValueError, match="varlen deterministic needs dq_mode 'atomic'"):
        Fa3Backward(cutlass.BFloat16, 128, variant("det_pipe"), True, varlen=True)
    Fa3Backward(cutlass.BFloat16, 128, variant("det"), True, varlen=True)  # built


# ------------------------------------------------------------------------------------------
# CPU: preprocess, host path and dispatch around a stand-in kernel
# ------------------------------------------------------------------------------------------
def _pad_rows(cu_q: torch.Tensor, tile_m: int) -> list[int]:
    """The first padded row of every sequence, by the layout's definition (bwd_varlen.py)."""
    return [(int(cu_q[b]) + b * tile_m) // tile_m * tile_m for b in range(len(cu_q) - 1)]


@pytest.mark.parametrize("tile_m", [64, 128])
def test_varlen_preprocess_writes_every_padded_row(device, tile_m: int) -> None:
    """Sequence b's rows at its padded rows, whole tile_m blocks no other sequence touches;
    +inf LSE and 0 D on every other row (even past a max_seqlen the caller understated, as
    nothing here reads it); strided dO and O; rows with LSE -inf give +inf."""
    from flashsuite.common.bwd_preprocess import (
        varlen_bwd_preprocess,
        varlen_pad_index,
        varlen_pad_rows,
    )

    lens = [0, 1, 63, 64, 65, 0, 130, 7, 0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total, hq, dv = sum(lens), 3, 72
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(hq, total, dv, generator=gen).to(BF16).transpose(0, 1).to(device)
    dout = torch.randn(total, hq, dv, generator=gen).to(BF16).to(device)
    lse = torch.randn(hq, total, generator=gen)
    lse[1, 5] = float("-inf")
    rows_pad = varlen_pad_rows(total, len(lens), tile_m)
    acc = torch.full((hq, rows_pad, 40), float("nan"), device=device)  # fa3's dQ accumulator
    delta, lse2 = varlen_bwd_preprocess(out, dout, lse.to(device), cu.to(device), tile_m, acc)
    assert (acc == 0).all()  # zeroed by the same launch
    assert delta.shape == lse2.shape == (hq, rows_pad) and rows_pad % tile_m == 0
    idx = varlen_pad_index(cu.to(device), total, tile_m).cpu()
    want_idx = [p + i for p, n in zip(_pad_rows(cu, tile_m), lens, strict=True) for i in range(n)]
    assert idx.tolist() == want_idx
    blocks = [p // tile_m for p in _pad_rows(cu, tile_m)] + [rows_pad // tile_m]
    for b, n in enumerate(lens):  # every sequence's row blocks lie below the next one's first
        assert blocks[b] + -(-n // tile_m) <= blocks[b + 1]
    delta, lse2 = delta.cpu(), lse2.cpu()
    torch.testing.assert_close(delta[:, idx], (out.float() * dout.float()).sum(-1).T.cpu())
    want = torch.where(lse == float("-inf"), float("inf"), lse * math.log2(math.e))
    torch.testing.assert_close(lse2[:, idx], want)
    spare = torch.ones(rows_pad, dtype=torch.bool)
    spare[idx] = False
    assert bool((delta[:, spare] == 0).all()) and bool(torch.isposinf(lse2[:, spare]).all())


def _varlen_contract(key, causal: bool, window: tuple[int, int], seen: list):
    """A stand-in for the compiled varlen backward that keeps its argument contract, in float64
    torch: q, dout (total_q, Hq, D), k, v (total_k, Hkv, D), lse_log2 / dsum (Hq, rows_pad)
    read at each sequence's padded rows only (the rest must be +inf / 0), dQ into the
    accumulator at the padded rows in the config's layout, dK and dV summed over GQA groups."""
    from flashsuite.fa3.bwd_configs import dq_tiled
    from flashsuite.fa3.bwd_host import dq_from_tiles

    def run(q, k, v, dout, lse_log2, dsum, dq_acc, dk, dv, scale_log2, scale, sem, softcap_pre,
            window_left, window_right, cu_q, cu_k):  # fmt: skip
        seen.append((window_left, window_right))
        assert softcap_pre is None
        if key.cfg.deterministic:  # a turn counter per padded row block (window-free: from 0)
            n_pad = lse_log2.shape[1] // key.cfg.tile_m
            assert sem.dtype == torch.int32 and tuple(sem.shape) == (q.shape[1], n_pad)
            assert window != (-1, -1) or not bool(sem.any())
        else:
            assert sem is None
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous()
        tm, (_, hq, d), hkv = key.cfg.tile_m, q.shape, k.shape[1]
        g = hq // hkv
        rows_pad = lse_log2.shape[1]
        used = torch.zeros(rows_pad, dtype=torch.bool, device=q.device)
        dq_pad = torch.zeros(hq, rows_pad, d, dtype=torch.float64, device=q.device)
        for ((q0, q1), (k0, k1)), p0 in zip(_bounds(cu_q, cu_k), _pad_rows(cu_q, tm), strict=True):
            nq, nk = q1 - q0, k1 - k0
            used[p0 : p0 + nq] = True
            qh, doh = (t[q0:q1].double().transpose(0, 1) for t in (q, dout))  # (Hq, nq, D)
            kh, vh = (t[k0:k1].double().transpose(0, 1).repeat_interleave(g, 0) for t in (k, v))
            s = qh @ kh.transpose(-1, -2) * scale_log2  # (Hq, nq, nk), base 2
            vis = visibility_mask(nq, nk, causal=causal, window_size=window)
            s = s.masked_fill(~vis.to(s.device), float("-inf"))
            lse_s, d_s = (t[:, p0 : p0 + nq, None].double() for t in (lse_log2, dsum))
            p = torch.exp2(s - lse_s)  # +inf LSE: P = 0
            # scale_out: dS and the dQ accumulator without the softmax scale (the host's dQ
            # pass applies it), dK with it
            ds_scale, dk_scale = (1.0, scale) if key.cfg.scale_out else (scale, 1.0)
            ds = p * (doh @ vh.transpose(-1, -2) - d_s) * ds_scale
            dq_pad[:, p0 : p0 + nq] = ds @ kh
            grad_k = (ds.transpose(-1, -2) @ qh).view(hkv, g, nk, d).sum(1).transpose(0, 1)
            grad_k = grad_k * dk_scale
            grad_v = (p.transpose(-1, -2) @ doh).view(hkv, g, nk, d).sum(1).transpose(0, 1)
            dk[k0:k1], dv[k0:k1] = grad_k.to(dk.dtype), grad_v.to(dv.dtype)
        assert bool(torch.isposinf(lse_log2[:, ~used]).all()) and bool((dsum[:, ~used] == 0).all())
        if not dq_tiled(key.cfg):  # (total_q, Hq, D): the used rows in packed order
            dq_acc.copy_(dq_pad[:, torch.nonzero(used).flatten()].transpose(0, 1))
            return
        # The tile order's offset of each (row, col): dq_from_tiles (checked against
        # dq_tile_modes by test_fa3_bwd_compile) applied to the offsets themselves.
        offsets = torch.arange(tm * d, dtype=torch.float64, device=q.device).view(1, 1, tm, d)
        tile = dq_from_tiles(offsets, tm, tm, key.cfg.num_mma_wgs, torch.float64, key.cfg.dq_split)
        tile = tile.flatten().long()  # (tm * d,) in (row, col) order
        dq_acc.view(hq, -1, tm * d)[..., tile] = dq_pad.view(hq, -1, tm * d).float()

    return run


VARLEN_HOST_CASES = [
    # (tile_m, dq_mode, causal, window, lens_q, lens_k, Hq, Hkv, D)
    (64, "warp", True, (-1, -1), [5, 0, 70, 1, 64], [9, 4, 50, 0, 64], 4, 2, 64),
    (128, "warp", False, (-1, -1), [130, 3, 0], [20, 300, 5], 2, 1, 64),
    (64, "warp", False, (8, 3), [40, 17, 65], [33, 80, 65], 4, 4, 128),
    (64, "atomic", True, (-1, -1), [66, 0, 7], [3, 9, 70], 4, 2, 64),
    (64, "warp", True, (-1, -1), [70, 2, 0], [100, 1, 3], 2, 2, 256),  # "dkv_t": the same host
    # "+sout": scale_out (FA4's D 64 route, bwd_configs.VARLEN_DENSE_ROUTES): the host scales dQ
    (128, "warp+sout", True, (-1, -1), [130, 0, 77], [90, 3, 200], 4, 2, 64),
]


@pytest.mark.parametrize("case", VARLEN_HOST_CASES)
def test_run_varlen_backward_host_path(monkeypatch, device, case) -> None:
    """The host side of fa3's varlen backward around a stand-in kernel: the padded LSE / D
    rows, the accumulator's layout, dQ gathered back to the packed rows, window scalars from
    the totals, dk / dv of sequences without rows (0) and rows without keys (dq 0); gradients
    against autograd of the float64 per-sequence oracle."""
    from dataclasses import replace

    from flashsuite.common.reference import attention_reference
    from flashsuite.fa3 import bwd_host
    from flashsuite.fa3.bwd_configs import BwdConfig, bwd_config_for
    from flashsuite.fa3.compile import kernel_scalars

    tile_m, dq_mode, causal, window, lens_q, lens_k, hq, hkv, d = case
    dq_mode, _, extra = dq_mode.partition("+")
    cfg = BwdConfig(tile_m=tile_m, dq_mode=dq_mode, scale_out=extra == "sout")
    if d > 128:
        cfg = replace(bwd_config_for(d, BF16, causal))
    local = window != (-1, -1)
    key = bwd_host.BwdCompileKey(torch.float32, d, causal, cfg, local=local, varlen=True)
    seen: list = []
    monkeypatch.setattr(
        bwd_host, "get_backward", lambda k: _varlen_contract(k, causal, window, seen)
    )
    q, k, v, cq, ck = _packed(lens_q, lens_k, hq, hkv, d, torch.float64, seed=2, grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    outs, lses, wants = [], [], [torch.zeros_like(t) for t in (q, k, v)]
    for (q0, q1), (k0, k1) in _bounds(cq, ck):
        if k1 == k0:  # no keys: out 0, LSE -inf, no gradient
            outs.append(q.new_zeros(q1 - q0, hq, d))
            lses.append(q.new_full((hq, q1 - q0), float("-inf")))
            continue
        o, s = attention_reference(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, window_size=window
        )
        grads = torch.autograd.grad(o, (q, k, v), dout[None, q0:q1], allow_unused=True)
        for w, g in zip(wants, grads, strict=True):
            w += 0 if g is None else g
        outs.append(o.detach()[0])
        lses.append(s.detach()[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=1).float()
    args = [t.detach().float().to(device) for t in (dout, q, k, v, out)]
    scale = d**-0.5
    got = bwd_host.run_varlen_backward(
        key, *args, lse.to(device), cq.to(device), ck.to(device), scale, window=window
    )
    if local:
        assert seen == [kernel_scalars(scale, 0.0, window, causal, sum(lens_q), sum(lens_k))[2:]]
    for name, a, w in zip(("dq", "dk", "dv"), got, wants, strict=True):
        assert a.shape == w.shape and a.is_contiguous(), name
        torch.testing.assert_close(a.double().cpu(), w, rtol=1e-4, atol=1e-4, msg=name)


@pytest.fixture
def stand_ins(monkeypatch):
    """fa3's varlen forward and backward binaries replaced by stand-ins (the forward's from
    tests/test_fa3_varlen.py, the backward's above), planned for sm90 on this machine."""
    from flashsuite.fa3 import bwd_host, interface
    from flashsuite.fa3 import compile as fa3_compile
    from tests.test_fa3_varlen import StandIn

    def make(options: dict) -> list:
        causal, window = options.get("causal", False), options.get("window_size", (-1, -1))
        seen: list = []
        monkeypatch.setattr(fa3_compile, "get_forward", StandIn(options))
        monkeypatch.setattr(
            bwd_host, "get_backward", lambda k: _varlen_contract(k, causal, window, seen)
        )
        return seen

    props = type("Props", (), {"multi_processor_count": 132})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(interface, "_plans", {})
    monkeypatch.delenv("FLASHSUITE_FA3_VARLEN_BWD", raising=False)
    monkeypatch.delenv("FLASHSUITE_FA3_BWD", raising=False)
    return make


@needs_dsl
@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors planned as sm90; the GPU tests run the binary")
def test_dispatch_pairs_fa3s_own_varlen_backward_when_asked(stand_ins, monkeypatch) -> None:
    """version="fa3" with a gradient: fa3's own varlen backward by default (VARLEN_BWD_AUTO),
    fa2's with the default off (explain says why) unless FLASHSUITE_FA3_VARLEN_BWD=1 asks (then
    fa3's, through autograd, against the oracle), fa2's again under FLASHSUITE_FA3_BWD=0 and
    under deterministic algorithms the ordered build, unless bwd_configs.BWD_UNVERIFIED (patched
    here) lists it: then fa2's, unless FLASHSUITE_FA3_VARLEN_BWD=1 asks (its turn counters
    pass the oracle)."""
    from flashsuite.fa3 import bwd_interface, interface

    options = dict(causal=True)
    seen = stand_ins(options)
    q, k, v, cq, ck = _packed([5, 0, 17, 1, 70], [9, 4, 17, 0, 66], 4, 2, 64, F16, grad=True)

    def choice():
        with override_arch(90):
            return dispatch.select_varlen(q, k, v, cq, ck, 70, 66, version="fa3", **options)

    assert choice().backward == "fa3", str(choice())
    monkeypatch.setattr(interface, "OWN_VARLEN_BACKWARD_DEFAULT", False)
    c = choice()
    assert c.backward == "fa2" and "own varlen backward off by default" in str(c), str(c)
    monkeypatch.setenv("FLASHSUITE_FA3_VARLEN_BWD", "1")
    c = choice()
    assert c.backward == "fa3" and "own varlen backward: fa3 varlen backward" in str(c), str(c)
    used = []
    real = interface.varlen_backward
    monkeypatch.setattr(
        interface, "varlen_backward", lambda *a, **kw: used.append(1) or real(*a, **kw)
    )
    with override_arch(90):
        out = dispatch.attention_varlen(q, k, v, cq, ck, 70, 66, version="fa3", **options)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(F16)
    with override_arch(90):
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert used and len(seen) == 1, "fa3's own varlen backward did not run"
    oracle = _oracle_pieces(q, k, v, cq, ck, do, **options)
    _check(dict(dq=dq, dk=dk, dv=dv), oracle, F16)
    monkeypatch.setenv("FLASHSUITE_FA3_BWD", "0")
    c = choice()
    assert c.backward == "fa2" and "FLASHSUITE_FA3_BWD=0" in str(c), str(c)
    monkeypatch.delenv("FLASHSUITE_FA3_BWD")
    monkeypatch.delenv("FLASHSUITE_FA3_VARLEN_BWD")
    monkeypatch.setattr(interface, "OWN_VARLEN_BACKWARD_DEFAULT", True)
    torch.use_deterministic_algorithms(True)
    try:
        c = choice()  # the ordered build, by default where it has run on a GPU
        assert c.backward == "fa3" and "column-block order (deterministic)" in str(c), str(c)
        feature = "deterministic order on packed sequences"
        monkeypatch.setattr(bwd_interface, "BWD_UNVERIFIED", ((64, feature),))
        c = choice()
        assert c.backward == "fa2", str(c)
        assert f"{feature} compiled but not yet run" in str(c), str(c)
        monkeypatch.setenv("FLASHSUITE_FA3_VARLEN_BWD", "1")  # the ordered build, when asked
        c = choice()
        assert c.backward == "fa3" and "column-block order (deterministic)" in str(c), str(c)
        used.clear()
        with override_arch(90):
            out = dispatch.attention_varlen(q, k, v, cq, ck, 70, 66, version="fa3", **options)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        assert used and len(seen) == 2, "fa3's ordered varlen backward did not run"
        _check(dict(dq=dq, dk=dk, dv=dv), oracle, F16)
    finally:
        torch.use_deterministic_algorithms(False)


@needs_dsl
def test_supports_varlen_backward_reasons() -> None:
    from flashsuite.fa3 import interface

    def reason(d=64, arch=90, dtype=BF16, hkv=2, **options):
        q, k, v, cq, ck = _packed([4, 6], [4, 6], 4, hkv, d, dtype)
        return interface.supports_varlen_backward(
            check_varlen_inputs(q, k, v, cq, ck, 6, 6, **options), arch
        )

    ok, why = reason()
    assert ok and why.startswith("fa3 varlen backward: 128x128 tiles"), why
    assert reason(d=256, softcap=5.0)[0] and reason(d=192, window_size=(3, 2))[0]
    assert "needs sm90" in reason(arch=80)[1]
    assert "dtype float32" in reason(dtype=torch.float32)[1]
    assert "head_dim 32 not in" in reason(d=32)[1]


@needs_dsl
def test_varlen_backward_without_rows_or_keys_skips_the_binary(stand_ins) -> None:
    from flashsuite.fa3 import interface

    seen = stand_ins({})
    for lens_q, lens_k in (([0, 0], [3, 4]), ([3, 4], [0, 0])):
        q, k, v, cq, ck = _packed(lens_q, lens_k, 2, 2, 64, BF16)
        vp = check_varlen_inputs(q, k, v, cq, ck, max(lens_q), max(lens_k))
        out = torch.zeros_like(q)
        lse = torch.full((2, q.shape[0]), float("-inf"))
        grads = interface.varlen_backward(out, q, k, v, out, lse, cq, ck, vp)
        for g, t in zip(grads, (q, k, v), strict=True):
            assert g.shape == t.shape and not bool(g.any())
    assert not seen


# ------------------------------------------------------------------------------------------
# GPU: the kernel against the per-sequence oracle
# ------------------------------------------------------------------------------------------
# (lens_q, lens_k, Hq, Hkv, D, dtype, options): both loops, every head_dim, GQA / MQA.
GPU_BWD_CASES = [
    (EDGE_Q, EDGE_K, 4, 4, 128, BF16, dict()),
    (EDGE_Q, EDGE_K, 4, 2, 128, F16, dict(causal=True)),
    (MIXED_Q, MIXED_K, 8, 2, 64, F16, dict(causal=True)),
    (EDGE_Q, EDGE_K, 4, 1, 64, BF16, dict()),
    (MIXED_Q, MIXED_K, 6, 2, 256, BF16, dict(window_size=(64, 0))),
    (EDGE_Q, EDGE_K, 6, 1, 192, BF16, dict(causal=True, window_size=(100, -1))),
    (EDGE_Q, EDGE_K, 4, 2, 96, F16, dict(softcap=30.0, window_size=(32, 16))),
    ([700, 129, 64], [64, 129, 700], 4, 4, 64, BF16, dict(causal=True, softcap=20.0)),
    (MIXED_Q, MIXED_K, 4, 2, 192, F16, dict(softcap=10.0)),
    (MIXED_Q, MIXED_K, 4, 4, 256, BF16, dict(causal=True)),
]


def _guarded(t: torch.Tensor, fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): `t`'s values in the middle of a buffer with GUARD rows of `fill` before
    and after (16-byte aligned: GUARD rows of whole heads)."""
    buf = torch.full((t.shape[0] + 2 * GUARD, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    view = buf[GUARD : GUARD + t.shape[0]]
    view.copy_(t)
    return buf, view


def _run_bwd_guarded(q, k, v, cq, ck, vp, seed: int = 1):
    """fa3's varlen forward, then its own varlen backward on inputs read from views with NaN
    guard rows, writing dq, dk, dv into views of NaN-filled buffers whose guards must stay NaN;
    returns (dout, dq, dk, dv)."""
    from flashsuite.fa3 import interface

    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype).to(q.device)
    out, lse = interface.varlen_forward(q, k, v, cq, ck, vp)
    views = [_guarded(t)[1] for t in (q, k, v, dout, out)]
    bufs = [torch.full((t.shape[0] + 2 * GUARD, *t.shape[1:]), float("nan"), dtype=t.dtype,
                       device=t.device) for t in (q, k, v)]  # fmt: skip
    grads = tuple(b[GUARD:-GUARD] for b in bufs)
    gq, gk, gv, gdo, gout = views
    res = interface.varlen_backward(gdo, gq, gk, gv, gout, lse, cq, ck, vp, grads=grads)
    torch.cuda.synchronize()
    assert all(r is g for r, g in zip(res, grads, strict=True))
    for name, b in zip(("dq", "dk", "dv"), bufs, strict=True):
        assert bool(b[:GUARD].isnan().all()), f"{name}: written before its first row"
        assert bool(b[-GUARD:].isnan().all()), f"{name}: written past its last row"
        assert not bool(b[GUARD:-GUARD].isnan().any()), f"{name}: rows unwritten or NaN"
    return dout, *grads


@pytest.mark.gpu
@gpu_fa3
@pytest.mark.parametrize(
    "case", GPU_BWD_CASES, ids=lambda c: f"D{c[4]}-{c[5]}-{c[6]}".replace(" ", "")
)
def test_gpu_varlen_bwd_matches_per_sequence_oracle(case) -> None:
    lens_q, lens_k, hq, hkv, d, dtype, options = case
    q, k, v, cq, ck = (t.cuda() for t in _packed(lens_q, lens_k, hq, hkv, d, dtype))
    vp = check_varlen_inputs(q, k, v, cq, ck, max(lens_q) + 37, max(lens_k) + 5, **options)
    dout, dq, dk, dv = _run_bwd_guarded(q, k, v, cq, ck, vp)
    oracle = _oracle_pieces(q, k, v, cq, ck, dout, **options)
    _check(dict(dq=dq, dk=dk, dv=dv), oracle, dtype)


@pytest.mark.gpu
@gpu_fa3
@pytest.mark.parametrize("seed", range(6))
def test_gpu_varlen_bwd_random_batches(seed: int) -> None:
    """Random batch compositions: 1 to 24 sequences of 0 to 600 rows and keys each (a fifth
    empty), GQA / MQA, D 64 or 128, causal or not, fp16 or bf16, max_seqlen as given (the
    exact longest length, or more)."""
    gen = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    b = int(torch.randint(1, 25, (1,), generator=gen))
    lens = torch.randint(0, 601, (2, b), generator=gen)
    lens[torch.rand(2, b, generator=gen) < 0.2] = 0
    lens_q, lens_k = lens.tolist()
    hq, hkv = pick([(4, 4), (8, 2), (6, 1)])
    d, dtype, causal = pick([64, 128]), pick([F16, BF16]), pick([False, True])
    q, k, v, cq, ck = (t.cuda() for t in _packed(lens_q, lens_k, hq, hkv, d, dtype, seed=seed))
    vp = check_varlen_inputs(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal)
    dout, dq, dk, dv = _run_bwd_guarded(q, k, v, cq, ck, vp, seed=seed)
    oracle = _oracle_pieces(q, k, v, cq, ck, dout, causal=causal)
    _check(dict(dq=dq, dk=dk, dv=dv), oracle, dtype)


@pytest.mark.gpu
@gpu_fa3
def test_gpu_varlen_autograd_through_fa3s_own_backward(monkeypatch) -> None:
    """dispatch.attention_varlen(version="fa3") with FLASHSUITE_FA3_VARLEN_BWD=1: fa3's forward
    and fa3's own varlen backward (asserted), GQA, causal with Lq != Lk, against the oracle."""
    from flashsuite.fa3 import interface

    monkeypatch.setenv("FLASHSUITE_FA3_VARLEN_BWD", "1")
    used = []
    real = interface.varlen_backward
    monkeypatch.setattr(
        interface, "varlen_backward", lambda *a, **kw: used.append(1) or real(*a, **kw)
    )
    lens_q, lens_k = [65, 1, 0, 200, 129], [100, 1, 7, 64, 129]
    q, k, v, cq, ck = (t.cuda() for t in _packed(lens_q, lens_k, 8, 2, 128, BF16))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    choice = dispatch.select_varlen(q, k, v, cq, ck, 200, 129, causal=True, version="fa3")
    assert choice.backward == "fa3", str(choice)
    out = dispatch.attention_varlen(q, k, v, cq, ck, 200, 129, causal=True, version="fa3")
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF16).cuda()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert used, "fa3's own varlen backward did not run"
    oracle = _oracle_pieces(q, k, v, cq, ck, do, causal=True)
    _check(dict(dq=dq, dk=dk, dv=dv), oracle, BF16)


@pytest.mark.gpu
@gpu_fa3
@pytest.mark.parametrize(
    ("d", "options"),
    [
        (64, {"causal": True}),
        (96, {"window_size": (60, 0)}),
        (128, {"window_size": (100, 30)}),
        (192, {"causal": True}),
        (256, {"causal": True}),
    ],
    ids=["D64-causal", "D96-window", "D128-window", "D192-causal", "D256-causal"],
)
def test_gpu_varlen_deterministic_backward(monkeypatch, d: int, options: dict) -> None:
    """Under torch.use_deterministic_algorithms: fa3's ordered varlen backward
    (asserted), five runs through dispatch bitwise equal, against the per-sequence oracle;
    empty and one-row sequences, GQA. A counter started past a row block's first column block
    hangs the kernel: the watchdog ends the process with every thread's traceback."""
    from flashsuite.common.testing import ordered_backward_runs

    monkeypatch.delenv("FLASHSUITE_FA3_VARLEN_BWD", raising=False)
    lens_q, lens_k = [65, 1, 0, 200, 129, 300], [100, 1, 7, 64, 300, 129]
    q, k, v, cq, ck = (t.cuda() for t in _packed(lens_q, lens_k, 8, 2, d, BF16))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(BF16).cuda()
    args = (q, k, v, cq, ck, 300, 300)
    choice, grads = ordered_backward_runs(
        lambda: dispatch.select_varlen(*args, version="fa3", **options),
        lambda: dispatch.attention_varlen(*args, version="fa3", **options),
        (q, k, v),
        do,
    )
    assert choice.backward == "fa3" and "(deterministic)" in str(choice), str(choice)
    oracle = _oracle_pieces(q, k, v, cq, ck, do, **options)
    _check(dict(zip(("dq", "dk", "dv"), grads, strict=True)), oracle, BF16)


@pytest.mark.gpu
@GPU_MEMORY
@gpu_fa3
def test_gpu_varlen_bwd_large_against_fa2(monkeypatch) -> None:
    """Mixed lengths up to 4k (mean ~2k), GQA 16/4, D = 128, bf16, causal: fa3's own varlen
    backward and fa2's against the portable version in fp32 on the same saved tensors; fa3's
    error within 2x fa2's (+ a floor) for each gradient."""
    from flashsuite.fa3 import interface

    gen = torch.Generator().manual_seed(0)
    lens = [*torch.randint(1, 4096, (14,), generator=gen).tolist(), 0, 1]
    q, k, v, cq, ck = (t.cuda() for t in _packed(lens, lens, 16, 4, 128, BF16))
    vp = check_varlen_inputs(q, k, v, cq, ck, max(lens), max(lens), causal=True)
    out, lse = interface.varlen_forward(q, k, v, cq, ck, vp)
    do = torch.randn(out.shape, generator=gen).to(BF16).cuda()
    ours = interface.varlen_backward(do, q, k, v, out, lse, cq, ck, vp)
    fa2 = registry.module("fa2").varlen_backward(do, q, k, v, out, lse, cq, ck, vp)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    ref_out = dispatch.attention_varlen(
        qf, kf, vf, cq, ck, max(lens), max(lens), causal=True, version="torch"
    )
    ref = torch.autograd.grad(ref_out, (qf, kf, vf), do.float())
    for name, a, b, r in zip(("dq", "dk", "dv"), ours, fa2, ref, strict=True):
        err, err2 = ((t.float() - r).abs().max().item() for t in (a, b))
        assert err <= 2 * err2 + 1e-3 * r.abs().max().item(), (name, err, err2)
