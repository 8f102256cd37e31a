"""The shared suite: the same test bodies for every version available on this machine.

A version joins by registering with the dispatcher (dispatch/registry.py); nothing here is
version-specific. A case a version does not support is skipped with the version's own reason
(test_support_matrix makes sure each version still claims what it must).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.testing import (
    Case,
    compare,
    make_grad_out,
    make_inputs,
    ordered_backward_runs,
    reference_pair,
)
from tests.conftest import GPU_MEMORY, HAS_CUDA, must_run, runnable_names, runnable_versions

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# Small enough for the Triton interpreter (~5 ms per 64x64x64 block step on the CPU).
CASES = [
    Case(batch=2, seqlen_q=128, seqlen_k=128, heads_q=2, heads_kv=2, head_dim=64),
    Case(batch=2, seqlen_q=128, seqlen_k=128, heads_q=2, heads_kv=2, head_dim=64, causal=True),
    Case(seqlen_q=96, seqlen_k=96, head_dim=32, dtype=BF16, causal=True),
    Case(seqlen_q=64, seqlen_k=80, head_dim=128, dtype=F32),
    Case(seqlen_q=80, seqlen_k=64, head_dim=96, dtype=F16, causal=True),
    Case(seqlen_q=40, seqlen_k=48, heads_q=1, heads_kv=1, head_dim=256, dtype=BF16),
    Case(seqlen_q=1, seqlen_k=1, head_dim=64),
    Case(seqlen_q=1, seqlen_k=113, head_dim=64, causal=True),
    Case(seqlen_q=17, seqlen_k=17, head_dim=64, causal=True),
    Case(seqlen_q=113, seqlen_k=113, head_dim=64, dtype=BF16),
    Case(seqlen_q=100, seqlen_k=77, head_dim=64, causal=True),  # Nq > Nk: 23 empty rows
    Case(seqlen_q=77, seqlen_k=100, head_dim=64, causal=True),
    Case(batch=1, seqlen_q=1023, seqlen_k=1023, heads_q=1, heads_kv=1, head_dim=32, causal=True),
    Case(seqlen_q=64, seqlen_k=64, heads_q=4, heads_kv=2, head_dim=64),  # GQA
    Case(seqlen_q=65, seqlen_k=70, heads_q=4, heads_kv=1, head_dim=64, causal=True),  # MQA
    Case(seqlen_q=128, seqlen_k=128, head_dim=64, window_size=(16, 8)),
    Case(seqlen_q=96, seqlen_k=128, head_dim=64, window_size=(32, 0)),
    Case(seqlen_q=64, seqlen_k=64, head_dim=64, softcap=30.0),
    Case(seqlen_q=64, seqlen_k=64, head_dim=64, softcap=5.0, causal=True, dtype=BF16),
    Case(seqlen_q=64, seqlen_k=72, head_dim=64, head_dim_v=32),
    Case(seqlen_q=64, seqlen_k=64, head_dim=64, softmax_scale=0.5),
    Case(seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=64, non_contiguous=True),
    Case(seqlen_q=33, seqlen_k=47, heads_q=2, heads_kv=1, head_dim=192, dtype=BF16),
    Case(seqlen_q=37, seqlen_k=1, head_dim=64, dtype=BF16, causal=True),  # Nk = 1: 36 empty rows
    # Large logits: x12 inputs (near one-hot rows), and a few keys with huge scores.
    Case(seqlen_q=96, seqlen_k=100, head_dim=64, dtype=BF16, causal=True, amplitude=12.0),
    Case(seqlen_q=60, seqlen_k=70, head_dim=64, dtype=F32, amplitude=12.0),
    Case(seqlen_q=70, seqlen_k=130, heads_q=4, heads_kv=2, head_dim=64, spikes=3),
]

# Realistic sizes, on a GPU only.
GPU_CASES = [
    Case(
        batch=2,
        seqlen_q=4096,
        seqlen_k=4096,
        heads_q=8,
        heads_kv=8,
        head_dim=d,
        dtype=dt,
        causal=c,
        tags=("gpu",),
    )
    for d in (64, 128, 256)
    for dt in (F16, BF16)
    for c in (False, True)
] + [
    Case(
        batch=1,
        seqlen_q=16384,
        seqlen_k=16384,
        heads_q=2,
        heads_kv=1,
        head_dim=128,
        dtype=BF16,
        causal=True,
        tags=("gpu",),
    ),
    Case(
        batch=1,
        seqlen_q=3001,
        seqlen_k=5003,
        heads_q=6,
        heads_kv=2,
        head_dim=96,
        dtype=BF16,
        causal=True,
        tags=("gpu",),
    ),
    Case(
        batch=1,
        seqlen_q=2048,
        seqlen_k=2048,
        heads_q=4,
        heads_kv=4,
        head_dim=192,
        dtype=F16,
        window_size=(256, 64),
        tags=("gpu",),
    ),
    # D = 192 without a window (fa3's own backward takes it): GQA, causal, ragged lengths.
    Case(
        batch=1,
        seqlen_q=2500,
        seqlen_k=2100,
        heads_q=4,
        heads_kv=2,
        head_dim=192,
        dtype=BF16,
        causal=True,
        tags=("gpu",),
    ),
]

# The GPU cases' float64 oracles hold 2-4 GB per N x N product: GPU_MEMORY (tests/conftest.py).
ALL_CASES = [pytest.param(c, id=c.id) for c in CASES] + [
    pytest.param(c, id=c.id, marks=[pytest.mark.gpu, GPU_MEMORY]) for c in GPU_CASES
]
VERSIONS = runnable_versions()


def _require(version: str, case: Case, q, k, v) -> None:
    from flashsuite.dispatch import registry

    ok, reason = registry.available(version)
    if not ok and must_run(version):
        pytest.fail(f"{version} must run on this sm90 host with the CuTe DSL: {reason}")
    try:
        dispatch.select(q, k, v, version=version, **case.options())
    except dispatch.Unsupported as exc:
        pytest.skip(str(exc))


# The oracle of the GPU cases (float64 N x N products, seconds each at N = 16k) is shared by
# the versions that run the same case in one process: the GPU_MEMORY group runs them on one
# worker. Keyed by the case and the inputs' bytes, so a different input never hits.
_ORACLES: dict[tuple, dict] = {}


def _oracle(case: Case, q, k, v, dout=None) -> dict:
    if "gpu" not in case.tags:
        return reference_pair(q, k, v, grad_out=dout, **case.options())
    tensors = (q, k, v) if dout is None else (q, k, v, dout)
    key = (case.id, *(t.detach().double().sum().item() for t in tensors))
    ref = _ORACLES.get(key)
    if ref is None:
        ref = reference_pair(q, k, v, grad_out=dout, **case.options())
        if len(_ORACLES) >= 2:  # the results are O(N); keep a couple of cases at most
            _ORACLES.clear()
        _ORACLES[key] = ref
    return ref


def _assert_ok(comparisons) -> None:
    bad = [str(c) for c in comparisons if not c.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_forward_and_lse(version: str, case: Case, device: str) -> None:
    q, k, v = make_inputs(case, device)
    _require(version, case, q, k, v)
    out, lse = dispatch.attention(q, k, v, **case.options(), return_lse=True, version=version)
    assert out.shape == (case.batch, case.seqlen_q, case.heads_q, case.dv)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    assert lse.shape == (case.batch, case.heads_q, case.seqlen_q)
    ref = _oracle(case, q, k, v)
    _assert_ok([compare("out", out, *ref["out"]), compare("lse", lse, *ref["lse"])])


# Measured accuracy gaps, kept visible: under the Triton interpreter (CPU) only, the named
# gradient is held to a wider factor than the rule's, every other output to the rule. On the
# H200 the compiled kernels pass these cases under the rule.
# fa1's and fa2's backwards recompute P = exp2(S * scale * log2e - LSE * log2e) from the float32
# LSE of the forward; with x12 inputs the log2-domain scores reach ~1e3, where a float32 ulp is
# 6e-5, so P and dV = P^T dO carry ~1e-4 relative error that PyTorch's float32 autograd (which
# keeps P) does not. Measured max / mean |dV - ref| against PyTorch's float32 error: 12.7x / 16x
# and 12.6x / 37x on two CPU machines, landing on fa1 or fa2 by the forward LSE's last bit (the
# interpreter's numpy maths); dQ, dK, out and the LSE are within the rule on the same case.
_X12 = "b1-q60-k70-h2-2-d64-float32-x12"
_X12_WHY = "fp32 dV from an fp32 LSE with x12 logits (the interpreter)"
KNOWN_GAPS: dict[tuple[str, str], tuple[str, float, str]] = {
    ("fa2", _X12): ("dv", 64.0, _X12_WHY),
    ("fa1", _X12): ("dv", 64.0, _X12_WHY),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_backward(version: str, case: Case, device: str) -> None:
    gap_name, gap_factor, _ = KNOWN_GAPS.get((version, case.id), (None, None, ""))
    if device != "cpu":
        gap_name = None
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    dout = make_grad_out(case, device)
    out, lse = dispatch.attention(q, k, v, **case.options(), return_lse=True, version=version)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref = _oracle(case, q, k, v, dout)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    _assert_ok(
        [
            compare(name, t, *ref[name], factor=gap_factor if name == gap_name else None)
            for name, t in got.items()
        ]
    )


@pytest.mark.parametrize("case", ALL_CASES)
def test_backward_fa3_own(case: Case, device: str, monkeypatch) -> None:
    """The shared backward cases through fa3's own backward kernel (FLASHSUITE_FA3_BWD=1 forces
    it, whatever the default); skipped where it does not apply (then fa2's backward, covered by
    test_backward, runs)."""
    if "fa3" not in runnable_names():
        pytest.skip("fa3 not runnable here")
    monkeypatch.setenv("FLASHSUITE_FA3_BWD", "1")
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require("fa3", case, q, k, v)
    choice = dispatch.select(q, k, v, **case.options(), version="fa3")
    if choice.backward != "fa3":
        pytest.skip(f"fa3's own backward does not take this case: {choice}")
    dout = make_grad_out(case, device)
    out, lse = dispatch.attention(q, k, v, **case.options(), return_lse=True, version="fa3")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref = _oracle(case, q, k, v, dout)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    _assert_ok([compare(name, t, *ref[name]) for name, t in got.items()])


@pytest.mark.parametrize("version", VERSIONS)
def test_recompute_contract_saves_only_linear_memory(version: str, device: str) -> None:
    """What the forward saves for backward is q, k, v, out, lse themselves (O(N), nothing
    Nq x Nk), and the backward really uses the saved LSE: replaying it with LSE + ln 2 halves
    every recomputed P, so dV (= Pᵀ dO) halves. A backward that recomputed the softmax from
    scratch, or saved something else, fails here."""
    case = Case(seqlen_q=96, seqlen_k=80, heads_q=2, heads_kv=1, head_dim=32, causal=True)
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    dout = make_grad_out(case, device)

    def run(shift: float):
        saved: list[torch.Tensor] = []

        def unpack(t: torch.Tensor) -> torch.Tensor:
            return t + shift if t.dtype == torch.float32 and t.dim() == 3 else t

        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, unpack):
            out, lse = dispatch.attention(q, k, v, causal=True, return_lse=True, version=version)
        return saved, out, lse, torch.autograd.grad(out, (q, k, v), dout)

    saved, out, lse, (_, _, dv) = run(0.0)
    ptrs = sorted(t.data_ptr() for t in saved)
    assert ptrs == sorted(t.data_ptr() for t in (q, k, v, out, lse)), (
        f"saved {[tuple(t.shape) for t in saved]}, expected q, k, v, out, lse themselves"
    )
    _, _, _, (_, _, dv_half) = run(math.log(2.0))
    torch.testing.assert_close(dv_half.float(), dv.float() / 2, atol=2e-3, rtol=1e-2)


MASKED_CASES = [
    # causal, Nq > Nk: rows 0..49 see no key (bottom-right alignment); every key is seen.
    (Case(seqlen_q=90, seqlen_k=40, head_dim=64, causal=True), 50, 0),
    # window (3, 0), Nq < Nk: row i sees keys i + 62 .. i + 65; keys 0..61 are seen by no row.
    (Case(seqlen_q=20, seqlen_k=85, head_dim=64, window_size=(3, 0)), 0, 62),
    # window (0, 0), Nq > Nk: rows 0..47 see nothing, rows 48..63 exactly one key.
    (Case(seqlen_q=64, seqlen_k=16, head_dim=64, window_size=(0, 0)), 48, 0),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    ("base", "empty_rows", "unseen_keys"), MASKED_CASES, ids=[c.id for c, _, _ in MASKED_CASES]
)
def test_fully_masked_rows(
    version: str, dtype: torch.dtype, base: Case, empty_rows: int, unseen_keys: int, device: str
) -> None:
    """Rows that see no key: output exactly 0, LSE -inf, their dQ exactly 0; keys no row sees:
    dK and dV exactly 0; nothing NaN; the rest matches the oracle."""
    case = replace(base, dtype=dtype)
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    out, lse = dispatch.attention(q, k, v, **case.options(), return_lse=True, version=version)
    assert torch.equal(out[:, :empty_rows], torch.zeros_like(out[:, :empty_rows]))
    assert torch.isneginf(lse[:, :, :empty_rows]).all()
    assert torch.isfinite(lse[:, :, empty_rows:]).all()
    dout = make_grad_out(case, device)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
    assert torch.equal(dq[:, :empty_rows], torch.zeros_like(dq[:, :empty_rows]))
    assert torch.equal(dk[:, :unseen_keys], torch.zeros_like(dk[:, :unseen_keys]))
    assert torch.equal(dv[:, :unseen_keys], torch.zeros_like(dv[:, :unseen_keys]))
    ref = reference_pair(q, k, v, grad_out=dout, **case.options())
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    _assert_ok([compare(name, t, *ref[name]) for name, t in got.items()])


def test_support_matrix_core_cases() -> None:
    """Each version still claims the core of its support matrix (skips must not hide bugs)."""
    from flashsuite.common import arch as arch_mod
    from flashsuite.common.validation import check_inputs

    expect = {
        "torch": [(None, F32, 64, False), (None, BF16, 200, True)],
        "fa2": [(90, BF16, d, c) for d in (32, 64, 96, 128, 192, 256) for c in (False, True)]
        + [(80, F16, 128, True)],
        "fa1": [(75, F16, d, c) for d in (32, 64, 96, 128) for c in (False, True)],
        "fa3": [(90, BF16, d, c) for d in (64, 128, 256) for c in (False, True)]
        + [(90, F16, 128, True)],
    }
    from flashsuite.dispatch import registry

    for version, rows in expect.items():
        if not registry.available(version)[0]:
            continue
        mod = registry.module(version)
        for arch, dtype, d, causal in rows:
            q = torch.empty(1, 128, 2, d, dtype=dtype)
            p = check_inputs(q, q, q, causal=causal)
            with arch_mod.override_arch(arch):
                ok, reason = mod.supports(p, arch)
            assert ok, f"{version} should support {p.describe()} on sm{arch}: {reason}"


@pytest.mark.skipif(HAS_CUDA, reason="float64 gradcheck on the CPU")
def test_gradcheck_float64_torch_version() -> None:
    torch.manual_seed(0)
    for causal, window, softcap in ((True, (-1, -1), 0.0), (False, (3, 2), 2.0)):
        q = torch.randn(1, 9, 2, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, 11, 1, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, 11, 1, 4, dtype=torch.float64, requires_grad=True)

        def fn(q, k, v, causal=causal, window=window, softcap=softcap):
            return dispatch.attention(
                q, k, v, causal=causal, window_size=window, softcap=softcap, version="torch"
            )

        assert torch.autograd.gradcheck(fn, (q, k, v), atol=1e-6, rtol=1e-5)


def _assert_compiled_matches_eager(loss, inputs, **compile_options) -> None:
    """torch.compile(fullgraph=True) of `loss` gives the eager value and gradients."""
    got = torch.compile(loss, fullgraph=True, **compile_options)(*inputs)
    grads = torch.autograd.grad(got, inputs)
    want = loss(*inputs)
    want_grads = torch.autograd.grad(want, inputs)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("version", VERSIONS)
def test_torch_compile_fullgraph(version: str, device: str) -> None:
    """Every version's op compiles into one graph (fullgraph: no break around the custom op)
    and gives the eager forward and gradients; the Triton versions run under the interpreter
    on the CPU."""
    case = Case(seqlen_q=40, seqlen_k=48, heads_q=4, heads_kv=2, head_dim=32, causal=True)
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)

    def loss(q, k, v):
        return dispatch.attention(q, k, v, causal=True, version=version).float().square().sum()

    torch._dynamo.reset()
    _assert_compiled_matches_eager(loss, (q, k, v), backend="aot_eager")


@pytest.mark.parametrize("version", VERSIONS)
def test_opcheck_forward_and_backward_ops(version: str, device: str) -> None:
    """torch.library.opcheck on the version's flashsuite::<v>_fwd and _bwd: schema, fake
    (meta) implementation, autograd registration, AOT dispatch."""
    from flashsuite.dispatch import registry

    case = Case(seqlen_q=20, seqlen_k=24, heads_q=2, heads_kv=1, head_dim=32, causal=True)
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    attn_op = registry.op(version)
    options = (True, 32**-0.5, -1, 0, 0.0)
    torch.library.opcheck(attn_op.fwd, (q, k, v, *options, None, None, None))
    if attn_op.bwd is None:
        pytest.skip(f"{version} has no backward op")
    out, lse = attn_op.fwd(q.detach(), k.detach(), v.detach(), *options, None, None, None)
    dout = make_grad_out(case, device)
    q, k, v = (t.detach() for t in (q, k, v))
    torch.library.opcheck(attn_op.bwd, (dout, q, k, v, out, lse, *options))


def test_torch_compile_fullgraph_and_export() -> None:
    case = Case(
        seqlen_q=48, seqlen_k=40, heads_q=4, heads_kv=2, head_dim=16, dtype=F32, causal=True
    )
    q, k, v = make_inputs(case, "cpu", requires_grad=True)

    def loss(q, k, v):
        return dispatch.attention(q, k, v, causal=True, version="torch").square().sum()

    _assert_compiled_matches_eager(loss, (q, k, v))

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return dispatch.attention(q, k, v, causal=True, version="torch")

    exported = torch.export.export(Attn(), (q.detach(), k.detach(), v.detach()))
    assert "flashsuite.torch_fwd" in exported.graph_module.code
    torch.testing.assert_close(exported.module()(q, k, v), Attn()(q, k, v))


NO_GPU_SCHEDULING = (
    "determinism of GPU scheduling: the CPU interpreter runs programs in one fixed order, "
    "so the test could not fail here"
)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_SCHEDULING)
@pytest.mark.parametrize("version", VERSIONS)
def test_backward_is_deterministic(version: str, device: str) -> None:
    """Under torch.use_deterministic_algorithms(True), five backward passes on the same inputs
    give bitwise-identical gradients. fa1, fa2 and torch are deterministic anyway; fa3's own
    backward adds dQ in arrival order by default (as flash-attn's) and in column-block order
    under the flag."""
    case = Case(
        batch=2, seqlen_q=1030, seqlen_k=1500, heads_q=8, heads_kv=2, head_dim=64, causal=True
    )
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require(version, case, q, k, v)
    dout = make_grad_out(case, device)
    ordered_backward_runs(
        lambda: None,
        lambda: dispatch.attention(q, k, v, causal=True, version=version),
        (q, k, v),
        dout,
    )


WINDOW_DET_CASES = [
    # A left edge (rows' first column blocks move right), Nq < Nk, GQA; both edges, Nq > Nk
    # (rows that see no key); D 256 on its own layout.
    Case(batch=2, seqlen_q=700, seqlen_k=1300, heads_q=4, heads_kv=2, head_dim=64,
         window_size=(200, 0)),
    Case(batch=1, seqlen_q=1000, seqlen_k=600, heads_q=2, heads_kv=2, head_dim=128,
         window_size=(130, 70)),
    Case(batch=1, seqlen_q=500, seqlen_k=500, heads_q=2, heads_kv=1, head_dim=256,
         window_size=(64, 0)),
]  # fmt: skip


@pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_SCHEDULING)
@pytest.mark.parametrize("case", WINDOW_DET_CASES, ids=lambda c: c.id)
def test_fa3_deterministic_window_backward(case: Case, device: str, monkeypatch) -> None:
    """fa3's own backward under torch.use_deterministic_algorithms with a sliding window (each
    row block's dQ turns start at its first column block, bwd_host.turn_counters): five runs
    bitwise equal and the gradients against the oracle. A counter started past a row block's
    first column block hangs the kernel: the watchdog then ends the process with every
    thread's traceback (a hung GPU cannot be interrupted from Python)."""
    if "fa3" not in runnable_names():
        pytest.skip("fa3 not runnable here")
    monkeypatch.setenv("FLASHSUITE_FA3_BWD", "1")  # taken by default once it has run on a GPU
    q, k, v = make_inputs(case, device, requires_grad=True)
    _require("fa3", case, q, k, v)
    dout = make_grad_out(case, device)
    choice, grads = ordered_backward_runs(
        lambda: dispatch.select(q, k, v, **case.options(), version="fa3"),
        lambda: dispatch.attention(q, k, v, **case.options(), version="fa3"),
        (q, k, v),
        dout,
    )
    assert choice.backward == "fa3", choice
    ref = _oracle(case, q, k, v, dout)
    got = dict(zip(("dq", "dk", "dv"), grads, strict=True))
    _assert_ok([compare(name, t, *ref[name]) for name, t in got.items()])
