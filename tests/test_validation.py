"""Bad input gets a clear error naming the tensor or option, the expected and the actual value."""

from __future__ import annotations

import pytest
import torch

from flashsuite import dispatch


def qkv(b=1, nq=8, nk=8, hq=2, hkv=2, d=16, dv=None, dtype=torch.float16):
    q = torch.randn(b, nq, hq, d).to(dtype)
    k = torch.randn(b, nk, hkv, d).to(dtype)
    v = torch.randn(b, nk, hkv, d if dv is None else dv).to(dtype)
    return q, k, v


def _bad_cases():
    q, k, v = qkv()
    f8 = torch.float8_e4m3fn
    q8, k8, v8 = (t.to(f8) for t in (q, k, v))
    cases = [
        # (id, args, kwargs, exception, fragments the message must contain)
        ("q-not-tensor", (q.numpy(), k, v), {}, TypeError, ["q:", "torch.Tensor", "ndarray"]),
        ("k-not-tensor", (q, [1, 2], v), {}, TypeError, ["k:", "list"]),
        ("q-3d", (q[0], k, v), {}, ValueError, ["q:", "4-D", "3-D", "(8, 2, 16)"]),
        ("v-5d", (q, k, v[None]), {}, ValueError, ["v:", "4-D", "5-D"]),
        ("q-int", (q.to(torch.int32), k, v), {}, TypeError, ["q:", "dtype", "int32"]),
        ("k-dtype-mismatch", (q, k.float(), v), {}, TypeError, ["k:", "float16", "float32"]),
        ("v-dtype-mismatch", (q, k, v.bfloat16()), {}, TypeError, ["v:", "float16", "bfloat16"]),
        ("batch-mismatch", (q, torch.cat([k, k]), v), {}, ValueError, ["k:", "batch 1", "got 2"]),
        ("v-batch", (q, k, torch.cat([v, v])), {}, ValueError, ["v:", "batch 1", "got 2"]),
        ("kv-seqlen", (q, k, v[:, :5]), {}, ValueError, ["v:", "seqlen 8", "got 5"]),
        ("kv-heads", (q, k, v[:, :, :1]), {}, ValueError, ["v:", "2 heads", "got 1"]),
        ("head-dim", (q, k[..., :8], v), {}, ValueError, ["k:", "head_dim 16", "got 8"]),
        ("gqa-divisible", qkv(hq=3, hkv=2), {}, ValueError, ["Hq % Hkv", "3", "got 2"]),
        ("head-dim-too-big", qkv(d=320), {}, ValueError, ["q:", "[1, 256]", "320"]),
        ("v-head-dim-too-big", qkv(dv=264), {}, ValueError, ["v:", "[1, 256]", "264"]),
        (
            "last-dim-strided",
            (q[..., ::2], k[..., ::2], v),
            {},
            ValueError,
            ["q:", "contiguous", "stride(-1) == 1", "got 2"],
        ),
        ("causal-not-bool", (q, k, v), {"causal": 1}, TypeError, ["causal", "bool", "int"]),
        ("window-not-pair", (q, k, v), {"window_size": (3,)}, TypeError, ["window_size", "(3,)"]),
        ("window-float", (q, k, v), {"window_size": (1.5, 2)}, TypeError, ["window_size"]),
        (
            "window-below-minus-one",
            (q, k, v),
            {"window_size": (-2, 0)},
            ValueError,
            ["window_size", "left", ">= -1", "-2"],
        ),
        (
            "scale-nan",
            (q, k, v),
            {"softmax_scale": float("nan")},
            ValueError,
            ["softmax_scale", "finite", "nan"],
        ),
        ("scale-str", (q, k, v), {"softmax_scale": "0.1"}, TypeError, ["softmax_scale", "'0.1'"]),
        ("softcap-negative", (q, k, v), {"softcap": -1.0}, ValueError, ["softcap", ">= 0", "-1"]),
        ("softcap-inf", (q, k, v), {"softcap": float("inf")}, ValueError, ["softcap", "inf"]),
        (
            "descale-not-fp8",
            (q, k, v),
            {"descale_q": torch.ones(1, 2)},
            ValueError,
            ["descale_q", "float8", "float16"],
        ),
        (
            "descale-shape",
            (q8, k8, v8),
            {"descale_k": torch.ones(2, 2)},
            ValueError,
            ["descale_k", "(1, 2)", "(2, 2)"],
        ),
        (
            "descale-dtype",
            (q8, k8, v8),
            {"descale_v": torch.ones(1, 2).half()},
            TypeError,
            ["descale_v", "float32", "float16"],
        ),
        ("unknown-option", (q, k, v), {"dropout_p": 0.1}, TypeError, ["dropout_p"]),
        ("unknown-version", (q, k, v), {"version": "fa9"}, ValueError, ["version", "'fa9'"]),
    ]
    return [pytest.param(*c[1:], id=c[0]) for c in cases]


@pytest.mark.parametrize(("args", "kwargs", "exc", "fragments"), _bad_cases())
def test_bad_input_is_named(args, kwargs, exc, fragments) -> None:
    with pytest.raises(exc) as info:
        dispatch.attention(*args, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("entry", ["select", "explain"])
def test_select_and_explain_validate_too(entry: str) -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k: expected head_dim 16"):
        getattr(dispatch, entry)(q, k[..., :8], v)


def test_device_mismatch_is_named() -> None:
    q, k, v = qkv()
    meta = torch.empty(k.shape, dtype=k.dtype, device="meta")
    with pytest.raises(ValueError, match=r"k: expected device cpu \(q's device\), got meta"):
        dispatch.attention(q, meta, v)


def test_env_version_must_be_known(monkeypatch) -> None:
    monkeypatch.setenv("FLASHSUITE_VERSION", "fa7")
    with pytest.raises(ValueError, match="'fa7'"):
        dispatch.attention(*qkv())


def test_valid_edge_inputs_are_accepted() -> None:
    """Not everything unusual is an error: MQA, Dv != D, head_dim 1, window (-1, -1)."""
    q, k, v = qkv(hq=4, hkv=1, d=1, dv=3, dtype=torch.float32)
    out = dispatch.attention(q, k, v, window_size=(-1, -1), softmax_scale=2)
    assert out.shape == (1, 8, 4, 3)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True, "softmax_scale": 0.3},
        {"window_size": (5, 2), "softcap": 20.0},
        {"window_size": (-1, 0)},  # reported as causal
    ],
    ids=["plain", "causal-scale", "window-softcap", "window-causal"],
)
def test_op_args_and_key_round_trip(options: dict) -> None:
    """AttnParams -> the ops' option arguments / the selection key -> the same AttnParams."""
    from flashsuite.common.validation import AttnParams, check_inputs

    q, k, v = qkv(b=2, nq=8, nk=12, hq=4, hkv=2, dv=8)
    p = check_inputs(q, k, v, **options)
    args = p.to_op_args()
    assert len(args) == len(AttnParams.OP_ARGS)
    assert AttnParams.from_op_args(q, k, v, *args) == p
    key = p.to_key()
    assert hash(key) == hash(tuple(key))
    assert AttnParams.from_key(key) == p
    with pytest.raises(ValueError, match="window_size"):
        AttnParams.from_op_args(q, k, v, False, 1.0, -3, 0, 0.0)


def test_metadata_checks_follow_their_switch(monkeypatch) -> None:
    """FLASHSUITE_CHECK_METADATA: unset or 1 keeps the value checks on, 0 or empty turns them
    off; read on every call (a test or a serving loop may flip it between calls)."""
    from flashsuite.common.metadata import metadata_checks_enabled

    monkeypatch.delenv("FLASHSUITE_CHECK_METADATA", raising=False)
    assert metadata_checks_enabled()
    for value, on in (("0", False), ("", False), ("1", True), ("0", False)):
        monkeypatch.setenv("FLASHSUITE_CHECK_METADATA", value)
        assert metadata_checks_enabled() is on, value
