"""Dispatch: the selection table (with a mocked architecture), explicit versions, explain, sdpa."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from flashsuite import dispatch
from flashsuite.common.arch import override_arch, parse_arch
from flashsuite.dispatch import registry

BF16, F16, F32, F8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn


def _qkv(d=128, dtype=BF16, n=256, hq=4, hkv=4, requires_grad=False):
    q = torch.randn(2, n, hq, d).to(dtype).requires_grad_(requires_grad)
    k = torch.randn(2, n, hkv, d).to(dtype).requires_grad_(requires_grad)
    v = torch.randn(2, n, hkv, d).to(dtype).requires_grad_(requires_grad)
    return q, k, v


# (arch, dtype, head_dim, options, expected version, why)
TABLE = [
    (90, BF16, 128, {}, "fa3", "Hopper, a shape fa3 supports"),
    (90, F16, 64, {"causal": True}, "fa3", "Hopper, causal"),
    (90, F32, 128, {}, "fa2", "fa3 has no fp32 path"),
    (90, BF16, 32, {}, "fa2", "head_dim 32 is not in fa3's tile table"),
    (80, BF16, 128, {"causal": True}, "fa2", "Ampere"),
    (86, F16, 64, {"softcap": 30.0}, "fa2", "Ampere consumer, softcap"),
    (100, BF16, 128, {}, "fa2", "newer than Hopper: fa3 is sm90-only"),
    (75, F16, 64, {"causal": True}, "fa1", "Turing: FA1 is the pick before sm80"),
    (75, BF16, 64, {}, "torch", "fa1 needs sm80 for bf16"),
    (75, F16, 64, {"window_size": (8, 8)}, "torch", "fa1 has no sliding window"),
    (None, F16, 64, {}, "torch", "CPU"),
    (90, BF16, 200, {}, "sdpa", "head_dim 200 fits no kernel: PyTorch's SDPA"),
    (80, F16, 80, {"causal": True}, "sdpa", "head_dim 80 fits no kernel: PyTorch's SDPA"),
    (90, F32, 200, {}, "sdpa", "fp32, head_dim a multiple of 8: SDPA's memory-efficient"),
    (90, F32, 100, {}, "torch", "fp32 head_dim 100: only SDPA's math backend (N x N)"),
    (90, BF16, 200, {"softcap": 5.0}, "torch", "SDPA has no softcap"),
    (90, BF16, 200, {"window_size": (8, 0)}, "torch", "SDPA has no sliding window"),
    (90, BF16, 200, {"return_lse": True}, "torch", "SDPA returns no LSE"),
    (75, F16, 200, {}, "torch", "before sm80 PyTorch's SDPA is not tried"),
]


@pytest.mark.parametrize(
    ("arch", "dtype", "d", "options", "expected", "why"),
    TABLE,
    ids=[f"sm{a}-{str(t)[6:]}-d{d}-{e}" for a, t, d, _, e, _ in TABLE],
)
def test_selection_table(arch, dtype, d, options, expected, why) -> None:
    q, k, v = _qkv(d=d, dtype=dtype)
    with override_arch(arch):
        ok, reason = registry.available(expected) if expected != "sdpa" else (True, "")
        if not ok:
            pytest.skip(f"{expected} unavailable here: {reason}")
        choice = dispatch.select(q, k, v, **options)
    assert choice.version == expected, f"{why}\n{choice}"
    assert choice.arch == arch
    assert len(choice.reasons) == dispatch.auto_order(arch).index(expected) + 1


def test_env_arch_override(monkeypatch) -> None:
    monkeypatch.setenv("FLASHSUITE_ARCH", "sm_80")
    choice = dispatch.select(*_qkv())
    assert choice.arch == 80
    assert parse_arch("9.0") == 90 and parse_arch("cpu") is None and parse_arch("90a") == 90
    with pytest.raises(ValueError, match="FLASHSUITE_ARCH"):
        parse_arch("hopper")


def test_real_arch_asks_torch_once_per_device(monkeypatch) -> None:
    """common.arch.real_arch: a CUDA device's capability is read from torch once (every launch
    that plans by arch asks), per device index, whichever way the device is named; CPU devices
    and a machine without CUDA give None."""
    from flashsuite.common import arch as arch_mod

    asked = []
    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(arch_mod, "_real_archs", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or caps[i])
    for device in (torch.device("cuda", 0), "cuda:0", 0, torch.device("cuda", 0)):
        assert arch_mod.real_arch(device) == 90
    assert arch_mod.real_arch() == 80 and arch_mod.real_arch("cuda") == 80
    assert asked == [0, 1]
    assert arch_mod.real_arch(torch.device("cpu")) is None and arch_mod.real_arch("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert arch_mod.real_arch("cuda:1") is None and arch_mod.real_arch() is None


@pytest.mark.parametrize(
    ("d", "options", "env", "backward", "why"),
    [
        (128, {"causal": True}, "1", "fa3", "own backward: fa3 backward: 64x128 tiles"),
        (64, {}, "1", "fa3", "own backward: fa3 backward: 128x128 tiles"),
        (128, {"causal": True}, None, "fa3", "own backward: fa3 backward: 64x128 tiles"),
        (128, {"causal": True}, "0", "fa2", "FLASHSUITE_FA3_BWD=0"),
        (128, {"softcap": 30.0}, "1", "fa3", "own backward: fa3 backward: 64x128 tiles"),
        (128, {"window_size": (64, 0)}, "1", "fa3", "own backward: fa3 backward: 64x128 tiles"),
        (96, {"causal": True}, None, "fa3", "own backward: fa3 backward: 64x128 tiles"),
        (96, {"causal": True}, "1", "fa3", "own backward: fa3 backward: 64x128 tiles"),
        (256, {}, None, "fa3", "own backward: fa3 backward: 64x80 tiles"),
        (256, {"softcap": 30.0}, None, "fa3", "own backward: fa3 backward: 64x48 tiles"),
        (256, {}, "1", "fa3", "own backward: fa3 backward: 64x80 tiles"),
        (192, {"causal": True}, "1", "fa3", "P and dS through smem, dK^T / dV^T with D on M"),
    ],
)
def test_fa3_backward_own_or_fa2(monkeypatch, d, options, env, backward, why) -> None:
    if env is None:
        monkeypatch.delenv("FLASHSUITE_FA3_BWD", raising=False)
    else:
        monkeypatch.setenv("FLASHSUITE_FA3_BWD", env)
    q, k, v = _qkv(d=d, requires_grad=True)
    with override_arch(90):
        if not (registry.available("fa3")[0] and registry.available("fa2")[0]):
            pytest.skip("needs fa3 and fa2 importable")
        choice = dispatch.select(q, k, v, **options)
        text = dispatch.explain(q, k, v, **options)
    assert (choice.version, choice.backward) == ("fa3", backward), text
    assert f"backward: {backward}" in text
    assert why in text, text


def test_unverified_backward_build_runs_only_when_asked(monkeypatch) -> None:
    """A (head_dim, feature) listed in bwd_configs.BWD_UNVERIFIED (compiled, not yet run on a
    GPU) gets fa2's backward unless FLASHSUITE_FA3_BWD=1 asks for fa3's, and explain says why."""
    from flashsuite.fa3 import bwd_interface

    monkeypatch.setattr(bwd_interface, "BWD_UNVERIFIED", ((128, "softcap"),))
    q, k, v = _qkv(d=128, requires_grad=True)
    with override_arch(90):
        if not (registry.available("fa3")[0] and registry.available("fa2")[0]):
            pytest.skip("needs fa3 and fa2 importable")
        for env, backward in ((None, "fa2"), ("1", "fa3")):
            if env is None:
                monkeypatch.delenv("FLASHSUITE_FA3_BWD", raising=False)
            else:
                monkeypatch.setenv("FLASHSUITE_FA3_BWD", env)
            choice = dispatch.select(q, k, v, softcap=30.0)
            text = dispatch.explain(q, k, v, softcap=30.0)
            assert choice.backward == backward, text
            if env is None:
                assert "head_dim 128 with softcap compiled but not yet run" in text, text
        monkeypatch.delenv("FLASHSUITE_FA3_BWD", raising=False)
        assert dispatch.select(q, k, v, window_size=(8, 8)).backward == "fa3"  # no softcap


def test_env_version_overrides_auto(monkeypatch) -> None:
    monkeypatch.setenv("FLASHSUITE_VERSION", "torch")
    q, k, v = _qkv(d=64, dtype=F32, n=16)
    with override_arch(90):
        choice = dispatch.select(q, k, v)
    assert choice.version == "torch"
    assert "FLASHSUITE_VERSION" in choice.reasons[0]


def test_explicit_version_never_falls_back() -> None:
    q, k, v = _qkv(d=64, dtype=F16, n=16)
    for version, options, fragment in [
        ("fa1", {"softcap": 5.0}, "softcap"),
        ("fa1", {"window_size": (4, 4)}, "window"),
        ("fa3", {}, "sm90"),
    ]:
        if not registry.available(version)[0]:
            continue
        with override_arch(80), pytest.raises(dispatch.Unsupported) as info:
            dispatch.attention(q, k, v, version=version, **options)
        message = str(info.value)
        assert f"version {version!r} cannot run" in message and fragment in message, message


def test_explicit_unavailable_version_explains_why(monkeypatch) -> None:
    monkeypatch.setitem(registry._MODULES, "fa2", "flashsuite.no_such_module")
    registry._import.cache_clear()
    try:
        with pytest.raises(dispatch.Unsupported, match="not available: cannot import"):
            dispatch.attention(*_qkv(d=64, dtype=F16, n=16), version="fa2")
        ok, reason = registry.available("fa2")
        assert not ok and "no_such_module" in reason
    finally:
        registry._import.cache_clear()


def test_explain_lists_every_candidate_tried() -> None:
    q, k, v = _qkv(d=200)
    with override_arch(90):
        text = dispatch.explain(q, k, v, softcap=5.0)
    assert text.splitlines()[0].endswith("-> torch")
    for name in dispatch.auto_order(90):
        assert f"  {name}:" in text


def test_auto_on_cpu_runs_the_portable_version() -> None:
    q, k, v = _qkv(d=32, dtype=F32, n=24)
    with override_arch(None):
        assert dispatch.select(q, k, v).version == "torch"
        out = dispatch.attention(q, k, v)
    assert out.shape == q.shape


# (case, whether flashsuite's kernels compute it; else it goes to PyTorch's own SDPA)
SDPA_CASES = [
    (dict(nq=32, nk=32, is_causal=False), True),
    (dict(nq=32, nk=32, is_causal=True), True),
    (dict(nq=40, nk=24, is_causal=True), True),  # top-left causal, Nq > Nk: a window for us
    (dict(nq=24, nk=40, is_causal=True), False),  # top-left with Nq < Nk: PyTorch's own SDPA
    (dict(nq=32, nk=48, is_causal=False, hkv=2, enable_gqa=True), True),
    (dict(nq=32, nk=32, is_causal=False, scale=0.3), True),
    (dict(nq=32, nk=32, is_causal=False, mask=True), False),  # dense mask: PyTorch's own SDPA
    # torch.nn.attention.bias causal masks: lower right is our causal, upper left SDPA's.
    (dict(nq=24, nk=40, is_causal=False, bias="lower_right"), True),
    (dict(nq=40, nk=24, is_causal=False, bias="lower_right"), True),  # 16 rows see no key
    (dict(nq=40, nk=24, is_causal=False, bias="upper_left"), True),
    (dict(nq=24, nk=40, is_causal=False, bias="upper_left"), False),
]


def _causal_bias(kind: str, nq: int, nk: int):
    """The CausalBias object and the boolean mask (Nq, Nk) it stands for."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    i = torch.arange(nq).unsqueeze(1)  # (Nq, 1)
    j = torch.arange(nk).unsqueeze(0)  # (1, Nk)
    if kind == "lower_right":
        return causal_lower_right(nq, nk), j <= i + (nk - nq)
    return causal_upper_left(nq, nk), j <= i


def _sdpa_oracle(q, k, v, mask, is_causal, scale, enable_gqa):
    """SDPA's definition in float64 (layout (B, H, N, D), top-left causal, dense bool mask)."""
    q, k, v = (t.double() for t in (q, k, v))
    if enable_gqa:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    nq, nk = s.shape[-2:]
    if is_causal:
        above = ~torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(above, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v  # a row that sees no key: 0


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # ours: 0
@pytest.mark.parametrize("version", ["torch", "fa2"])
@pytest.mark.parametrize(
    ("case", "kernel"),
    SDPA_CASES,
    ids=["-".join(f"{k}{v}" for k, v in c.items()) for c, _ in SDPA_CASES],
)
def test_sdpa_is_a_drop_in(
    case: dict, kernel: bool, version: str, device: str, monkeypatch
) -> None:
    """dispatch.sdpa against SDPA's definition in float64 (the suite's comparison rule, with
    PyTorch's own SDPA in the input dtype as the yardstick); the cases the kernels can express
    must actually reach them (the version is forced through FLASHSUITE_VERSION)."""
    from flashsuite.common.testing import compare
    from flashsuite.dispatch import api

    if not registry.available(version)[0]:
        pytest.skip(f"{version} unavailable: {registry.available(version)[1]}")
    monkeypatch.setenv("FLASHSUITE_VERSION", version)
    calls = []
    real = api._run
    monkeypatch.setattr(api, "_run", lambda plan, *a: calls.append(plan.version) or real(plan, *a))
    gen = torch.Generator().manual_seed(0)
    hkv = case.get("hkv", 4)
    q = torch.randn(2, 4, case["nq"], 32, generator=gen).to(device)
    k = torch.randn(2, hkv, case["nk"], 32, generator=gen).to(device)
    v = torch.randn(2, hkv, case["nk"], 32, generator=gen).to(device)
    mask = torch.rand(case["nq"], case["nk"], generator=gen) > 0.3 if case.get("mask") else None
    mask = mask.to(device) if mask is not None else None
    attn_mask = mask
    if case.get("bias"):
        attn_mask, mask = _causal_bias(case["bias"], case["nq"], case["nk"])
        mask = mask.to(device)
    kwargs = dict(
        attn_mask=attn_mask,
        is_causal=case["is_causal"],
        scale=case.get("scale"),
        enable_gqa=case.get("enable_gqa", False),
    )
    got = dispatch.sdpa(q, k, v, **kwargs)
    assert calls == ([version] if kernel else []), (
        f"expected the {'kernel' if kernel else 'SDPA'} path"
    )
    ref = _sdpa_oracle(q, k, v, mask, case["is_causal"], kwargs["scale"], kwargs["enable_gqa"])
    pt = F.scaled_dot_product_attention(q, k, v, **kwargs)
    res = compare("out", got, ref, pt)
    assert res.ok, res


@pytest.mark.parametrize(("nq", "nk", "causal"), [(40, 40, False), (40, 40, True), (30, 50, True)])
def test_materialising_baseline_is_exact_attention(nq: int, nk: int, causal: bool) -> None:
    """The benchmark's materialising baseline (what fa1 is measured against) is exact attention."""
    from flashsuite.common.reference import attention_reference
    from flashsuite.dispatch.bench import materialising

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3, 16, generator=gen, dtype=F32) for n in (nq, nk, nk))
    out = materialising(q, k, v, causal)().transpose(1, 2)  # (B, Nq, H, D)
    ref, _ = attention_reference(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref.to(F32), atol=1e-5, rtol=1e-5)


def test_fa3_backward_chosen_per_call(monkeypatch) -> None:
    """The op's backward decides on every call (memoised per problem, architecture,
    deterministic setting and FLASHSUITE_FA3_BWD), so a change of a switch, or a switch set
    back, takes effect on the next call."""
    from flashsuite.common.validation import check_inputs

    with override_arch(90):
        if not (registry.available("fa3")[0] and registry.available("fa2")[0]):
            pytest.skip("needs fa3 and fa2 importable")
    calls = []
    for name in ("fa3", "fa2"):
        monkeypatch.setattr(
            registry.module(name), "backward", lambda *a, _n=name, **kw: calls.append(_n) or a[1:4]
        )
    monkeypatch.setenv("FLASHSUITE_FA3_BWD", "1")
    backward = registry._choosing_backward("fa3")
    q, k, v = _qkv(d=128)
    with override_arch(90):
        backward(q, q, k, v, q, None, check_inputs(q, k, v, causal=True))
        backward(q, q, k, v, q, None, check_inputs(q, k, v, softcap=30.0))
        monkeypatch.setenv("FLASHSUITE_FA3_BWD", "0")
        backward(q, q, k, v, q, None, check_inputs(q, k, v, causal=True))
        monkeypatch.setenv("FLASHSUITE_FA3_BWD", "1")
        was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:  # fa3 orders its dQ adds in deterministic mode (BwdConfig.deterministic)
            backward(q, q, k, v, q, None, check_inputs(q, k, v))
        finally:
            torch.use_deterministic_algorithms(was)
        monkeypatch.delenv("FLASHSUITE_FA3_BWD")  # the default: bwd_configs.BWD_DEFAULT_ON
        backward(q, q, k, v, q, None, check_inputs(q, k, v, causal=True))
        monkeypatch.setenv("FLASHSUITE_FA3_BWD", "0")  # a setting seen before: its answer
        backward(q, q, k, v, q, None, check_inputs(q, k, v, causal=True))
    default = "fa3" if registry.module("fa3").OWN_BACKWARD_DEFAULT else "fa2"
    assert calls == ["fa3", "fa3", "fa2", "fa3", default, "fa2"]


def test_fa3_backward_answers_follow_the_deterministic_switch(monkeypatch) -> None:
    """fa3's memoised backward support and compile key are per deterministic setting: the same
    problem with a window is described with the ordered dQ build exactly while
    torch.use_deterministic_algorithms is on; without a window the key that
    interface.backward launches carries the ordered dQ build exactly when the switch is on."""
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("needs the CuTe DSL (fa3 planning)")
    from flashsuite.common.validation import check_inputs
    from flashsuite.fa3 import bwd_host, interface

    launched = []
    monkeypatch.setattr(bwd_host, "run_backward", lambda key, *a: launched.append(key) or a[1:4])
    q, k, v = _qkv(d=64)
    local = check_inputs(q, k, v, window_size=(8, 0))
    plain = check_inputs(q, k, v, causal=True)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])  # (B, Hq, Nq)
    was = torch.are_deterministic_algorithms_enabled()
    answers = []
    try:
        for on in (False, True, False, True):
            torch.use_deterministic_algorithms(on)
            ok, reason = interface.supports_backward(local, 90)
            answers.append(ok and "(deterministic)" in reason)
            interface.backward(q, q, k, v, q, lse, plain)
    finally:
        torch.use_deterministic_algorithms(was)
    assert answers == [False, True, False, True]
    assert [key.cfg.deterministic for key in launched] == [False, True, False, True]
