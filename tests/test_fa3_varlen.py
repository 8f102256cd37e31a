"""fa3's varlen forward (packed sequences, cu_seqlens).

On the CPU: every varlen build (benchmarks/fa3_variants.varlen_cases) compiles for sm_90a with
the Hopper machinery in its PTX and no spills; varlen is part of the compile key; the host path
and the dispatch wiring (explicit version="fa3", auto keeping fa2, fa2's varlen backward under
autograd) run around a stand-in for the compiled binary that checks its argument contract. On
an sm90 GPU: the kernel against a per-sequence float64 oracle (common.testing.compare), with
NaN-filled guard rows before and after out and lse that must stay untouched, lengths 0, 1, 63,
64, 65, 127, 129 and 1000, causal with Lq != Lk, GQA, windows, softcap, every head_dim, and
one binary for every batch composition.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import replace

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.arch import override_arch
from flashsuite.common.reference import attention_reference
from flashsuite.common.testing import compare
from flashsuite.common.validation import check_varlen_inputs
from flashsuite.dispatch import registry
from tests.conftest import GPU_MEMORY, HAS_CUDA, must_run, run_fa3_probe

F16, BF16 = torch.float16, torch.bfloat16
HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl not installed")
# fa3 runnable here, or expected to be (an sm90 host with the DSL: unavailable fails there).
gpu_fa3 = pytest.mark.skipif(
    not HAS_CUDA or not (registry.available("fa3")[0] or must_run("fa3")),
    reason="needs fa3 on an sm90 GPU",
)


def _bounds(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list:
    """((q0, q1), (k0, k1)) row ranges of every sequence."""
    pairs = [list(itertools.pairwise(cu.tolist())) for cu in (cu_q, cu_k)]
    return list(zip(*pairs, strict=True))


def _cu(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(
        device
    )


# ------------------------------------------------------------------------------------------
# CPU: compile for sm_90a
# ------------------------------------------------------------------------------------------
def _varlen_cases() -> list:
    if not HAS_CUTLASS:
        return []
    from benchmarks.fa3_variants import varlen_cases

    return varlen_cases()


def _id(case) -> str:
    name, d, dt, causal, _, _, _ = case
    return f"{name}-D{d}-{str(dt).removeprefix('torch.')}-{'causal' if causal else 'full'}"


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict]:
    """`python -m benchmarks.fa3_probe --varlen` in two processes."""
    return run_fa3_probe(tmp_path_factory.mktemp("fa3_varlen_probe"), "--varlen")


@needs_dsl
@pytest.mark.parametrize("case", _varlen_cases(), ids=_id)
def test_varlen_compiles_with_hopper_machinery(case, probes) -> None:
    r = probes[_id(case)]
    assert r["varlen"] and r["local"] == case[5] and r["softcap"] == case[6]
    ptx = r["ptx"]
    assert ptx["wgmma"] > 0 and ptx["wgmma_rs"] > 0, "no wgmma / P·V not from registers"
    assert ptx["tma_load"] > 0 and ptx["tma_store"] > 0, "no cp.async.bulk.tensor load/store"
    assert ptx["setmaxnreg"] >= 2, "setmaxnreg dec/inc missing"
    assert ptx["stmatrix"] > 0 and ptx["bar_sync"] > 0
    assert ptx["vote_ballot"] > 0, "no ballot: the virtual block -> sequence search is missing"
    assert r["registers"] is not None, "no ptxas report captured"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_lines"]
    for code in ("C7508", "C7512", "C7515", "C7519"):
        assert code not in r["remarks"], f"ptxas remark {code}: {r['ptxas_lines']}"


def test_varlen_configs_are_plain_grid_and_refuse_what_the_kernel_cannot() -> None:
    from flashsuite.fa3.configs import (
        DTYPES,
        FP8_DTYPE,
        HEAD_DIMS,
        can_implement,
        get_config,
    )
    from flashsuite.fa3.varlen_configs import (
        VARLEN_CAUSAL_HEAD_SECTION,
        can_implement_varlen,
        varlen_config,
    )

    for d in HEAD_DIMS:
        for dt in DTYPES:
            for causal in (False, True):
                cfg = varlen_config(d, dt, causal)
                assert not (cfg.persistent or cfg.overlap_tiles or cfg.balanced_order), cfg
                assert can_implement(cfg, d, dt)[0] and can_implement_varlen(cfg, dt)[0]
                dense = get_config(d, dt, causal)
                assert (cfg.tile_m, cfg.tile_n, cfg.stages) == (
                    dense.tile_m,
                    dense.tile_n,
                    dense.stages,
                )
    persistent = get_config(128, BF16, True)
    assert persistent.persistent  # the dense causal entry; varlen refuses it
    ok, reason = can_implement_varlen(persistent, BF16)
    assert not ok and "plain grid" in reason
    ok, reason = can_implement_varlen(varlen_config(128, BF16, False), FP8_DTYPE)
    assert not ok and "float8_e4m3fn" in reason
    # head_section orders the plain grid of packed sequences: not with the persistent one.
    ok, reason = can_implement(replace(persistent, head_section=4), 128, BF16)
    assert not ok and "head_section 4 expected >= 0, and 0 with persistent=True" in reason
    assert can_implement(replace(varlen_config(128, BF16, True), head_section=4), 128, BF16)[0]
    # Causal packed grids launch in sections of heads (the measured order); non-causal ones,
    # whose tiles cost the same, keep the plain order.
    for d in HEAD_DIMS:
        assert varlen_config(d, BF16, True).head_section == VARLEN_CAUSAL_HEAD_SECTION > 0
        assert varlen_config(d, BF16, False).head_section == 0


def test_varlen_is_part_of_the_compile_key() -> None:
    from flashsuite.fa3 import disk_cache
    from flashsuite.fa3.compile import CompileKey
    from flashsuite.fa3.varlen_configs import varlen_config

    cfg = varlen_config(128, BF16, True)
    dense, packed = (
        CompileKey(BF16, 128, True, False, False, cfg, varlen=v) for v in (False, True)
    )
    assert dense != packed and hash(dense) != hash(packed)
    assert "varlen=True" in disk_cache.key_text(packed)
    assert disk_cache.key_text(dense) != disk_cache.key_text(packed)


@needs_dsl
def test_compile_refuses_a_persistent_varlen_key() -> None:
    from flashsuite.fa3.compile import CompileKey, compile_forward
    from flashsuite.fa3.configs import get_config

    key = CompileKey(BF16, 128, True, False, False, get_config(128, BF16, True), varlen=True)
    with pytest.raises(ValueError, match="plain grid"):
        compile_forward(key)


# ------------------------------------------------------------------------------------------
# CPU: host path and dispatch around a stand-in binary
# ------------------------------------------------------------------------------------------
class StandIn:
    """The compiled varlen binary's calling convention, checked, with the per-sequence
    reference as its result: (q, k, v, out, lse, None, None, None, cu_seqlens_q,
    cu_seqlens_k, scale_log2, softcap_pre, window_left, window_right, max_ctas)."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.calls: list = []

    def __call__(self, key):
        def run(*args):
            self.calls.append((key, args))
            q, k, v, out, lse, d_q, d_k, d_v, cu_q, cu_k = args[:10]
            assert (d_q, d_k, d_v) == (None, None, None)
            assert len(args) == 15 and all(isinstance(a, (int, float)) for a in args[10:])
            assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape
            assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.is_contiguous()
            assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
            assert all(t.stride(-1) == 1 for t in (q, k, v))
            for (q0, q1), (k0, k1) in _bounds(cu_q, cu_k):
                if q1 == q0:
                    continue
                if k1 == k0:
                    out[q0:q1], lse[:, q0:q1] = 0, float("-inf")
                    continue
                o, s = attention_reference(
                    q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **self.options
                )
                out[q0:q1], lse[:, q0:q1] = o[0].to(out.dtype), s[0]
            return None

        return run


@pytest.fixture
def stand_in(monkeypatch):
    from flashsuite.fa3 import compile as fa3_compile
    from flashsuite.fa3 import interface

    def make(options: dict) -> StandIn:
        fake = StandIn(options)
        monkeypatch.setattr(fa3_compile, "get_forward", fake)
        return fake

    props = type("Props", (), {"multi_processor_count": 132})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(interface, "_plans", {})
    return make


def _packed(lens_q, lens_k, hq, hkv, d, dtype, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(dtype).requires_grad_(grad)
    k = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype).requires_grad_(grad)
    v = torch.randn(sum(lens_k), hkv, d, generator=gen).to(dtype).requires_grad_(grad)
    return q, k, v, _cu(lens_q), _cu(lens_k)


def _oracle_pieces(q, k, v, cq, ck, do=None, **options) -> dict:
    """out, lse (and dq, dk, dv) joined over the sequences, in float64 ("ref") and in the input
    dtype ("pt"), from common.reference on each sequence's own lengths."""
    result = {}
    for tag, cdt in (("ref", torch.float64), ("pt", None)):
        outs, lses, grads = [], [], []
        for (q0, q1), (k0, k1) in _bounds(cq, ck):
            qs, ks, vs = (
                t.detach()[None, a:b].clone().requires_grad_(do is not None)
                for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))
            )
            if k1 == k0:  # no keys: out 0, lse -inf, zero gradients
                o = qs.new_zeros(1, q1 - q0, q.shape[1], v.shape[2]).double()
                s = qs.new_full((1, q.shape[1], q1 - q0), float("-inf"), dtype=torch.float32)
                g = (torch.zeros_like(qs), torch.zeros_like(ks), torch.zeros_like(vs))
            else:
                o, s = attention_reference(qs, ks, vs, compute_dtype=cdt, **options)
                g = None
                if do is not None:
                    g = torch.autograd.grad(o, (qs, ks, vs), do[None, q0:q1].to(o.dtype))
            outs.append(o.detach()[0])
            lses.append(s.detach()[0])
            grads.append(g)
        entry = {"out": torch.cat(outs), "lse": torch.cat(lses, dim=1)}
        if do is not None:
            entry["dq"] = torch.cat([g[0][0] for g in grads])
            kv_grads = [(g[1][0], g[2][0]) for g in grads]
            entry["dk"] = torch.cat([a for a, _ in kv_grads])
            entry["dv"] = torch.cat([b for _, b in kv_grads])
        result[tag] = entry
    return result


def _check(ours: dict, oracle: dict, dtype: torch.dtype) -> None:
    for name, value in ours.items():
        want = torch.float32 if name == "lse" else dtype
        c = compare(name, value, oracle["ref"][name], oracle["pt"][name], dtype=want)
        assert c.ok, str(c)


@needs_dsl
@pytest.mark.skipif(
    HAS_CUDA,
    reason="fa2's varlen backward on CPU tensors needs the Triton interpreter; on a GPU "
    "test_gpu_varlen_autograd_through_dispatch runs the real binary and its autograd",
)
def test_host_path_and_autograd_through_fa2s_varlen_backward(stand_in, monkeypatch) -> None:
    """version="fa3" on a CPU planned as sm90: the binary gets the packed tensors, the
    cu_seqlens and the scalars of the totals; with fa3's own varlen backward turned off
    (FLASHSUITE_FA3_VARLEN_BWD=0) the gradient comes from fa2's varlen backward (Triton
    interpreter) on the saved (q, k, v, out, lse) and matches the oracle."""
    pytest.importorskip("triton")
    monkeypatch.setenv("FLASHSUITE_FA3_VARLEN_BWD", "0")
    from flashsuite.fa3.compile import CompileKey, kernel_scalars
    from flashsuite.fa3.varlen_configs import varlen_config

    lens_q, lens_k = [5, 0, 17, 1], [9, 4, 17, 0]
    options = dict(causal=True, softcap=4.0)
    fake = stand_in(options)
    q, k, v, cq, ck = _packed(lens_q, lens_k, 4, 2, 64, F16, grad=True)
    fa2 = registry.module("fa2")
    used = []
    real = fa2.varlen_backward
    monkeypatch.setattr(fa2, "varlen_backward", lambda *a, **kw: used.append(1) or real(*a, **kw))
    with override_arch(90):
        choice = dispatch.select_varlen(q, k, v, cq, ck, 20, 20, version="fa3", **options)
        assert (choice.version, choice.backward) == ("fa3", "fa2"), str(choice)
        assert "backward: fa2" in str(choice)
        out, lse = dispatch.attention_varlen(
            q, k, v, cq, ck, 20, 20, return_lse=True, version="fa3", **options
        )
    ((key, args),) = fake.calls
    # Softcap: the packed build without the dense schedule options (varlen_config_for).
    plain = varlen_config(64, F16, True, options=False)
    assert key == CompileKey(F16, 64, True, False, True, plain, varlen=True)
    assert args[8] is cq and args[9] is ck
    scale = 64**-0.5
    assert args[10:] == (*kernel_scalars(scale, 4.0, (-1, -1), True, 23, 30), 132)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(F16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert used, "fa2's varlen backward did not run"
    oracle = _oracle_pieces(q, k, v, cq, ck, do, **options)
    ours = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    _check(ours, oracle, F16)


@needs_dsl
def test_keyless_and_empty_batches_skip_the_binary(stand_in) -> None:
    from flashsuite.fa3 import interface

    fake = stand_in({})
    q, k, v, cq, ck = _packed([3, 4], [0, 0], 2, 2, 64, BF16)
    vp = check_varlen_inputs(q, k, v, cq, ck, 4, 0)
    out, lse = interface.varlen_forward(q, k, v, cq, ck, vp)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    q, k, v, cq, ck = _packed([0, 0], [3, 0], 2, 2, 64, BF16)
    vp = check_varlen_inputs(q, k, v, cq, ck, 0, 3)
    out, lse = interface.varlen_forward(q, k, v, cq, ck, vp)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)
    assert not fake.calls


@needs_dsl
def test_auto_takes_fa3_and_falls_back_to_fa2_with_a_reason(monkeypatch) -> None:
    """Auto selection runs packed sequences on fa3 (varlen_configs.VARLEN_AUTO); with that switch
    off, on fa2, and the choice says why."""
    pytest.importorskip("triton")
    from flashsuite.fa3 import interface

    q, k, v, cq, ck = _packed([4, 6], [4, 6], 4, 2, 64, BF16)
    with override_arch(90):
        choice = dispatch.select_varlen(q, k, v, cq, ck, 6, 6, causal=True)
        assert choice.version == "fa3", str(choice)
        monkeypatch.setattr(interface, "VARLEN_AUTO_SELECT", False)
        choice = dispatch.select_varlen(q, k, v, cq, ck, 6, 6, causal=True)
    assert choice.version == "fa2", str(choice)
    assert "fa3: no - fa3: varlen kernel not in auto selection yet" in str(choice)


@needs_dsl
def test_supports_varlen_reasons() -> None:
    from flashsuite.fa3 import interface

    def reason(dtype=BF16, d=64, dv=64, arch=90):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(10, 4, d, generator=gen).to(dtype)
        k = torch.randn(10, 2, d, generator=gen).to(dtype)
        v = torch.randn(10, 2, dv, generator=gen).to(dtype)
        cu = _cu([4, 6])
        return interface.supports_varlen(check_varlen_inputs(q, k, v, cu, cu, 6, 6), arch)

    ok, why = reason()
    assert ok and why.startswith("fa3: varlen, 192x128 tiles") and "one tile per CTA" in why
    assert not reason(arch=80)[0] and not reason(arch=None)[0]
    assert "dtype float32" in reason(dtype=torch.float32)[1]
    assert "head_dim 80 not in" in reason(d=80, dv=80)[1]
    assert "head_dim_v 32 != head_dim 64" in reason(dv=32)[1]


# ------------------------------------------------------------------------------------------
# GPU: the kernel against the per-sequence oracle
# ------------------------------------------------------------------------------------------
EDGE_Q = [0, 1, 63, 64, 65, 127, 129, 1000, 5, 0, 3]
EDGE_K = [0, 1, 63, 64, 65, 127, 129, 1000, 0, 50, 1]
# (lens_q, lens_k, Hq, Hkv, D, dtype, options)
MIXED_Q, MIXED_K = [1, 63, 65, 129, 1000, 300], [100, 200, 1, 129, 700, 1000]
GPU_CASES = [
    (EDGE_Q, EDGE_K, 4, 4, 128, BF16, dict()),
    (EDGE_Q, EDGE_K, 4, 2, 128, F16, dict(causal=True)),
    (MIXED_Q, MIXED_K, 8, 2, 64, F16, dict(causal=True)),
    (MIXED_Q, MIXED_K, 6, 2, 256, BF16, dict(window_size=(64, 0))),
    (EDGE_Q, EDGE_K, 6, 1, 192, BF16, dict(causal=True, window_size=(100, -1))),
    (EDGE_Q, EDGE_K, 4, 2, 96, F16, dict(softcap=30.0, window_size=(32, 16))),
    ([700, 129, 64], [64, 129, 700], 4, 4, 64, BF16, dict(causal=True, softcap=20.0)),
    # The packed builds of the table's schedule options at D = 256 (P·V's wait after the row
    # max) and causal D = 192 and 96 (split loops, descriptors per warpgroup; D = 96 on 192-row
    # tiles of three warpgroups that pass by blocks their rows cannot see).
    (MIXED_Q, MIXED_K, 4, 2, 256, BF16, dict()),
    (EDGE_Q, EDGE_K, 4, 2, 192, BF16, dict(causal=True)),
    (MIXED_Q, MIXED_K, 6, 2, 96, BF16, dict(causal=True)),
    # Non-causal D = 64: FA4's loop (descriptors from the stage's first, no mask test).
    (EDGE_Q, EDGE_K, 4, 2, 64, BF16, dict()),
]
GUARD = 16  # rows of NaN before and after out (and as many LSE entries around lse)


def _run_guarded(q, k, v, cq, ck, vp):
    """fa3's varlen forward writing into views of NaN-filled buffers with GUARD rows on each
    side; returns (out, lse) and asserts the guards are untouched and every row written."""
    from flashsuite.fa3 import interface

    tq, hq, d = q.shape
    out_buf = torch.full((tq + 2 * GUARD, hq, d), float("nan"), dtype=q.dtype, device=q.device)
    lse_buf = torch.full((hq * tq + 2 * GUARD,), float("nan"), device=q.device)
    out = out_buf[GUARD : GUARD + tq]  # (total_q, Hq, D), contiguous, 16-byte aligned
    lse = lse_buf[GUARD : GUARD + hq * tq].view(hq, tq)  # (Hq, total_q), contiguous
    res = interface.varlen_forward(q, k, v, cq, ck, vp, out=out, lse=lse)
    torch.cuda.synchronize()
    assert res[0] is out and res[1] is lse
    for name, guard in (
        ("out before", out_buf[:GUARD]),
        ("out after", out_buf[GUARD + tq :]),
        ("lse before", lse_buf[:GUARD]),
        ("lse after", lse_buf[GUARD + hq * tq :]),
    ):
        assert bool(guard.isnan().all()), f"{name}: the kernel wrote outside out / lse"
    assert not bool(out.isnan().any()), "rows of out left unwritten (NaN)"
    assert not bool(lse.isnan().any()), "entries of lse left unwritten (NaN)"
    return out, lse


@pytest.mark.gpu
@gpu_fa3
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"D{c[4]}-{c[5]}-{c[6]}".replace(" ", ""))
def test_gpu_varlen_matches_per_sequence_oracle(case) -> None:
    lens_q, lens_k, hq, hkv, d, dtype, options = case
    dev = "cuda"
    q, k, v, cq, ck = (t.to(dev) for t in _packed(lens_q, lens_k, hq, hkv, d, dtype))
    vp = check_varlen_inputs(q, k, v, cq, ck, max(lens_q) + 37, max(lens_k) + 5, **options)
    out, lse = _run_guarded(q, k, v, cq, ck, vp)
    _check(dict(out=out, lse=lse), _oracle_pieces(q, k, v, cq, ck, **options), dtype)


@pytest.mark.gpu
@gpu_fa3
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_head_sections_change_the_order_not_the_bits(causal) -> None:
    """Every section width (1, one that does not divide Hq, the shipped one, wider than Hq)
    runs the plain grid's tiles in another order: out and lse bitwise equal to the plain
    grid's, with the guard rows untouched."""
    from flashsuite.fa3 import interface
    from flashsuite.fa3.varlen_configs import varlen_config

    lens = [700, 0, 1, 129, 64, 1000, 65]
    q, k, v, cq, ck = (t.cuda() for t in _packed(lens, lens, 12, 4, 128, BF16, seed=5))
    vp = check_varlen_inputs(q, k, v, cq, ck, 1000, 1000, causal=causal)
    plain = replace(varlen_config(128, BF16, causal), head_section=0)
    ref_out, ref_lse = interface.varlen_forward(q, k, v, cq, ck, vp, cfg=plain)
    for section in (1, 5, 8, 40):
        cfg = replace(plain, head_section=section)
        out, lse = interface.varlen_forward(q, k, v, cq, ck, vp, cfg=cfg)
        assert torch.equal(out, ref_out), f"head_section {section}: out differs"
        assert torch.equal(lse, ref_lse), f"head_section {section}: lse differs"
    _run_guarded(q, k, v, cq, ck, vp)  # the shipped config writes inside out / lse only


@pytest.mark.gpu
@gpu_fa3
def test_gpu_one_binary_for_every_batch_composition() -> None:
    """New lengths, batch sizes and totals reuse the binary of the first call."""
    from flashsuite.fa3 import compile as fa3_compile

    def varlen_keys() -> set:
        return {k for k in fa3_compile._cache if getattr(k, "varlen", False)}

    gen = torch.Generator().manual_seed(3)
    start, before = varlen_keys(), None
    for b in (1, 3, 17, 40):
        lens = torch.randint(0, 300, (b,), generator=gen).tolist()
        q, k, v, cq, ck = (t.cuda() for t in _packed(lens, lens, 4, 2, 128, BF16, seed=b))
        dispatch.attention_varlen(q, k, v, cq, ck, 300, 300, causal=True, version="fa3")
        if before is None:
            before = varlen_keys()  # this problem's binary (and any earlier tests' others)
            assert len(before - start) <= 1
        assert varlen_keys() == before, f"batch of {b}: a new varlen binary was compiled"


@pytest.mark.gpu
@gpu_fa3
def test_gpu_varlen_autograd_through_dispatch() -> None:
    """dispatch.attention_varlen(version="fa3") forward and fa2's varlen backward, GQA, causal
    with Lq != Lk, against the oracle."""
    lens_q, lens_k = [65, 1, 0, 200, 129], [100, 1, 7, 64, 129]
    q, k, v, cq, ck = (t.cuda() for t in _packed(lens_q, lens_k, 8, 2, 128, BF16))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = dispatch.attention_varlen(
        q, k, v, cq, ck, 200, 129, causal=True, return_lse=True, version="fa3"
    )
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF16).cuda()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    oracle = _oracle_pieces(q, k, v, cq, ck, do, causal=True)
    _check(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), oracle, BF16)


@pytest.mark.gpu
@GPU_MEMORY
@gpu_fa3
def test_gpu_varlen_large_against_fp32_reference() -> None:
    """Mixed lengths up to 4k (mean ~2k), GQA 32/8, D=128, bf16, causal: fa3's forward against
    the portable version in fp32, with the guard rows."""
    gen = torch.Generator().manual_seed(0)
    lens = [*torch.randint(1, 4096, (14,), generator=gen).tolist(), 0, 1]
    q, k, v, cq, ck = (t.cuda() for t in _packed(lens, lens, 32, 8, 128, BF16))
    vp = check_varlen_inputs(q, k, v, cq, ck, max(lens), max(lens), causal=True)
    out, lse = _run_guarded(q, k, v, cq, ck, vp)
    ref, ref_lse = dispatch.attention_varlen(
        q.float(), k.float(), v.float(), cq, ck, max(lens), max(lens), causal=True,
        return_lse=True, version="torch",
    )  # fmt: skip
    err = (out.float() - ref).abs().max().item()
    assert err < 2e-2 * max(1.0, ref.abs().max().item()), err
    finite = ref_lse.isfinite()
    assert torch.equal(finite, lse.isfinite())
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-3


@needs_dsl
def test_dense_build_refuses_a_head_section() -> None:
    """head_section orders packed sequences' plain grid; a dense kernel would ignore it."""
    import cutlass

    from flashsuite.fa3.configs import get_config
    from flashsuite.fa3.kernels import Fa3Forward

    cfg = replace(get_config(128, BF16, False), head_section=8)
    with pytest.raises(ValueError, match="head_section 8 orders packed sequences' plain grid"):
        Fa3Forward(cutlass.BFloat16, 128, cfg, False, False, False)
