"""flash-attn 2's functions (dispatch/flash_attn.py): flash-attn's signatures exactly (names,
order, defaults), the results of the entry points they wrap, and a clear error for every
argument flashsuite does not implement."""

from __future__ import annotations

import inspect

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.arch import override_arch
from flashsuite.dispatch import flash_attn, registry

F16, BF16, F32, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int32

# flash-attn 2's signatures (flash_attn/flash_attn_interface.py): (name, default) in order.
_EMPTY = inspect.Parameter.empty
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("dropout_p", 0.0),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
        ("return_attn_probs", False),
    ],
    "flash_attn_varlen_func": [
        ("q", _EMPTY), ("k", _EMPTY), ("v", _EMPTY), ("cu_seqlens_q", _EMPTY),
        ("cu_seqlens_k", _EMPTY), ("max_seqlen_q", _EMPTY), ("max_seqlen_k", _EMPTY),
        ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
    ],
    "flash_attn_qkvpacked_func": [
        ("qkv", _EMPTY), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False),
    ],
    "flash_attn_kvpacked_func": [
        ("q", _EMPTY), ("kv", _EMPTY), ("dropout_p", 0.0), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False),
    ],
    "flash_attn_varlen_qkvpacked_func": [
        ("qkv", _EMPTY), ("cu_seqlens", _EMPTY), ("max_seqlen", _EMPTY), ("dropout_p", 0.0),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
        ("return_attn_probs", False),
    ],
    "flash_attn_varlen_kvpacked_func": [
        ("q", _EMPTY), ("kv", _EMPTY), ("cu_seqlens_q", _EMPTY), ("cu_seqlens_k", _EMPTY),
        ("max_seqlen_q", _EMPTY), ("max_seqlen_k", _EMPTY), ("dropout_p", 0.0),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
        ("return_attn_probs", False),
    ],
    "flash_attn_with_kvcache": [
        ("q", _EMPTY), ("k_cache", _EMPTY), ("v_cache", _EMPTY), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False),
    ],
}  # fmt: skip


# Keyword-only parameters after flash-attn 2's (flash-attn 3's names for its fp8 descales).
KEYWORD_ONLY = {"flash_attn_with_kvcache": [("k_descale", None), ("v_descale", None)]}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_SIGNATURES))
def test_signature_is_flash_attns(name: str) -> None:
    """Positional calls written for flash-attn bind to the same parameters here; anything
    more is keyword-only."""
    params = inspect.signature(getattr(dispatch, name)).parameters.values()
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    extra = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in positional] == FLASH_ATTN_SIGNATURES[name]
    assert [(p.name, p.default) for p in extra] == KEYWORD_ONLY.get(name, [])
    assert len(positional) + len(extra) == len(params)
    assert getattr(dispatch, name) is getattr(flash_attn, name)


def _qkv(gen, b=2, nq=40, nk=56, hq=4, hkv=2, d=64, dtype=F16, grad=False):
    shapes = ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d))
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(grad) for s in shapes]


@pytest.mark.parametrize(
    "args, kwargs, options",
    [
        ((), {}, {}),
        ((0.0, 0.3, True), {}, dict(softmax_scale=0.3, causal=True)),  # positional
        ((), dict(window_size=[16, 0]), dict(window_size=(16, 0))),  # a list, as flash-attn
        ((), dict(softcap=5.0, causal=True), dict(softcap=5.0, causal=True)),
    ],
)
def test_flash_attn_func_is_attention(args, kwargs, options) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen, grad=True)
    got = dispatch.flash_attn_func(q, k, v, *args, **kwargs)
    want = dispatch.attention(q, k, v, **options)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    do = torch.randn(got.shape, generator=gen).to(F16)
    for g, w in zip(
        torch.autograd.grad(got, (q, k, v), do),
        torch.autograd.grad(want, (q, k, v), do),
        strict=True,
    ):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_return_attn_probs_gives_the_lse_and_an_empty_s_dmask() -> None:
    """flash-attn returns (out, softmax_lse, S_dmask), S_dmask empty without dropout."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen)
    out, lse, s_dmask = dispatch.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    want, want_lse = dispatch.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert lse.shape == (2, 4, 40) and lse.dtype == F32
    assert s_dmask.numel() == 0 and s_dmask.dtype == q.dtype


def _packed(gen, lq, lk, hq=4, hkv=2, d=64):
    q = torch.randn(sum(lq), hq, d, generator=gen).to(F16).requires_grad_(True)
    k = torch.randn(sum(lk), hkv, d, generator=gen).to(F16).requires_grad_(True)
    v = torch.randn(sum(lk), hkv, d, generator=gen).to(F16).requires_grad_(True)
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=I32)
    return q, k, v, cu(lq), cu(lk), max(lq), max(lk)


def test_flash_attn_varlen_func_is_attention_varlen() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, cu_q, cu_k, mq, mk = _packed(gen, [5, 17, 9], [11, 17, 4])
    out, lse, s_dmask = dispatch.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True, return_attn_probs=True
    )
    want, want_lse = dispatch.attention_varlen(
        q, k, v, cu_q, cu_k, mq, mk, causal=True, return_lse=True
    )
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert lse.shape == (4, 31) and s_dmask.numel() == 0
    do = torch.randn(out.shape, generator=gen).to(F16)
    got = torch.autograd.grad(out, (q, k, v), do)
    for g, w in zip(got, torch.autograd.grad(want, (q, k, v), do), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    plain = dispatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=[8, 8])
    want = dispatch.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, window_size=(8, 8))
    torch.testing.assert_close(plain, want, rtol=0, atol=0)


def _assert_same_with_grads(got, want, packed: tuple, views: tuple, gen) -> None:
    """got (from the packed inputs) bit for bit want (from their unpacked views), and so are
        the gradients: a packed input's gradient is its views' gradients stacked (a group of one:
    an unpacked input and its copy)."""
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    do = torch.randn(got.shape, generator=gen).to(got.dtype)
    grads = torch.autograd.grad(got, packed, do)
    view_grads = iter(torch.autograd.grad(want, [t for group in views for t in group], do))
    for grad, group in zip(grads, views, strict=True):
        parts = [next(view_grads) for _ in group]
        want_grad = torch.stack(parts, dim=-3) if len(parts) > 1 else parts[0]
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)


def test_dense_packed_functions_are_flash_attn_func_on_their_views() -> None:
    """flash_attn_qkvpacked_func(qkv (B, N, 3, H, D)) and flash_attn_kvpacked_func(q, kv
    (B, Nk, 2, Hkv, D), GQA): flash_attn_func on the stacked views, out, LSE and gradients
    bit for bit; qkv's gradient is one (B, N, 3, H, D) tensor."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 40, 3, 4, 64, generator=gen).to(F16).requires_grad_(True)
    views = [t.detach().clone().requires_grad_(True) for t in qkv.unbind(2)]
    got = dispatch.flash_attn_qkvpacked_func(qkv, 0.0, 0.3, True, window_size=[16, 0])
    want = dispatch.flash_attn_func(*views, 0.0, 0.3, True, window_size=(16, 0))
    _assert_same_with_grads(got, want, (qkv,), (views,), gen)
    q = torch.randn(2, 40, 4, 64, generator=gen).to(F16).requires_grad_(True)
    kv = torch.randn(2, 56, 2, 2, 64, generator=gen).to(F16).requires_grad_(True)
    kv_views = [t.detach().clone().requires_grad_(True) for t in kv.unbind(2)]
    q_view = q.detach().clone().requires_grad_(True)
    out, lse, s_dmask = dispatch.flash_attn_kvpacked_func(
        q, kv, softcap=5.0, causal=True, return_attn_probs=True
    )
    want, want_lse, _ = dispatch.flash_attn_func(
        q_view, *kv_views, softcap=5.0, causal=True, return_attn_probs=True
    )
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert s_dmask.numel() == 0
    _assert_same_with_grads(out, want, (q, kv), ([q_view], kv_views), gen)


def test_varlen_packed_functions_are_flash_attn_varlen_func_on_their_views() -> None:
    """flash_attn_varlen_qkvpacked_func(qkv (total, 3, H, D), cu_seqlens, max_seqlen): one
    cu_seqlens and max_seqlen for queries and keys; flash_attn_varlen_kvpacked_func(q, kv
    (total_k, 2, Hkv, D), ...): flash_attn_varlen_func on the views, bit for bit with
    gradients."""
    gen = torch.Generator().manual_seed(0)
    lens = [5, 17, 0, 9]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)
    qkv = torch.randn(sum(lens), 3, 4, 64, generator=gen).to(F16).requires_grad_(True)
    views = [t.detach().clone().requires_grad_(True) for t in qkv.unbind(1)]
    got = dispatch.flash_attn_varlen_qkvpacked_func(qkv, cu, 17, causal=True)
    want = dispatch.flash_attn_varlen_func(*views, cu, cu, 17, 17, causal=True)
    _assert_same_with_grads(got, want, (qkv,), (views,), gen)
    q, _, _, cu_q, cu_k, mq, mk = _packed(gen, [5, 17, 9], [11, 17, 4])
    kv = torch.randn(int(cu_k[-1]), 2, 2, 64, generator=gen).to(F16).requires_grad_(True)
    kv_views = [t.detach().clone().requires_grad_(True) for t in kv.unbind(1)]
    q_view = q.detach().clone().requires_grad_(True)
    got = dispatch.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk, 0.0, None, True)
    want = dispatch.flash_attn_varlen_func(q_view, *kv_views, cu_q, cu_k, mq, mk, causal=True)
    _assert_same_with_grads(got, want, (q, kv), ([q_view], kv_views), gen)


@pytest.mark.parametrize(
    ("call", "name", "error"),
    [
        (lambda t: dispatch.flash_attn_qkvpacked_func(t[:, :, :2]), "qkv", ValueError),
        (lambda t: dispatch.flash_attn_qkvpacked_func(t[:, :, 0]), "qkv", ValueError),
        (lambda t: dispatch.flash_attn_qkvpacked_func(t.tolist()), "qkv", TypeError),
        (lambda t: dispatch.flash_attn_kvpacked_func(t[:, :, 0], t), "kv", ValueError),
        (
            lambda t: dispatch.flash_attn_varlen_qkvpacked_func(
                t[0], torch.tensor([0, 40], dtype=I32), 40
            ),
            "qkv",
            None,  # (N, 3, H, D) is a valid packed qkv: it runs
        ),
        (
            lambda t: dispatch.flash_attn_varlen_kvpacked_func(
                t[0, :, 0],
                t[0],
                torch.tensor([0, 40], dtype=I32),
                torch.tensor([0, 40], dtype=I32),
                40,
                40,
            ),
            "kv",
            ValueError,  # three parts where k and v are two
        ),
    ],
)
def test_packed_inputs_of_the_wrong_shape_raise(call, name, error) -> None:
    """A packed input whose stacking dim is not 3 (qkv) or 2 (kv), or of the wrong rank, is an
    error naming the argument, the layout expected and the shape given."""
    t = torch.randn(2, 40, 3, 4, 64, generator=torch.Generator().manual_seed(0)).to(F16)
    if error is None:
        assert call(t).shape == (40, 4, 64)
        return
    with pytest.raises(error, match=rf"^{name}: expected (a tensor|shape) \("):
        call(t)


def test_flash_attn_with_kvcache_is_attention_with_kvcache() -> None:
    """New k, v appended in place at cache_seqlens, an int cache_seqlens, None for a full cache
    (flash-attn's meaning), return_softmax_lse."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 64, generator=gen).to(F16)
    k_new = torch.randn(2, 3, 2, 64, generator=gen).to(F16)
    v_new = torch.randn(2, 3, 2, 64, generator=gen).to(F16)
    cache = [torch.randn(2, 32, 2, 64, generator=gen).to(F16) for _ in range(2)]
    lens = torch.tensor([5, 20], dtype=I32)
    caches = [[c.clone() for c in cache] for _ in range(2)]
    out, lse = dispatch.flash_attn_with_kvcache(
        q, *caches[0], k_new, v_new, cache_seqlens=lens, causal=True, return_softmax_lse=True
    )
    want, want_lse = dispatch.attention_with_kvcache(
        q, *caches[1], k_new, v_new, cache_seqlens=lens, causal=True, return_lse=True
    )
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    for a, b in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # appended alike
    got = dispatch.flash_attn_with_kvcache(q, *cache, cache_seqlens=7)
    torch.testing.assert_close(got, dispatch.attention_with_kvcache(q, *cache, cache_seqlens=7))
    full = dispatch.flash_attn_with_kvcache(q, *cache)
    torch.testing.assert_close(full, dispatch.attention(q, *cache), rtol=0, atol=0)


def _rotated_f64(x, cos, sin, positions, interleaved: bool):
    """RoPE as complex multiplication in float64: pair (a, b) at position p is a + ib times
    exp(i·θ) with cos θ, sin θ from row p; the dims past rotary_dim unchanged."""
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].double()
    if interleaved:
        pairs = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        pairs = torch.complex(xr[..., : rd // 2], xr[..., rd // 2 :])
    turn = torch.complex(cos.double()[positions], sin.double()[positions])[:, :, None]
    rot = pairs * turn
    if interleaved:
        out = torch.stack((rot.real, rot.imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((rot.real, rot.imag), dim=-1)
    return torch.cat((out, x[..., rd:].double()), dim=-1)


def _tables(gen, rows: int, rd: int):
    theta = torch.rand(rows, rd // 2, generator=gen) * 6.0
    return theta.cos(), theta.sin()


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("rd", [16, 64])
def test_apply_rotary_is_the_complex_rotation(interleaved: bool, rd: int) -> None:
    """common.rotary.apply_rotary against RoPE as complex multiplication in float64, per-token
    positions, a rotary_dim below and at the head dim; bf16 in and out, within one rounding."""
    from flashsuite.common.rotary import apply_rotary

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 64, generator=gen).to(BF16)
    cos, sin = _tables(gen, 50, rd)
    pos = torch.randint(0, 50, (2, 7), generator=gen)
    got = apply_rotary(x, cos, sin, pos, interleaved)
    want = _rotated_f64(x, cos, sin, pos, interleaved)
    assert got.dtype == BF16 and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(got[..., rd:], x[..., rd:], rtol=0, atol=0)  # passed through
    wrong = apply_rotary(x, cos, sin, pos, not interleaved)
    assert not torch.allclose(wrong.double(), want, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("local", [False, True], ids=["all-at-len", "local"])
@pytest.mark.parametrize("lens_kind", ["tensor", "int"])
def test_rotate_kernel_is_apply_rotary(interleaved: bool, local: bool, lens_kind, device) -> None:
    """common.rotary_kernel.rotate_qk (one Triton launch: compiled on a GPU, the interpreter on
    a CPU) against apply_rotary at flash-attn's positions (new key j at len + j, query i at
    len + i when local, else at len), GQA heads, strided q / k views, a head dim that is not
    a power of 2 and a rotary_dim below it; bit for bit under the interpreter, within one bf16
    rounding compiled (an FMA may join a product and the difference). Row 2's last local query
    lies at 37 + 3 = 40, past the 40-row tables (a position the cache_seqlens check refuses
    later): it reads their last row, as the clamped reference does, never past it."""
    pytest.importorskip("triton")
    from flashsuite.common import triton_launch
    from flashsuite.common.rotary import apply_rotary
    from flashsuite.common.rotary_kernel import _rotate_qk, rotate_qk

    gen = torch.Generator().manual_seed(3)
    b, nq, n_new, hq, hkv, d, rd, rows = 3, 4, 2, 6, 2, 80, 48, 40
    q = torch.randn(b, nq, hq, d + 16, generator=gen).to(device, BF16)[..., :d]
    k = torch.randn(b, n_new, hkv, d, generator=gen).to(device, BF16)
    cos, sin = (t.to(device) for t in _tables(gen, rows, rd))
    if lens_kind == "tensor":
        lens = torch.tensor([0, 17, 37], dtype=I32, device=device)
        start = lens.long()[:, None]
    else:
        lens, start = 21, torch.full((b, 1), 21, device=device)
    q_pos = start + torch.arange(nq, device=device) if local else start.expand(b, nq)
    k_pos = start + torch.arange(n_new, device=device)
    want_q = apply_rotary(q, cos, sin, q_pos.clamp(0, rows - 1), interleaved)
    want_k = apply_rotary(k, cos, sin, k_pos.clamp(0, rows - 1), interleaved)
    got_q, got_k = rotate_qk(q, k, cos, sin, lens, local, interleaved)
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == BF16
    exact = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(got_q, want_q, **exact)
    torch.testing.assert_close(got_k, want_k, **exact)
    torch.testing.assert_close(got_q[..., rd:], q[..., rd:], rtol=0, atol=0)
    if device == "cuda":  # the compiled kernel ran, not the fallback
        assert _rotate_qk in {key[0] for key in triton_launch._compiled}
    if lens_kind == "tensor":  # int64 lengths: the PyTorch path, never the kernel's pointer
        for a, w in zip(rotate_qk(q, k, cos, sin, lens.long(), local, interleaved),
                        (want_q, want_k), strict=True):  # fmt: skip
            torch.testing.assert_close(a, w, rtol=0, atol=0)


@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("causal", [False, True], ids=["all-at-len", "causal"])
def test_flash_attn_with_kvcache_rotates_q_and_the_new_k(
    interleaved: bool, causal: bool, leftpad: bool
) -> None:
    """flash-attn's rotary tables in the KV-cache call: the new k is rotated at positions
    cache_seqlens + j and appended rotated (v as given); q at cache_seqlens + i when causal,
    else every query at cache_seqlens, with or without a cache_leftpad (the positions stay the
    slots', as in flash-attn). Against attention_with_kvcache on q and k rotated in float64
    (float32 inputs, the torch version): out and the cache."""
    gen = torch.Generator().manual_seed(0)
    b, nq, hq, hkv, d, n_max = 2, 3, 4, 2, 64, 40
    q = torch.randn(b, nq, hq, d, generator=gen)
    k_new, v_new = (torch.randn(b, nq, hkv, d, generator=gen) for _ in range(2))
    cache = [torch.randn(b, n_max, hkv, d, generator=gen) for _ in range(2)]
    lens = torch.tensor([5, 30], dtype=I32)
    cos, sin = _tables(gen, n_max, 32)
    steps = torch.arange(nq)
    k_pos = lens.long()[:, None] + steps
    q_pos = k_pos if causal else lens.long()[:, None].expand(b, nq)
    q_rot = _rotated_f64(q, cos, sin, q_pos, interleaved).float()
    k_rot = _rotated_f64(k_new, cos, sin, k_pos, interleaved).float()
    mine, theirs = [c.clone() for c in cache], [c.clone() for c in cache]
    pads = torch.tensor([2, 17], dtype=I32) if leftpad else None
    got = dispatch.flash_attn_with_kvcache(
        q, *mine, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
        causal=causal, rotary_interleaved=interleaved, cache_leftpad=pads,
    )  # fmt: skip
    want = dispatch.attention_with_kvcache(
        q_rot, *theirs, k_rot, v_new, cache_seqlens=lens, causal=causal, cache_leftpad=pads
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, w in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)
    plain = dispatch.flash_attn_with_kvcache(
        q, *[c.clone() for c in cache], k_new, v_new, cache_seqlens=lens, causal=causal,
        cache_leftpad=pads,
    )  # fmt: skip
    assert not torch.allclose(plain, got, rtol=1e-3, atol=1e-3)  # the tables did something
    if leftpad:  # and the padding did: the same call without it attends slots 0 .. too
        unpadded = dispatch.flash_attn_with_kvcache(
            q, *[c.clone() for c in cache], k_new, v_new, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=lens, causal=causal, rotary_interleaved=interleaved,
        )  # fmt: skip
        assert not torch.allclose(unpadded, got, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        (dict(rotary_sin=None), "rotary_sin"),
        (dict(rotary_cos=None), "rotary_cos"),
        (dict(rotary_sin="sin"), "rotary_sin"),
        (dict(rotary_sin=torch.ones(40, 8)), "rotary_sin"),  # not rotary_cos's shape
        (dict(rotary_cos=torch.ones(40, 12), rotary_sin=torch.ones(40, 12)), "rotary_cos"),
        (dict(rotary_cos=torch.ones(40, 40), rotary_sin=torch.ones(40, 40)), "rotary_cos"),
        (dict(rotary_cos=torch.ones(39, 16), rotary_sin=torch.ones(39, 16)), "rotary_cos"),
        (dict(rotary_cos=torch.ones(40), rotary_sin=torch.ones(40)), "rotary_cos"),
        (dict(k=None, v=None), "k"),
        (dict(rotary_interleaved="yes"), "rotary_interleaved"),
        (dict(k=torch.zeros(2, 1, 2, 32)), "k"),  # k's head dim is not q's
        (dict(k=torch.zeros(2, 1, 2, 64, device="meta")), "k"),  # not q's device
        (dict(cache_seqlens=40), "cache_seqlens"),  # no room for the new key: no table overrun
        (dict(cache_seqlens=torch.tensor([3, 45], dtype=I32)), "cache_seqlens"),
    ],
    ids=[
        "no-sin", "no-cos", "sin-not-a-tensor", "shapes-differ", "dim-not-16x", "dim-past-d",
        "too-few-rows", "one-d", "no-new-k", "interleaved-not-bool", "k-head-dim",
        "k-device", "int-len-past-cache",
        "len-past-cache",
    ],
)  # fmt: skip
def test_bad_rotary_tables_raise(changes: dict, name: str) -> None:
    """Rotary tables that cannot be applied as flash-attn applies them are an error naming
    the argument: one table without the other, shapes that differ, a rotary_dim (2 x columns)
    not a multiple of 16 or past the head dim, fewer rows than the cache's positions (40), a
    1-D table, no new k, v to rotate, a non-bool rotary_interleaved, a k whose head dim or
    device is not q's; and lengths that leave no room for the new key are the cache_seqlens
    error, not an index past the tables."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 64, generator=gen)
    k_new, v_new = (torch.randn(2, 1, 2, 64, generator=gen) for _ in range(2))
    cache = [torch.zeros(2, 40, 2, 64) for _ in range(2)]
    args = dict(k=k_new, v=v_new, rotary_cos=torch.ones(40, 16), rotary_sin=torch.ones(40, 16))
    args |= dict(cache_seqlens=3) | changes
    error = TypeError if name == "rotary_interleaved" else ValueError
    interleaved = args.pop("rotary_interleaved", True)
    with pytest.raises(error, match=f"^{name}: "):
        dispatch.flash_attn_with_kvcache(q, *cache, **args, rotary_interleaved=interleaved)


def _paged(gen, k, v, cu, page: int, spare: int = 3):
    """k, v (total_k, Hkv, D) scattered into shuffled pages (num_pages, page, Hkv, D) with NaN
    in every slot no sequence owns, and the (B, max_pages) int32 table that finds them."""
    lengths = (cu[1:] - cu[:-1]).tolist()
    need = [-(-n // page) for n in lengths]
    width = max(max(need), 1) + 1  # a spare column past every row's pages
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lengths), width), num_pages - 1, dtype=I32)
    pages = [
        torch.full((num_pages, page, *t.shape[1:]), float("nan"), dtype=t.dtype) for t in (k, v)
    ]
    used = 0
    for b, n in enumerate(lengths):
        for p in range(need[b]):
            slot = int(order[used])
            used += 1
            table[b, p] = slot
            rows = slice(int(cu[b]) + p * page, int(cu[b]) + min((p + 1) * page, n))
            for dst, src in zip(pages, (k, v), strict=True):
                dst[slot, : rows.stop - rows.start] = src[rows]
    return pages[0], pages[1], table


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_block_table_is_the_packed_call(causal: bool) -> None:
    """flash_attn_varlen_func with block_table (flash-attn's paged varlen): k, v as shuffled
    16-token pages with NaN in every slot no sequence owns, GQA, lengths 0, 1, 37 and 300 (a
    partial last page). Out, LSE and the gradients of q and of the pages (scattered back) are
    bit for bit the packed call's (the torch version on a CPU)."""
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k, hq, hkv, d = [3, 1, 20, 7], [0, 1, 37, 300], 4, 2, 32
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=I32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=I32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=gen)
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, generator=gen) for _ in "kv")
    kp, vp, table = _paged(gen, k, v, cu_k, 16)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    want, want_lse, _ = dispatch.flash_attn_varlen_func(
        qa, ka, va, *args, causal=causal, return_attn_probs=True
    )
    qb, kpb, vpb = (t.clone().requires_grad_() for t in (q, kp, vp))
    got, lse, _ = dispatch.flash_attn_varlen_func(
        qb, kpb, vpb, *args, causal=causal, return_attn_probs=True, block_table=table
    )
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    do = torch.randn(want.shape, generator=gen)
    want.backward(do)
    got.backward(do)
    assert torch.equal(qb.grad, qa.grad)
    # the pages' gradients: the packed call's on the slots the table names, zero elsewhere
    rows = [(int(table[b, j // 16]), j % 16) for b, n in enumerate(lens_k) for j in range(n)]
    owned = torch.zeros(kp.shape[:2], dtype=torch.bool)
    for p, slot in rows:
        owned[p, slot] = True
    for grad_pages, grad_packed in ((kpb.grad, ka.grad), (vpb.grad, va.grad)):
        assert torch.equal(torch.stack([grad_pages[p, slot] for p, slot in rows]), grad_packed)
        assert not grad_pages[~owned].any()


@pytest.mark.parametrize(
    "lens_q", [[1, 1, 1, 1], [3, 3, 3, 3], [2, 0, 3, 1], [16, 5, 0, 16]],
    ids=["decode", "equal-3", "uneven", "uneven-16"],
)  # fmt: skip
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_block_table_with_few_queries_reads_the_pages(
    lens_q, causal, device, monkeypatch
) -> None:
    """A paged varlen call of at most PADDED_MAX_SEQLEN_Q queries a sequence that needs no
    gradient runs as KV-cache attention on the pages themselves: nothing gathered, out and the
    LSE (Hq, total_q) those of the packed call on the gathered keys (keys 0, 1, 37, 300 a
    sequence on shuffled 16-token pages, NaN in every unused slot, GQA; query counts equal, as
    a decode batch's, or not, then padded; float32 on a CPU, bf16 on a GPU, where fa3's decode
    kernel runs it against its varlen forward). With a gradient, or uneven query counts above
    the bound, the pages are gathered as before."""
    from flashsuite.dispatch import flash_attn as fa

    gen = torch.Generator().manual_seed(9)
    lens_k, hq, hkv, d = [0, 1, 37, 300], 4, 2, 64
    dtype, tol = (torch.bfloat16, 2e-2) if device == "cuda" else (torch.float32, 1e-5)
    nq, total_q = max(lens_q), sum(lens_q)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=I32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=I32)
    q = torch.randn(total_q, hq, d, generator=gen)
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, generator=gen) for _ in "kv")
    kp, vp, table = _paged(gen, k, v, cu_k, 16)
    q, k, v, kp, vp = (t.to(device, dtype) for t in (q, k, v, kp, vp))
    cu_q, cu_k, table = (t.to(device) for t in (cu_q, cu_k, table))
    args = (cu_q, cu_k, nq, max(lens_k))
    want, want_lse, _ = dispatch.flash_attn_varlen_func(
        q, k, v, *args, causal=causal, return_attn_probs=True
    )
    gathered = []
    real = fa._gather_pages
    monkeypatch.setattr(fa, "_gather_pages", lambda *a: gathered.append(1) or real(*a))
    with torch.no_grad():
        got, lse, probs = dispatch.flash_attn_varlen_func(
            q, kp, vp, *args, causal=causal, return_attn_probs=True, block_table=table
        )
        plain = dispatch.flash_attn_varlen_func(q, kp, vp, *args, causal=causal, block_table=table)
    assert not gathered and probs.numel() == 0
    assert got.shape == want.shape and lse.shape == want_lse.shape == (hq, total_q)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)
    assert torch.equal(plain, got)
    qg = q.clone().requires_grad_()
    dispatch.flash_attn_varlen_func(qg, kp, vp, *args, causal=causal, block_table=table)
    assert gathered == [1], "a call that needs a gradient gathers the pages"
    if len(set(lens_q)) > 1:  # above the bound: gathered
        loose = (cu_q, cu_k, fa.PADDED_MAX_SEQLEN_Q + 1, max(lens_k))
        with torch.no_grad():
            dispatch.flash_attn_varlen_func(q, kp, vp, *loose, causal=causal, block_table=table)
        assert gathered == [1, 1]


@pytest.mark.parametrize("change", ["entry-past-pages", "decreasing", "too-long", "start"])
def test_bad_varlen_block_table_of_a_decode_batch_raises(change: str) -> None:
    """The decode batch of the paged varlen call (one query a sequence, no gradient) names the
    argument as the gathering path does: an entry outside k's pages, offsets that decrease,
    do not start at 0, or a sequence longer than its row of pages."""
    gen = torch.Generator().manual_seed(0)
    cu_q = torch.tensor([0, 1, 2], dtype=I32)
    cu_k = torch.tensor([0, 20, 50], dtype=I32)
    q = torch.randn(2, 2, 32, generator=gen)
    k, v = (torch.randn(8, 16, 2, 32, generator=gen) for _ in "kv")
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=I32)
    name = "cu_seqlens_k"
    if change == "entry-past-pages":
        table[1, 1], name = 8, "block_table"
    elif change == "decreasing":
        cu_k = torch.tensor([0, 20, 10], dtype=I32)
    elif change == "too-long":
        cu_k = torch.tensor([0, 20, 70], dtype=I32)  # 50 keys, 3 pages of 16
    elif change == "start":
        cu_k = torch.tensor([1, 20, 50], dtype=I32)
    with torch.no_grad(), pytest.raises(ValueError, match=f"^{name}: "):
        dispatch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 60, block_table=table)


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ("table-int64", "block_table"), ("table-rows", "block_table"),
        ("entry-past-pages", "block_table"), ("too-long", "cu_seqlens_k"),
        ("k-packed", "k"), ("v-page-size", "v"),
    ],
    ids=lambda x: x if "-" in x else "",
)  # fmt: skip
def test_bad_varlen_block_table_raises(change: str, name: str) -> None:
    """The paged varlen call's errors name the argument: a table that is not int32 or not a
    row per sequence, an entry outside k's pages, a sequence longer than its row of pages, k
    not in pages, v's pages of another size."""
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 20, 50], dtype=I32)
    q = torch.randn(50, 2, 32, generator=gen)
    k, v = (torch.randn(8, 16, 2, 32, generator=gen) for _ in "kv")
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=I32)
    if change == "table-int64":
        table = table.long()
    elif change == "table-rows":
        table = table[:1]
    elif change == "entry-past-pages":
        table[1, 1] = 8
    elif change == "too-long":
        cu = torch.tensor([0, 20, 70], dtype=I32)  # 50 keys, 3 pages of 16
        q = torch.randn(70, 2, 32, generator=gen)
    elif change == "k-packed":
        k = torch.randn(50, 2, 32, generator=gen)
    elif change == "v-page-size":
        v = torch.randn(8, 32, 2, 32, generator=gen)
    error = TypeError if table.dtype != I32 else ValueError  # dtype: as every index argument
    with pytest.raises(error, match=f"^{name}: "):
        dispatch.flash_attn_varlen_func(q, k, v, cu, cu, 50, 50, block_table=table)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cache_batch_idx_reads_and_appends_the_indexed_rows(causal: bool, device) -> None:
    """flash_attn_with_kvcache's cache_batch_idx: batch row b attends to, and appends its new
    k, v to, cache row cache_batch_idx[b]. Against the same call on the rows gathered in that
    order (out, LSE and the appended rows); the rows no index names stay as they were. N_max
    48 (pages of 48 tokens) and 96 (pages of 96) with ragged lengths, one of them 0."""
    gen = torch.Generator().manual_seed(4)
    for n_max in (48, 96):
        b, rows, nq, hq, hkv, d = 3, 5, 2, 4, 2, 64
        q = torch.randn(b, nq, hq, d, generator=gen).to(device, BF16)
        k_new, v_new = (torch.randn(b, nq, hkv, d, generator=gen).to(device, BF16) for _ in "kv")
        cache = [torch.randn(rows, n_max, hkv, d, generator=gen).to(device, BF16) for _ in "kv"]
        idx = torch.tensor([4, 0, 2], dtype=I32, device=device)
        lens = torch.tensor([5, n_max - nq, 0], dtype=I32, device=device)
        mine = [c.clone() for c in cache]
        got, lse = dispatch.flash_attn_with_kvcache(
            q, *mine, k_new, v_new, cache_seqlens=lens, cache_batch_idx=idx, causal=causal,
            return_softmax_lse=True,
        )  # fmt: skip
        theirs = [c[idx.long()].clone() for c in cache]
        want, want_lse = dispatch.flash_attn_with_kvcache(
            q, *theirs, k_new, v_new, cache_seqlens=lens, causal=causal, return_softmax_lse=True
        )
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)
        for a, w, c in zip(mine, theirs, cache, strict=True):
            assert torch.equal(a[idx.long()], w)  # appended where the index points
            assert torch.equal(a[[1, 3]], c[[1, 3]])  # the other rows untouched
        plain = dispatch.flash_attn_with_kvcache(
            q, *[c.clone() for c in cache], k_new, v_new, cache_seqlens=lens, causal=causal
        )
        assert not torch.allclose(plain, got, rtol=2e-2, atol=2e-2)  # rows 0..2 differ


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        (dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int64)), "cache_batch_idx"),
        (dict(cache_batch_idx=torch.tensor([1], dtype=I32)), "cache_batch_idx"),
        (dict(cache_batch_idx=[1, 0]), "cache_batch_idx"),
        (dict(cache_batch_idx=torch.tensor([1, 3], dtype=I32)), "cache_batch_idx"),
        (dict(cache_batch_idx=torch.tensor([-1, 0], dtype=I32)), "cache_batch_idx"),
        (dict(n_max=40), "k_cache"),
        (dict(strided=True), "k_cache"),
    ],
    ids=["int64", "length", "list", "past-rows", "negative", "n-max-not-16x", "row-stride"],
)
def test_bad_cache_batch_idx_raises(changes: dict, name: str) -> None:
    """cache_batch_idx errors name the argument: not an int32 (B,) tensor, an entry outside
    [0, B_cache) (3 rows here), and caches whose rows cannot be read as pages (N_max not a
    multiple of 16, rows that do not follow one another in memory)."""
    n_max = changes.pop("n_max", 48)
    strided = changes.pop("strided", False)
    q = torch.zeros(2, 1, 4, 64)
    if strided:  # a view of longer rows: stride(0) is 64 tokens, N_max 48
        cache = [torch.zeros(3, 64, 2, 64)[:, :48] for _ in "kv"]
    else:
        cache = [torch.zeros(3, n_max, 2, 64) for _ in "kv"]
    args = {"cache_batch_idx": torch.tensor([1, 0], dtype=I32), "cache_seqlens": 4, **changes}
    index = args["cache_batch_idx"]  # a list or an int64 tensor: a TypeError, as every index
    error = TypeError if isinstance(index, list) or index.dtype != I32 else ValueError
    with pytest.raises(error, match=f"^{name}: "):
        dispatch.flash_attn_with_kvcache(q, *cache, **args)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda q, k, v: dispatch.flash_attn_func(q, k, v, 0.1), "dropout_p"),
        (
            lambda q, k, v: dispatch.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4)),
            "alibi_slopes",
        ),
        (
            lambda q, k, v: dispatch.flash_attn_varlen_func(
                q[0], k[0], v[0], *(torch.tensor([0, 40], dtype=I32),) * 2, 40, 40, dropout_p=0.5
            ),
            "dropout_p",
        ),
        (
            lambda q, k, v: dispatch.flash_attn_with_kvcache(
                q,
                k,
                v,
                cache_seqlens=4,
                cache_batch_idx=torch.tensor([1, 0], dtype=I32),
                block_table=torch.zeros(2, 3, dtype=I32),
            ),
            "cache_batch_idx",
        ),
        (
            lambda q, k, v: dispatch.flash_attn_with_kvcache(
                q,
                k,
                v,
                cache_seqlens=4,
                cache_leftpad=torch.zeros(2, dtype=I32),
                cache_batch_idx=torch.tensor([1, 0], dtype=I32),
            ),
            "cache_leftpad",
        ),
        (
            lambda q, k, v: dispatch.flash_attn_with_kvcache(q, k, v, k[:, :1], v[:, :1]),
            "cache_seqlens",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_what_flashsuite_does_not_implement_raises(call, name) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen, nq=40, nk=40)
    with pytest.raises(ValueError, match=f"^{name}: "):
        call(q, k, v)


def test_deterministic_refuses_fa3s_own_unordered_backward(monkeypatch) -> None:
    """deterministic=True where the backward would be fa3's own (forced here with
    FLASHSUITE_FA3_BWD=1) without torch's deterministic mode: a ValueError saying how to get an
    ordered one. Planned for sm90 on a CPU: the error comes before anything would launch."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen, d=128, dtype=BF16, grad=True)
    monkeypatch.setenv("FLASHSUITE_FA3_BWD", "1")
    with override_arch(90):
        if not (registry.available("fa3")[0] and registry.available("fa2")[0]):
            pytest.skip("needs fa3 and fa2 importable")
        assert dispatch.select(q, k, v, causal=True).backward == "fa3"
        with pytest.raises(ValueError, match=r"^deterministic: .*use_deterministic_algorithms"):
            dispatch.flash_attn_func(q, k, v, causal=True, deterministic=True)
        torch.use_deterministic_algorithms(True)
        try:  # fa3 orders its dQ adds: accepted (the check alone; no GPU to run on here)
            flash_attn._check_deterministic(True, q, k, v, causal=True)
        finally:
            torch.use_deterministic_algorithms(False)
        monkeypatch.setenv("FLASHSUITE_FA3_BWD", "0")
        flash_attn._check_deterministic(True, q, k, v, causal=True)  # fa2's: deterministic


def test_varlen_deterministic_refuses_fa3s_own_unordered_backward() -> None:
    """flash_attn_varlen_func(deterministic=True) where fa3's own varlen backward would run
    (its default pairing on sm90; it adds dQ in arrival order): refused with the way out, as
    the dense call; under torch.use_deterministic_algorithms its problems go to fa3's ordered
    varlen build and the check passes. Planned for sm90 on a CPU."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, cu_q, cu_k, mq, mk = _packed(gen, [5, 17, 9], [11, 17, 4])
    args = (q, k, v, cu_q, cu_k, mq, mk)
    with override_arch(90):
        if not (registry.available("fa3")[0] and registry.available("fa2")[0]):
            pytest.skip("needs fa3 and fa2 importable")
        if dispatch.select_varlen(*args).backward != "fa3":
            pytest.skip("fa3's own varlen backward is not the default pairing here")
        with pytest.raises(ValueError, match=r"^deterministic: .*use_deterministic_algorithms"):
            dispatch.flash_attn_varlen_func(*args, deterministic=True)
        torch.use_deterministic_algorithms(True)
        try:
            choice = dispatch.select_varlen(*args)
            assert choice.backward == "fa3" and "(deterministic)" in str(choice), str(choice)
            select = lambda: dispatch.select_varlen(*args)
            flash_attn._check_deterministic(True, q, k, v, select)
        finally:
            torch.use_deterministic_algorithms(False)
    dispatch.flash_attn_varlen_func(*args, deterministic=True)  # off sm90: fa2's or torch's


@pytest.mark.parametrize("name", ["deterministic", "return_attn_probs"])
def test_flags_must_be_bools(name) -> None:
    """A string where a flag goes (truthy, so it would pass for True) is a TypeError naming
    the argument, in the dense and the varlen call, as return_lse is in dispatch's."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen, nq=40, nk=40)
    with pytest.raises(TypeError, match=f"^{name}: expected a bool, got str"):
        dispatch.flash_attn_func(q, k, v, **{name: "no"})
    packed = _packed(gen, [5, 7], [5, 7])
    with pytest.raises(TypeError, match=f"^{name}: expected a bool, got str"):
        dispatch.flash_attn_varlen_func(*packed, **{name: "no"})
    with pytest.raises(TypeError, match=r"^return_lse: expected a bool, got str"):
        dispatch.attention(q, k, v, return_lse="no")
    cache = torch.zeros(2, 64, 2, 64, dtype=q.dtype)
    with pytest.raises(TypeError, match=r"^return_softmax_lse: expected a bool, got str"):
        dispatch.flash_attn_with_kvcache(q[:, :1], cache, cache, return_softmax_lse="no")
