"""flashsuite as the flash backend of PyTorch's SDPA (dispatch/flash_backend.py).

PyTorch sends only CUDA tensors to the flash ops the plug-in replaces, so on a CPU the same
implementations are registered for the CPU dispatch key of those aten ops (which have no CPU
kernel of their own) and called through the aten ops: PyTorch's schema, argument conversion
and autograd formulas (forward op -> backward op) are then exactly those of the GPU path.
On a GPU, unmodified F.scaled_dot_product_attention and nn.MultiheadAttention run it.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.attention as torch_attention
import torch.nn.functional as F

from flashsuite import dispatch
from flashsuite.common.testing import compare, reference_pair
from flashsuite.dispatch import flash_backend, registry
from tests.conftest import HAS_CUDA

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
aten = torch.ops.aten


@pytest.fixture
def cpu_plugin():
    """The plug-in's kernels registered for CPU tensors for the duration of a test."""
    handle = flash_backend.register("CPU")
    try:
        yield handle
    finally:
        handle.remove()


def _bhnd(gen, b, h, n, d, dtype, device="cpu", transposed=True):
    """A (B, H, N, D) tensor, as a transposed view of (B, N, H, D) memory (what attention
    layers make) or contiguous; requires grad."""
    shape = (b, n, h, d) if transposed else (b, h, n, d)
    t = torch.randn(shape, generator=gen, device=device).to(dtype)
    return (t.transpose(1, 2) if transposed else t).requires_grad_(True)


def _check(out, grads, q, k, v, do, causal, scale=None, window=(-1, -1)):
    """out and grads (layout (B, H, N, D)) against the float64 oracle (layout (B, N, H, D))."""
    to_bnhd = lambda t: t.transpose(1, 2)
    pairs = reference_pair(
        *(to_bnhd(t) for t in (q, k, v)), grad_out=to_bnhd(do), causal=causal,
        softmax_scale=scale, window_size=window,
    )  # fmt: skip
    for name, ours in zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True):
        res = compare(name, to_bnhd(ours), *pairs[name])
        assert res.ok, res


# (Hq, Hkv, Nq, Nk, D, dtype, is_causal, scale, transposed layout)
SDPA_CASES = [
    (4, 4, 64, 64, 64, F16, False, None, True),
    (4, 4, 48, 48, 64, BF16, True, None, True),
    (4, 2, 40, 72, 32, F32, False, 0.3, False),
    (4, 1, 65, 65, 128, F16, True, None, False),
    (2, 2, 24, 40, 80, BF16, True, None, True),  # bottom-right (a causal_lower_right bias)
]


@pytest.mark.parametrize("version", ["auto", "fa2"])
@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sdpa_flash_op_forward_backward(cpu_plugin, case, version, monkeypatch) -> None:
    """aten::_scaled_dot_product_flash_attention and its backward, through PyTorch's autograd
    formula: exact attention, outputs and gradients with the strides of PyTorch's meta kernels
    (like query, key, value), the LSE (B, Hq, Nq) float32. Auto runs the portable version on
    a CPU; fa2 runs under the Triton interpreter."""
    hq, hkv, nq, nk, d, dtype, causal, scale, transposed = case
    if version != "auto":
        if HAS_CUDA:
            pytest.skip("fa2 takes CPU tensors under the Triton interpreter only (GPU: below)")
        if not registry.available(version)[0] or d not in (32, 64, 128):
            pytest.skip(f"{version} unavailable here or head_dim {d} not its")
        monkeypatch.setenv("FLASHSUITE_VERSION", version)
    gen = torch.Generator().manual_seed(0)
    q = _bhnd(gen, 2, hq, nq, d, dtype, transposed=transposed)
    k, v = (_bhnd(gen, 2, hkv, nk, d, dtype, transposed=transposed) for _ in range(2))
    do = torch.randn(2, hq, nq, d, generator=gen).to(dtype)
    with torch.profiler.profile() as prof:
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        grads = torch.autograd.grad(res[0], (q, k, v), do)
    ran = {e.name for e in prof.events() if e.name.startswith("flashsuite::")}
    expected = "torch" if version == "auto" else version  # auto on a CPU: the portable one
    assert ran == {f"flashsuite::{expected}_fwd", f"flashsuite::{expected}_bwd"}, ran
    out, lse, _, _, max_q, max_k, seed, _, debug = res
    assert (max_q, max_k) == (nq, nk) and debug.numel() == 0 and seed.dtype == torch.uint64
    assert out.stride() == q.stride() and lse.shape == (2, hq, nq) and lse.dtype == F32
    assert out.grad_fn is not None
    for t, g in zip((q, k, v), grads, strict=True):
        assert g.stride() == t.stride()
    _check(out, grads, q, k, v, do, causal, scale)


@pytest.mark.parametrize("window", [(-1, -1), (8, 0), (16, 4)])
def test_flash_attention_op_dense(cpu_plugin, window) -> None:
    """aten::_flash_attention_forward/_backward, flash-attn's layout (B, N, H, D), with a
    sliding window: forward and gradients through PyTorch's autograd formula."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, n, h, 64, generator=gen).to(F16) for n, h in ((50, 4), (60, 2), (60, 2))
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    causal = window == (8, 0)
    left, right = (None, None) if window == (-1, -1) else window
    out, lse, *_ = aten._flash_attention_forward(
        q, k, v, None, None, 50, 60, 0.0, causal, False, scale=None,
        window_size_left=left, window_size_right=right,
    )  # fmt: skip
    assert lse.shape == (2, 4, 50)
    do = torch.randn(out.shape, generator=gen).to(F16)
    grads = torch.autograd.grad(out, (q, k, v), do)
    pairs = reference_pair(q, k, v, grad_out=do, causal=causal, window_size=window)
    for name, ours in zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True):
        res = compare(name, ours, *pairs[name])
        assert res.ok, res


def test_flash_attention_op_varlen(cpu_plugin) -> None:
    """aten::_flash_attention_forward/_backward on packed sequences (cum_seq_q/k): each
    sequence bottom-right causal on its own lengths, LSE (Hq, total_q)."""
    gen = torch.Generator().manual_seed(0)
    lq, lk = [5, 17, 9], [11, 17, 4]
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 32, generator=gen).to(F16).requires_grad_(True)
    k = torch.randn(sum(lk), 2, 32, generator=gen).to(F16).requires_grad_(True)
    v = torch.randn(sum(lk), 2, 32, generator=gen).to(F16).requires_grad_(True)
    out, lse, *_ = aten._flash_attention_forward(
        q, k, v, cu(lq), cu(lk), max(lq), max(lk), 0.0, True, False, scale=0.2
    )
    assert lse.shape == (4, sum(lq))
    do = torch.randn(out.shape, generator=gen).to(F16)
    grads = torch.autograd.grad(out, (q, k, v), do)
    want = dispatch.attention_varlen(q, k, v, cu(lq), cu(lk), max(lq), max(lk), causal=True,
                                     softmax_scale=0.2, return_lse=True)  # fmt: skip
    torch.testing.assert_close(out, want[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, want[1], rtol=0, atol=0)
    want_grads = torch.autograd.grad(want[0], (q, k, v), do)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda q: aten._scaled_dot_product_flash_attention(q, q, q, 0.1), "dropout_p"),
        (lambda q: aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, True), "debug"),
        (
            lambda q: aten._flash_attention_forward(
                q, q, q, None, None, 8, 8, 0.0, False, False, alibi_slopes=torch.ones(2)
            ),
            "alibi_slopes",
        ),
    ],
)
def test_what_the_plugin_does_not_implement_raises(cpu_plugin, call, name) -> None:
    q = torch.randn(1, 2, 8, 16, dtype=F16)
    with pytest.raises(RuntimeError, match=f"flashsuite SDPA plug-in .*{name}.* not supported"):
        call(q)


def test_activate_deactivate_and_context_manager() -> None:
    """activate_sdpa registers CUDA kernels for the flash ops under torch's registry name
    "flashsuite", deactivate_sdpa removes them, the context manager restores whatever was
    active before (here another provider, whose handle is then removed in turn)."""
    op = "aten::_scaled_dot_product_flash_attention"
    has_cuda_kernel = lambda: torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    ours = lambda: "flash_backend.py" in torch._C._dispatch_dump(op)
    removed = []

    class OtherHandle:
        def remove(self) -> None:
            removed.append(True)

    torch_attention.register_flash_attention_impl("test-other", register_fn=OtherHandle)
    try:
        assert "flashsuite" in torch_attention.list_flash_attention_impls()
        cuda_before = has_cuda_kernel()
        assert dispatch.activate_sdpa() == "flashsuite"
        assert torch_attention.current_flash_attention_impl() == "flashsuite"
        assert has_cuda_kernel() and ours()
        dispatch.activate_sdpa()  # idempotent
        dispatch.deactivate_sdpa()
        assert torch_attention.current_flash_attention_impl() is None and not ours()
        assert has_cuda_kernel() == cuda_before
        with dispatch.sdpa_plugin() as name:
            assert name == "flashsuite" and ours()
        assert torch_attention.current_flash_attention_impl() is None and not ours()
        torch_attention.activate_flash_attention_impl("test-other")
        with dispatch.sdpa_plugin():
            assert torch_attention.current_flash_attention_impl() == "flashsuite"
            assert removed == [True]  # activating flashsuite removed the other one
        assert torch_attention.current_flash_attention_impl() == "test-other" and not ours()
        dispatch.deactivate_sdpa()  # another provider is active: left alone
        assert torch_attention.current_flash_attention_impl() == "test-other"
    finally:
        torch_attention.restore_flash_attention_impl(_raise_warn=False)
        torch_attention._registry._FLASH_ATTENTION_IMPLS.pop("test-other", None)


def test_activation_without_torchs_registry(monkeypatch) -> None:
    """A torch without torch.nn.attention's provider registry: activation registers the same
    kernels itself, and deactivation and the context manager remove them."""
    op = "aten::_scaled_dot_product_flash_attention"
    ours = lambda: "flash_backend.py" in torch._C._dispatch_dump(op)
    monkeypatch.setattr(flash_backend, "_registered", lambda: False)
    monkeypatch.setattr(flash_backend, "_torch_registry", lambda: None)
    try:
        assert not ours() and not flash_backend.active()
        dispatch.activate_sdpa()
        dispatch.activate_sdpa()  # idempotent: one registration
        assert ours() and flash_backend.active()
        dispatch.deactivate_sdpa()
        assert not ours() and not flash_backend.active()
        with dispatch.sdpa_plugin():
            assert ours()
        assert not ours()
    finally:
        dispatch.deactivate_sdpa()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="PyTorch sends only CUDA tensors to its flash backend")
@pytest.mark.parametrize(("hq", "hkv", "d", "causal"), [(8, 8, 128, True), (8, 2, 64, False)])
def test_unmodified_sdpa_and_multihead_attention_run_flashsuite(hq, hkv, d, causal) -> None:
    """With the plug-in active, F.scaled_dot_product_attention (forward and backward) and
    nn.MultiheadAttention (need_weights=False reaches SDPA) run flashsuite's ops (the
    profiler sees them) and match the oracle / PyTorch's own flash kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = _bhnd(gen, 2, hq, 512, d, BF16, device="cuda")
    k, v = (_bhnd(gen, 2, hkv, 512, d, BF16, device="cuda") for _ in range(2))
    do = torch.randn(2, hq, 512, d, generator=gen, device="cuda").to(BF16)
    flash_only = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    with dispatch.sdpa_plugin(), flash_only, torch.profiler.profile() as prof:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        grads = torch.autograd.grad(out, (q, k, v), do)
    names = {e.name for e in prof.events()}
    assert any(n.startswith("flashsuite::") and n.endswith("_fwd") for n in names), names
    assert any(n.startswith("flashsuite::") and n.endswith("_bwd") for n in names), names
    _check(out, grads, q, k, v, do, causal)

    # nn.MultiheadAttention against itself in float64 (the oracle), with PyTorch's own flash
    # kernel in bf16 as the yardstick (the suite's comparison rule). SDPA is restricted to its
    # flash backend for the bf16 runs: PyTorch's default order on the H200 (torch 2.11) sends
    # this module's call to another backend, which the plug-in does not replace.
    mha = torch.nn.MultiheadAttention(hq * d, hq, batch_first=True, device="cuda", dtype=BF16)
    x = torch.randn(2, 256, hq * d, generator=gen, device="cuda").to(BF16).requires_grad_(True)
    results = {}
    for tag, module, inp, plugin in (
        ("pt", mha, x, None),
        ("ref", copy.deepcopy(mha).double(), x.detach().double().requires_grad_(True), None),
        ("ours", mha, x, dispatch.sdpa_plugin()),
    ):
        only = contextlib.nullcontext() if tag == "ref" else sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        with plugin or contextlib.nullcontext(), only, torch.profiler.profile() as prof:
            y = module(inp, inp, inp, need_weights=False)[0]
            (dx,) = torch.autograd.grad(y.double().square().sum(), (inp,))
        results[tag] = (y, dx)
        ran_flashsuite = any(e.name.startswith("flashsuite::") for e in prof.events())
        assert ran_flashsuite == (tag == "ours"), tag
    for i, name in enumerate(("out", "dx")):
        res = compare(name, results["ours"][i], results["ref"][i], results["pt"][i])
        assert res.ok, res
