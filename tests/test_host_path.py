"""The eager host path of `attention`: per static signature, one validation and one selection,
memoised; any change of shape, dtype, option, version or selection state decides afresh.

Selection is planned for other architectures with `override_arch` (nothing is launched), so
the plans of fa3 and fa2 on sm90 are checked on a CPU-only machine.
"""

from __future__ import annotations

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common import validation
from flashsuite.common.arch import override_arch
from flashsuite.dispatch import api

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _qkv(n=128, d=64, dtype=BF16, hq=2, hkv=2, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    shapes = ((1, n, hq, d), (1, n, hkv, d), (1, n, hkv, d))
    return tuple(
        torch.randn(s, generator=gen).to(dtype).requires_grad_(requires_grad) for s in shapes
    )


def _fresh(*args, **kwargs):
    """The uncached answer: a plan made with an empty memo, and select()'s Choice."""
    api._plans.clear()
    return api._plan(*args, **kwargs), dispatch.select(*args, **kwargs)


# (arch, tensor kwargs, options): fa3, fa2 (fp32 on sm90; sm80), torch (CPU; head_dim 200).
CASES = [
    (90, {}, {}),
    (90, {}, {"causal": True}),
    (90, {"d": 128}, {"window_size": (16, 0), "softcap": 30.0}),
    (90, {"dtype": F32}, {}),
    (80, {"dtype": F16, "hq": 4, "hkv": 2}, {"causal": True}),
    (None, {}, {}),
    (90, {"d": 200}, {}),
    (90, {"requires_grad": True}, {"causal": True}),
]


@pytest.mark.parametrize("arch, shape, options", CASES)
def test_cached_plan_is_the_uncached_choice(arch, shape, options) -> None:
    """The memoised plan names the version and problem select() chooses without any memo, and
    a repeated call is served from the memo (the same plan object)."""
    q, k, v = _qkv(**shape)
    with override_arch(arch):
        plan, choice = _fresh(q, k, v, **options)
        assert (plan.version, plan.params) == (choice.version, choice.params)
        assert plan.needs_grad == (choice.backward is not None)
        assert api._plan(q, k, v, **options) is plan


def _changes():
    """(name, tensor kwargs, options, version) each differing from the base in one thing."""
    return [
        ("dtype", {"dtype": F32}, {}, "auto"),
        ("dtype f16", {"dtype": F16}, {}, "auto"),
        ("causal", {}, {"causal": True}, "auto"),
        ("window", {}, {"window_size": (8, 8)}, "auto"),
        ("window right", {}, {"window_size": (8, 0)}, "auto"),
        ("softcap", {}, {"softcap": 5.0}, "auto"),
        ("scale", {}, {"softmax_scale": 0.5}, "auto"),
        ("seqlen", {"n": 256}, {}, "auto"),
        ("head_dim", {"d": 128}, {}, "auto"),
        ("heads", {"hq": 4, "hkv": 1}, {}, "auto"),
        ("version", {}, {}, "fa2"),
        ("grad", {"requires_grad": True}, {}, "auto"),
    ]


@pytest.mark.parametrize("name, shape, options, version", _changes(), ids=lambda c: str(c))
def test_changed_call_is_not_served_stale(name, shape, options, version) -> None:
    """With the base call memoised, a call differing in one thing gets the plan it would get
    with no memo at all, never the base's."""
    with override_arch(90):
        api._plans.clear()
        base = api._plan(*_qkv())
        assert base.version == "fa3"
        q, k, v = _qkv(**shape)
        got = api._plan(q, k, v, version=version, **options)
        want, choice = _fresh(q, k, v, version=version, **options)
        assert (got.version, got.params, got.needs_grad) == (
            want.version,
            want.params,
            want.needs_grad,
        )
        assert got.version == choice.version
        assert (got.params, got.version, got.needs_grad) != (
            base.params,
            base.version,
            base.needs_grad,
        )


def test_selection_state_is_part_of_the_key(monkeypatch) -> None:
    """The arch override, FLASHSUITE_VERSION, FLASHSUITE_FA3_BWD and the deterministic switch
    change the plan of the very same call."""
    q, k, v = _qkv(requires_grad=True)
    api._plans.clear()
    with override_arch(90):
        assert api._plan(q, k, v).version == "fa3"
    with override_arch(80):
        assert api._plan(q, k, v).version == "fa2"
    with override_arch(90):
        monkeypatch.setenv("FLASHSUITE_VERSION", "torch")
        assert api._plan(q, k, v).version == "torch"
        monkeypatch.delenv("FLASHSUITE_VERSION")
        assert api._plan(q, k, v).version == "fa3"
        for env in ("0", "1"):
            monkeypatch.setenv("FLASHSUITE_FA3_BWD", env)
            plan = api._plan(q, k, v)
            assert dispatch.select(q, k, v).backward == ("fa2" if env == "0" else "fa3")
            assert api._plan(q, k, v) is plan
        torch.use_deterministic_algorithms(True)
        try:
            assert api._plan(q, k, v) is not plan  # a new key, not the FA3_BWD=1 plan
            # fa3's own backward takes deterministic mode (fixed-order dQ, BwdConfig.deterministic)
            assert dispatch.select(q, k, v).backward == "fa3"
        finally:
            torch.use_deterministic_algorithms(False)


def test_bad_input_raises_after_a_good_one_is_memoised() -> None:
    """Memoised verdicts are for exact argument types: causal=1 equals True and hashes alike,
    but stays a TypeError; a non-contiguous last dim stays a ValueError."""
    q, k, v = _qkv()
    dispatch.attention(q, k, v, causal=True, version="torch")
    with pytest.raises(TypeError, match="causal: expected a bool"):
        dispatch.attention(q, k, v, causal=1, version="torch")
    dispatch.attention(q, k, v, softcap=1.0, version="torch")
    with pytest.raises(TypeError, match="softcap: expected a float"):
        dispatch.attention(q, k, v, softcap=True, version="torch")
    strided = torch.randn(1, 128, 2, 128).to(BF16)[..., ::2]
    with pytest.raises(ValueError, match="q: the last dim"):
        dispatch.attention(strided, k, v, version="torch")
    with pytest.raises(ValueError, match="q: the last dim"):
        torch.ops.flashsuite.torch_fwd(strided, k, v, False, 0.125, -1, -1, 0.0, None, None, None)


def test_op_validation_memo_matches_check_inputs() -> None:
    """from_op_args answers a repeated signature from its memo with check_inputs' params, and
    a changed option with new ones."""
    q, k, v = _qkv()
    validation._validated.clear()
    first = validation.AttnParams.from_op_args(q, k, v, True, 0.125, -1, 0, 0.0)
    assert first == validation.check_inputs(q, k, v, causal=True, softmax_scale=0.125)
    assert validation.AttnParams.from_op_args(q, k, v, True, 0.125, -1, 0, 0.0) is first
    other = validation.AttnParams.from_op_args(q, k, v, False, 0.125, 4, 4, 0.0)
    assert (other.causal, other.window_left) == (False, 4)


def test_fast_path_gives_the_op_path_result() -> None:
    """The memoised eager call (the version's forward called directly) returns what the
    custom op returns, and the profiler, which must see the op, gets the op path."""
    q, k, v = _qkv(n=64)
    out, lse = dispatch.attention(q, k, v, causal=True, return_lse=True, version="torch")
    again = dispatch.attention(q, k, v, causal=True, return_lse=True, version="torch")
    ref = torch.ops.flashsuite.torch_fwd(q, k, v, True, 0.125, -1, 0, 0.0, None, None, None)
    for got in (out, lse), again:
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    with torch.profiler.profile() as prof:
        dispatch.attention(q, k, v, causal=True, version="torch")
    assert any("flashsuite::torch_fwd" in e.name for e in prof.events())


def _views(device="cpu", dtype=BF16):
    """q, k, v of one problem (2 sequences, GQA 4 / 2) as a contiguous batch, as (B, H, N, D)
    tensors transposed to (B, N, H, D) (outer strides of another order), and as a slice of
    wider rows."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 96, h, 64, generator=gen).to(device, dtype) for h in (4, 2, 2))
    yield "contiguous", (q, k, v)
    yield "transposed", tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    yield "sliced", tuple(torch.cat([t, t], dim=-1)[..., :64] for t in (q, k, v))


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (8, 3)}])
def test_bound_forward_is_the_version_forward(options, device) -> None:
    """fa2's bound forward (dispatch's plan for a call without a gradient: the launch plan
    kept, the output strides precomputed) gives its forward's out and lse bit for bit on every
    layout of the same problem (through the Triton interpreter on a CPU, the memoised compiled
    launches on a GPU), and every later call of the memoised plan goes through it. A call
    that does not return the LSE runs the kernel build that stores none: the same out, and
    the bound forward's LSE is None."""
    from flashsuite.fa2 import interface as fa2

    for layout, (q, k, v) in _views(device):
        api._plans.clear()
        plan = api._plan(q, k, v, version="fa2", return_lse=True, **options)
        assert plan is not None and plan.version == "fa2" and plan.bound is not None, layout
        ref = fa2.forward(q, k, v, plan.params)
        for got in plan.bound(q, k, v), dispatch.attention(q, k, v, return_lse=True,
                                                            version="fa2", **options):  # fmt: skip
            for a, b in zip(got, ref, strict=True):
                assert a.is_contiguous()
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=layout)
        plan = api._plan(q, k, v, version="fa2", **options)
        out, lse = plan.bound(q, k, v)
        assert lse is None and out.is_contiguous(), layout
        torch.testing.assert_close(out, ref[0], atol=0, rtol=0, msg=layout)
        got = dispatch.attention(q, k, v, version="fa2", **options)
        torch.testing.assert_close(got, ref[0], atol=0, rtol=0, msg=layout)


def test_fa3_bound_forward_launches_what_forward_launches(monkeypatch) -> None:
    """fa3's bound forward passes its compiled binary the arguments `forward` passes (the
    tensors' shapes, strides, dtypes, alignment and every scalar), on CPU with the binary
    recorded instead of run; fp8 and empty problems have no bound forward (their `forward`
    does more: descales and V's layout; zero-filled outputs)."""
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import compile as fa3_compile
    from flashsuite.fa3 import interface as fa3

    calls = []
    monkeypatch.setattr(fa3_compile, "get_forward", lambda key: lambda *a: calls.append(a))
    props = type("Props", (), {"multi_processor_count": 132})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)

    def described(args):
        """Each tensor's shape, strides and dtype, and its address (q, k, v: the inputs, not
        copied when aligned) or alignment (the new outputs); every other argument as is."""
        return [
            (a.shape, a.stride(), a.dtype, a.data_ptr() if i < 3 else a.data_ptr() % 16)
            if isinstance(a, torch.Tensor)
            else a
            for i, a in enumerate(args)
        ]

    with override_arch(90):
        for layout, (q, k, v) in _views():
            # {}: Q in registers (persistent); causal: the tile counter's counters (a fresh
            # pair on a CPU) in cu_seqlens_k's slot.
            for opts in (
                {},
                {"causal": True},
                {"causal": True, "softcap": 5.0},
                {"window_size": (8, 3)},
            ):
                p = check_inputs(q, k, v, **opts)
                fa3._plans.clear()
                fa3.forward(q, k, v, p)
                fa3.bind_forward(p)(q, k, v)
                assert described(calls[-1]) == described(calls[-2]), (layout, opts)
        # One bound forward called in turn with every layout, and with views TMA cannot take
        # as they are, which both paths copy: the contiguous strides at a base 2 bytes off
        # 16, and a row stride of 136 bytes at an aligned base: the binary gets what
        # `forward` gives it every time, however the strides and base addresses alternate.
        layouts = list(_views())
        contiguous = layouts[0][1]
        off16 = [
            torch.empty(t.numel() + 8, dtype=t.dtype)[1 : 1 + t.numel()].view(t.shape).copy_(t)
            for t in contiguous
        ]
        wide = [torch.cat([t, t[..., :4]], dim=-1)[..., :64] for t in contiguous]
        layouts += [("base", tuple(off16)), ("stride", tuple(wide))]
        fa3._plans.clear()
        bound = fa3.bind_forward(check_inputs(*layouts[0][1]))
        for layout, (q, k, v) in layouts + layouts[::-1]:
            fa3.forward(q, k, v, check_inputs(q, k, v))
            bound(q, k, v)
            want, got = (
                [(a.shape, a.stride(), a.dtype, a.data_ptr() % 16) for a in c[:5]]
                for c in calls[-2:]
            )
            assert got == want and all(a[3] == 0 for a in got), layout
            assert calls[-1][5:] == calls[-2][5:], layout
        q, k, v = next(_views())[1]
        f8 = tuple(t.to(torch.float8_e4m3fn) for t in (q, k, v))
        assert fa3.bind_forward(check_inputs(*f8)) is None
        assert fa3.bind_forward(check_inputs(q, k[:, :0], v[:, :0])) is None


@pytest.mark.parametrize("options", [{"causal": True}, {"window_size": (8, 3), "softcap": 5.0}])
def test_eager_autograd_gives_the_op_path_gradients(options) -> None:
    """With a gradient, the eager call runs the version's forward and backward from a
    torch.autograd.Function (not the custom op): the same out, lse and gradients (through out
    and lse) as the op pair's autograd, bit for bit; the profiler and a dispatch mode get the
    op path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashsuite.dispatch import registry

    q, k, v = _qkv(n=48, dtype=F32, hq=4, hkv=2, requires_grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=torch.Generator())
    pair = registry.op("torch")
    calls = []
    real_fwd, real_bwd = pair.forward_fn, pair.backward_fn
    try:
        pair.forward_fn = lambda *a: calls.append("fwd") or real_fwd(*a)
        pair.backward_fn = lambda *a, **kw: calls.append("bwd") or real_bwd(*a, **kw)
        out, lse = dispatch.attention(q, k, v, return_lse=True, version="torch", **options)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    finally:
        pair.forward_fn, pair.backward_fn = real_fwd, real_bwd
    assert calls == ["fwd", "bwd"] and out.grad_fn is not None and lse.requires_grad
    assert "EagerAttention" in type(out.grad_fn).__name__, type(out.grad_fn).__name__
    p = validation.check_inputs(q, k, v, **options)
    ref_out, ref_lse = pair(q, k, v, p)  # the custom op, with its registered autograd
    ref_grads = torch.autograd.grad((ref_out, ref_lse), (q, k, v), (dout, dlse))
    for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    calls.clear()
    with Seen():
        dispatch.attention(q, k, v, version="torch", **options)
    assert any("flashsuite.torch_fwd" in c for c in calls), calls
    with torch.profiler.profile() as prof:
        dispatch.attention(q, k, v, version="torch", **options).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"flashsuite::torch_fwd", "flashsuite::torch_bwd"} <= names, names


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: `compiled[grid](*every_argument)` (its launch
    with hooks) and `compiled.run(...)` (its C launcher) are recorded."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("compiled", grid, args))

    def run(self, *launch_args):
        self.calls.append(("direct", launch_args))


class _Hooks:
    """Triton's knobs.runtime with its launch hook chains (`calls`: the installed hooks)."""

    def __init__(self, installed: list) -> None:
        self.launch_enter_hook = type("Chain", (), {"calls": installed})()
        self.launch_exit_hook = None


class _FakeJit:
    """Stands in for a Triton JITFunction: `fn[grid](*args, **kwargs)` is recorded and returns
    the compiled kernel, as JITFunction.run does."""

    def __init__(self, arg_names: list[str], calls: list) -> None:
        self.arg_names, self.calls = arg_names, calls

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return _FakeCompiled(self.calls)

        return run


def test_triton_launch_reuses_the_compiled_kernel_only_for_the_same_specialisation(
    monkeypatch,
) -> None:
    """common.triton_launch.launch: the first call of a specialisation goes through Triton; the
    same one again calls the compiled kernel with every argument in signature order (this
    call's tensors, a 3-d grid): through its C launcher on torch's current stream, or where a
    launch hook is installed or the Triton version is another, through `compiled[grid]`. A
    different int, a misaligned pointer, another dtype or keyword value is a new
    specialisation; a plan's token stands for its keyword arguments; a parameter left to its
    default, an argument that is neither a tensor nor a plain value, and the interpreter keep
    Triton's path."""
    from flashsuite.common import triton_launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_launch, "_compiled", {})
    # Triton's own launch of the compiled kernel (another Triton version, or a hook installed).
    monkeypatch.setattr(triton_launch, "_runtime_known", True)
    monkeypatch.setattr(triton_launch, "_runtime", None)
    calls: list = []
    fn = _FakeJit(["x", "n", "y", "BLOCK"], calls)
    x, y, y2 = torch.zeros(8), torch.zeros(8), torch.ones(8)
    kw = dict(y=y, BLOCK=16, num_warps=4)

    def via(args, kwargs, grid=(2,)):
        calls.clear()
        triton_launch.launch(fn, grid, args, kwargs)
        (call,) = calls
        return call

    assert via((x, 5), kw)[0] == "triton"
    kind, grid, args = via((x, 5), {**kw, "y": y2}, grid=(3, 2))
    assert (kind, grid) == ("compiled", (3, 2, 1)) and args[:2] == (x, 5)
    assert args[2] is y2 and args[3] == 16 and len(args) == 4
    for args, kwargs in (
        ((x, 6), kw),  # another int
        ((x[1:], 5), kw),  # 4 bytes off a 16-byte boundary
        ((x.double(), 5), kw),  # another dtype
        ((x, 5), {**kw, "BLOCK": 32}),  # another constexpr
        ((x, 5), {**kw, "num_warps": 8}),  # another launch option
    ):
        assert via(args, kwargs)[0] == "triton", (args, kwargs)
        assert via(args, kwargs)[0] == "compiled", (args, kwargs)
    # EXTRA keeps its default: never memoised.
    fn = _FakeJit(["x", "n", "y", "BLOCK", "EXTRA"], calls)
    assert via((x, 5), kw)[0] == via((x, 5), kw)[0] == "triton"
    fn = _FakeJit(["x", "n", "y", "BLOCK"], calls)
    assert via((x, (5, 6)), kw)[0] == via((x, (5, 6)), kw)[0] == "triton"  # a tuple argument
    desc = type("Descriptor", (), {"__hash__": None})()  # unhashable, as TensorDescriptor is
    assert via((x, desc), kw)[0] == via((x, desc), kw)[0] == "triton"
    assert via((5, x), kw)[0] == via((5, x), kw)[0] == "triton"  # no leading tensor
    # A plan's token stands for its keyword arguments: a hit takes the plan's stored values;
    # another plan is another key; a plan with a tensor among them is not memoised.
    plan_kw, plan = dict(y=7, BLOCK=16, num_warps=4), object()

    def planned(token, kwargs=plan_kw):
        calls.clear()
        triton_launch.launch(fn, (2,), (x, 5), kwargs, plan=token)
        (call,) = calls
        return call

    assert planned(plan)[0] == "triton"
    kind, _, args = planned(plan)
    assert kind == "compiled" and args == (x, 5, 7, 16)
    assert planned(object())[0] == "triton"
    tensor_plan = object()
    assert planned(tensor_plan, kw)[0] == planned(tensor_plan, kw)[0] == "triton"
    # Triton 3.6 with no hook installed: its C launcher, on torch's current stream.
    monkeypatch.setattr(triton_launch, "_runtime", _Hooks([]))
    monkeypatch.setattr(triton_launch, "_stream", lambda device: 1234)
    assert via((x, 7), kw)[0] == "triton"
    kind, launch_args = via((x, 7), {**kw, "y": y2}, grid=(3,))
    assert (
        kind == "direct"
        and launch_args[:9] == (3, 1, 1, 1234, "function", "metadata") + (None,) * 3
    )
    assert launch_args[9:11] == (x, 7) and launch_args[11] is y2 and launch_args[12:] == (16,)
    monkeypatch.setattr(triton_launch, "_runtime", _Hooks([print]))  # a profiler's hook
    assert via((x, 7), kw)[0] == "compiled"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert via((x, 5), kw)[0] == via((x, 5), kw)[0] == "triton"


@pytest.mark.gpu
def test_gpu_triton_kernels_launched_again_give_the_same_results() -> None:
    """On a GPU every call after the first of a specialisation launches the memoised compiled
    kernel (common.triton_launch): fa2's forward and backward, fa2's split decode and its
    combine, and the Triton preprocess / dQ postprocess of fa3's backward give the same
    results on the third call as on the first, a view 2 bytes off a 16-byte boundary (another
    specialisation) gives the aligned call's forward, and the memo holds those kernels."""
    from flashsuite.common import triton_launch
    from flashsuite.fa2 import kernels as fa2_kernels
    from tests.conftest import runnable_names

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(BF16)

    q, k, v = (rand(2, 300, 4, 64).requires_grad_() for _ in range(3))
    for version in [v for v in ("fa2", "fa3") if v in runnable_names()]:
        runs = []
        for _ in range(3):
            out = dispatch.attention(q, k, v, causal=True, version=version)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
        for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], runs[2], strict=True):
            # fa3's dQ is added across column blocks in arrival order: last bits may differ.
            tol = 2e-2 if (version, name) == ("fa3", "dq") else 0.0
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"{version} {name}")
        buf = rand(q.numel() + 1)
        q_off = buf[1:].view(q.shape)  # 2 bytes past buf's (aligned) start
        q_off.copy_(q.detach())
        with torch.no_grad():
            torch.testing.assert_close(
                dispatch.attention(q_off, k, v, causal=True, version=version), runs[0][0],
                atol=0.0, rtol=0.0, msg=f"{version} misaligned q",
            )  # fmt: skip
    qd, kc, vc = rand(3, 1, 8, 64), rand(3, 4096, 2, 64), rand(3, 4096, 2, 64)
    lens = torch.tensor([4096, 1000, 7], dtype=torch.int32, device="cuda")
    dec = [
        dispatch.attention_with_kvcache(
            qd, kc, vc, cache_seqlens=lens, num_splits=3, version="fa2"
        )
        for _ in range(3)
    ]  # fmt: skip
    torch.testing.assert_close(dec[0], dec[2], atol=0.0, rtol=0.0)
    memo = {key[0] for key in triton_launch._compiled}
    assert fa2_kernels._attn_fwd in memo and fa2_kernels._bwd_preprocess in memo


def test_fa2_bound_forward_repeats_the_launch_forward_would_make(monkeypatch) -> None:
    """fa2's bound forward launches its memo entry directly once a call matched it (every
    pointer 16-byte aligned, the same strides and device), and goes through
    common.triton_launch.launch otherwise: whatever layouts and alignments the calls of one
    bound forward alternate, its kernel gets the arguments `forward` gives it (a misaligned
    base and other strides are specialisations of their own), and a call that matches the
    entry never builds the memo key (C launcher: "direct")."""
    from flashsuite.common import triton_launch
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa2 import interface as fa2
    from flashsuite.fa2 import kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_launch, "_compiled", {})
    monkeypatch.setattr(triton_launch, "_runtime_known", True)
    monkeypatch.setattr(triton_launch, "_runtime", _Hooks([]))
    monkeypatch.setattr(triton_launch, "_stream", lambda device: 1234)
    calls: list = []
    fake = _FakeJit(kernels._attn_fwd.arg_names, calls)
    compiles = iter(range(1000))

    def compile_(grid):  # each compile its own binary: a launch names the one it runs
        def run(*args, **kwargs):
            compiled = fake[grid](*args, **kwargs)
            compiled.function = f"binary {next(compiles)}"
            return compiled

        return run

    jit = type("Jit", (), {"__getitem__": lambda self, grid: compile_(grid)})()
    jit.arg_names = fake.arg_names
    monkeypatch.setattr(kernels, "_attn_fwd", jit)
    keys: list = []
    spec = triton_launch._spec
    monkeypatch.setattr(triton_launch, "_spec", lambda *a: keys.append(1) or spec(*a))

    def launched():
        """The last launch's binary (None: compiled for it) and positional kernel arguments:
        tensors by (shape, stride, dtype, address % 16), other values as they are."""
        call = calls[-1]
        args = call[2] if call[0] == "triton" else call[1][9:]
        binary = None if call[0] == "triton" else call[1][4]
        return binary, [
            (a.shape, a.stride(), a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a
            for a in args
        ][:19]

    layouts = list(_views())
    contiguous = layouts[0][1]
    off16 = [
        torch.empty(t.numel() + 8, dtype=t.dtype)[1 : 1 + t.numel()].view(t.shape).copy_(t)
        for t in contiguous
    ]
    layouts.append(("base", tuple(off16)))
    with override_arch(90):
        bound = fa2.bind_forward(check_inputs(*contiguous))
        # "base" has the contiguous strides: after "contiguous" only its alignment differs.
        again = [layouts[0], layouts[-1], layouts[0]]
        for layout, (q, k, v) in layouts + layouts[::-1] + again:
            fa2.forward(q, k, v, check_inputs(q, k, v))
            first, want = launched()
            keys.clear()
            bound(q, k, v)
            binary, got = launched()
            assert got == want, layout
            # The binary forward's call compiled or ran: the same specialisation's.
            assert binary is not None and binary == (first or binary), layout
            if first is None:
                assert binary == list(triton_launch._compiled.values())[-1][0].function
        # The last call repeated the bound forward's entry: launched directly, no key built.
        assert calls[-1][0] == "direct" and not keys


def test_every_memoised_triton_launch_names_all_its_parameters(monkeypatch, device) -> None:
    """`common.triton_launch.launch` memoises a kernel only when the call names every parameter
    after the positional ones (one left to its default goes through Triton's own launcher on
    every call, 20-40 µs). fa2's training step, its split decode with the append and the
    combine, its varlen forward and backward, fa3's varlen preprocess, and the shared dQ
    postprocess each name them all."""
    from flashsuite.common import (
        append_kernel,
        bwd_postprocess,
        bwd_preprocess,
        split_combine,
        triton_launch,
    )
    from flashsuite.fa2 import interface as fa2_interface

    calls = []
    real = triton_launch.launch

    def recording(fn, grid, args, kwargs, plan=None):
        calls.append((fn, len(args), set(kwargs)))
        return real(fn, grid, args, kwargs, plan)

    for mod in (fa2_interface, bwd_preprocess, bwd_postprocess, split_combine, append_kernel):
        monkeypatch.setattr(mod, "launch", recording)
    for causal in (False, True):
        q, k, v = (t.to(device).requires_grad_() for t in _qkv(n=48))
        out = dispatch.attention(q, k, v, causal=causal, version="fa2")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    gen = torch.Generator().manual_seed(1)
    qd = torch.randn(2, 1, 4, 64, generator=gen).to(device, BF16)
    kc, vc = (torch.randn(2, 256, 2, 64, generator=gen).to(device, BF16) for _ in range(2))
    lens = torch.tensor([256, 37], dtype=torch.int32, device=device)
    kn = torch.randn(2, 1, 2, 64, generator=gen).to(device, BF16)  # appended, then attended
    dispatch.attention_with_kvcache(
        qd, kc, vc, kn, kn, cache_seqlens=lens - 1, num_splits=3, version="fa2"
    )  # fmt: skip
    qv, kv, vv = (
        torch.randn(40, h, 64, generator=gen).to(device, BF16).requires_grad_() for h in (4, 2, 2)
    )
    cu = torch.tensor([0, 7, 40], dtype=torch.int32, device=device)
    out = dispatch.attention_varlen(qv, kv, vv, cu, cu, 33, 33, causal=True, version="fa2")
    torch.autograd.grad(out, (qv, kv, vv), torch.ones_like(out))
    rows = bwd_preprocess.varlen_pad_rows(40, 2, 64)
    bwd_preprocess.varlen_bwd_preprocess(  # fa3's varlen backward preprocess, with the dQ zeroing
        out.detach(), out.detach(), torch.zeros(4, 40, device=device), cu, 64,
        torch.empty(4, rows, 64, device=device),
    )  # fmt: skip
    acc = torch.randn(1, 2, 64, 64, generator=gen).to(device)
    cols = torch.arange(64, dtype=torch.int32, device=device)
    dq = torch.empty(1, 48, 2, 64, dtype=BF16, device=device)
    dq = bwd_postprocess.dq_postprocess(acc, cols * 64, cols, dq)
    assert torch.equal(dq, acc[:, :, :48].transpose(1, 2).to(BF16))
    names = {fn.__name__ for fn, _, _ in calls}
    assert {"_attn_fwd", "_bwd_preprocess", "_bwd_dkdv", "_bwd_dq", "_decode_split"} <= names
    assert {"_combine", "_dq_postprocess", "_append_kv"} <= names
    assert {"_varlen_fwd", "_varlen_bwd_preprocess", "_varlen_bwd_dkdv", "_varlen_bwd_dq"} <= names
    assert bwd_preprocess._varlen_bwd_preprocess in {fn for fn, _, _ in calls}
    for fn, n_args, given in calls:
        missing = [p for p in fn.arg_names[n_args:] if p not in given]
        assert not missing, f"{fn.__name__} launched with {missing} left to their defaults"


def test_next_power_of_2_is_tritons() -> None:
    """common.triton_launch.next_power_of_2 (the launch code's pads: head dims, row counts) is
    triton.next_power_of_2 for every host int up to past 4k, 0 included."""
    triton = pytest.importorskip("triton")
    from flashsuite.common.triton_launch import next_power_of_2

    assert [next_power_of_2(n) for n in range(4200)] == [
        triton.next_power_of_2(n) for n in range(4200)
    ]
