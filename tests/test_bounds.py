"""Every global load and store of the Triton kernels stays inside the tensors it was given.

Under TRITON_INTERPRET=1 each `tl.load` / `tl.store` is checked lane by lane: an active
(unmasked) lane must address an element of one of the launch's tensor arguments (the exact
span of the view, not its storage). A read past a tensor's end fails even when the value read
is masked out later or happens not to change the result. The launches use the GPU tile table
(sm90 entries, not the interpreter's small tiles), so the block shapes, padded head dims and
masked/unmasked loop stages are those of an H200 run at these sequence lengths.

This checks the kernels' address arithmetic; what the compiled code does with it (shared
memory layouts, pipelining) is covered by the GPU sweep in test_small_shapes.py and its
compute-sanitizer run (scripts/gpu_check.sh parts `smallshapes` and `sanitize-small`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="address checks need the Triton interpreter (TRITON_INTERPRET=1)",
)
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from flashsuite.common.validation import check_inputs  # noqa: E402


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] of the elements a view can address."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    hi = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
    lo = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    size = t.element_size()
    return t.data_ptr() + lo * size, t.data_ptr() + (hi + 1) * size


descriptors_seen = [0]


@contextlib.contextmanager
def bounds_checked() -> Iterator[list[str]]:
    """Yields a list that collects one line per out-of-bounds load/store (kernel, op, lanes)
    or TMA descriptor whose declared extent leaves its tensor. `descriptors_seen` (a module
    global) counts the descriptors checked, so a test can tell that the TMA path ran."""
    import numpy as np
    from triton.runtime import interpreter as interp

    violations: list[str] = []
    launch: dict = {"name": "?", "spans": []}
    grid_call = interp.GridExecutor.__call__
    masked_load = interp.InterpreterBuilder.create_masked_load
    masked_store = interp.InterpreterBuilder.create_masked_store

    def call(self, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        descs = [a for a in (*args, *kwargs.values()) if hasattr(a, "block_shape")]
        launch["spans"] = [_span(t) for t in tensors + [d.base for d in descs]]
        launch["name"] = getattr(self.fn, "__name__", "?")
        for d in descs:  # TMA clips boxes to the declared extent: that must lie in the tensor
            lo, hi = _span(d.base)
            size = d.base.element_size()
            last = sum((n - 1) * s for n, s in zip(d.shape, d.strides, strict=True))
            if d.base.data_ptr() < lo or d.base.data_ptr() + (last + 1) * size > hi:
                violations.append(f"{launch['name']}: descriptor {list(d.shape)} past its tensor")
        descriptors_seen[0] += len(descs)
        return grid_call(self, *args, **kwargs)

    def check(op: str, ptrs, mask) -> None:
        addr = ptrs.data[mask.data].astype(np.uint64).ravel()
        if addr.size == 0:
            return
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in launch["spans"]:
            inside |= (addr >= lo) & (addr + size <= hi)
        if not inside.all():
            violations.append(f"{launch['name']}: {op} of {int((~inside).sum())} lanes")

    def load(self, ptrs, mask, *args, **kwargs):
        check("load", ptrs, mask)
        return masked_load(self, ptrs, mask, *args, **kwargs)

    def store(self, ptrs, value, mask, *args, **kwargs):
        check("store", ptrs, mask)
        return masked_store(self, ptrs, value, mask, *args, **kwargs)

    interp.GridExecutor.__call__ = call
    interp.InterpreterBuilder.create_masked_load = load
    interp.InterpreterBuilder.create_masked_store = store
    try:
        yield violations
    finally:
        interp.GridExecutor.__call__ = grid_call
        interp.InterpreterBuilder.create_masked_load = masked_load
        interp.InterpreterBuilder.create_masked_store = masked_store


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if MASKED:
        x = tl.load(src + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(src + offs)
    tl.store(dst + offs, x, mask=offs < n)


@pytest.mark.parametrize("masked", [True, False])
def test_checker_flags_a_read_past_the_end(masked: bool) -> None:
    """The checker itself: a masked copy is clean, the same copy without the mask is not."""
    src, dst = torch.randn(64 + 10)[:10], torch.empty(10)  # storage beyond the view: still OOB
    with bounds_checked() as bad:
        _copy_kernel[(1,)](src, dst, 10, BLOCK=16, MASKED=masked)
    assert bool(bad) == (not masked), bad
    assert torch.equal(dst, src)


@triton.jit
def _desc_copy_kernel(src_desc, dst, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, src_desc.load([0]), mask=offs < 10)


@pytest.mark.parametrize("extent", [10, 16])
def test_checker_flags_a_descriptor_past_the_end(extent: int) -> None:
    """A TMA descriptor declared longer than its tensor is flagged; an exact one is not."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    src, dst = torch.randn(64 + 10)[:10], torch.empty(10)
    desc = TensorDescriptor(src.as_strided((extent,), (1,)), [extent], [1], [16])
    desc.base = src  # the tensor the kernel was meant to read
    with bounds_checked() as bad:
        _desc_copy_kernel[(1,)](desc, dst, BLOCK=16)
    assert bool(bad) == (extent > 10), bad
    assert torch.equal(dst, src)


# The H200 crash shapes (D 64 / Dv 32 at N = 8 ... 48) and their neighbours, both sides of
# the 64-key and 128-query tiles, Nq != Nk, GQA, causal and a sliding window.
_SHAPES = [
    # (Nq, Nk, Hq, Hkv, D, Dv, options)
    (8, 8, 2, 2, 64, 32, {}),
    (24, 24, 2, 2, 64, 32, {}),
    (48, 48, 2, 2, 64, 32, {"causal": True}),
    (72, 72, 2, 2, 64, 32, {}),
    (12, 33, 4, 2, 64, 32, {"causal": True}),
    (65, 17, 2, 1, 128, 64, {"window_size": (5, 3)}),
    (130, 7, 2, 2, 32, 32, {"causal": True}),
    (3, 129, 2, 2, 96, 96, {}),
]


def _run(version: str, case, dtype: torch.dtype, monkeypatch) -> list[str]:
    """Forward and backward of `version` at `case` with the sm90 tile table; returns the
    out-of-bounds accesses seen."""
    from flashsuite.dispatch import registry

    nq, nk, hq, hkv, d, dv, options = case
    module = registry.module(version)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, nq, hq, d, generator=gen).to(dtype)
    k = torch.randn(1, nk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(1, nk, hkv, dv, generator=gen).to(dtype)
    p = check_inputs(q, k, v, **options)
    ok, why = module.supports(p, None)
    if not ok:
        pytest.skip(why)
    if version == "fa2":
        monkeypatch.setattr(module, "_arch", lambda t: 90)
    else:
        monkeypatch.setattr(module, "_arch_of", lambda t: 90)
    before = descriptors_seen[0]
    with bounds_checked() as bad:
        out, lse = module.forward(q, k, v, p)
        dout = torch.randn(out.shape, generator=gen).to(dtype)
        module.backward(dout, q, k, v, out, lse, p)
    if version == "fa1":  # the sm90 fa1 entries load through TMA descriptors
        assert descriptors_seen[0] > before, "fa1: no TMA descriptor reached the kernels"
    return bad


@pytest.mark.parametrize(
    "case", _SHAPES, ids=lambda c: f"{c[0]}x{c[1]}-h{c[2]}/{c[3]}-d{c[4]}/{c[5]}"
)
@pytest.mark.parametrize("version", ["fa1", "fa2"])
def test_kernels_stay_inside_their_tensors(version: str, case, monkeypatch) -> None:
    assert _run(version, case, torch.bfloat16, monkeypatch) == []


@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_decode_with_the_gpu_schedule_stays_inside_and_matches_the_oracle(
    cache, monkeypatch
) -> None:
    """fa2's split-KV decode with the GPU's tiles (64-key blocks, not the interpreter's 16) and
    the GPU's split heuristic (132 SMs): B > 1, GQA 8/2, D = 128, bf16 queries, a bf16 or a
    float8_e4m3fn cache (with its (B, Hkv) descales), pages of 64, per-row lengths chosen so
    that splits of the short rows are empty (a 1-key row: 1 block for 4 splits; 9 blocks:
    per_split 3, the 4th split empty). Every row is checked against the float64 oracle under
    the suite's rule, and every address against its tensor."""
    from flashsuite import dispatch
    from flashsuite.common.testing import compare, reference_pair
    from flashsuite.fa2 import decode, interface

    b, n, hq, hkv, d, page = 4, 1088, 8, 2, 128, 64
    gpu_config = decode.decode_config
    monkeypatch.setattr(
        decode, "decode_config", lambda rows, hd, interpreter: gpu_config(rows, hd, False)
    )
    monkeypatch.setattr(interface, "_arch", lambda t: 90)
    cfg = decode.decode_config(hq // hkv, d, True)
    assert (cfg.block_m, cfg.block_n) == (16, 64)  # the sm90 decode tile
    key_blocks = n // cfg.block_n
    splits = decode.num_splits_heuristic(b * hkv, key_blocks, decode.H100_SMS)
    assert splits == 4  # several splits per row, as at B = 8, Nk = 32k on the H200
    lens = torch.tensor([n, 540, 1, 1000], dtype=torch.int32)
    blocks = -(-lens // cfg.block_n)
    per_split = -(-blocks // splits)
    assert bool((per_split * (splits - 1) >= blocks).any()), "no row has an empty split"

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, 1, hq, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(b, n, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, n, hkv, d, generator=gen).to(torch.bfloat16)
    order = torch.randperm(b * n // page + 3, generator=gen)  # shuffled pages, 3 spare
    table = order[: b * n // page].reshape(b, n // page).to(torch.int32)
    k_pages = torch.randn(len(order), page, hkv, d, generator=gen).to(torch.bfloat16)
    v_pages = torch.randn(len(order), page, hkv, d, generator=gen).to(torch.bfloat16)
    scales = {}
    if cache == "e4m3":  # the cache in e4m3, and the oracle on its dequantised values
        from flashsuite.common.fp8 import dequantize_e4m3, quantize_e4m3

        (k, dk), (v, dv) = quantize_e4m3(k), quantize_e4m3(v)
        k_pages, v_pages = k_pages.to(torch.float8_e4m3fn), v_pages.to(torch.float8_e4m3fn)
        scales = dict(descale_k=dk, descale_v=dv)
    k_pages[table.long()] = k.reshape(b, n // page, page, hkv, d)
    v_pages[table.long()] = v.reshape(b, n // page, page, hkv, d)
    k_ref, v_ref = k, v  # the keys and values the oracle attends
    if scales:
        k_ref, v_ref = dequantize_e4m3(k, dk), dequantize_e4m3(v, dv)
    for kc, vc, bt in ((k, v, None), (k_pages, v_pages, table)):
        with bounds_checked() as bad:
            out, lse = dispatch.attention_with_kvcache(
                q, kc, vc, cache_seqlens=lens, block_table=bt, return_lse=True, version="fa2",
                **scales,
            )  # fmt: skip
        assert bad == [], bad
        for row, length in enumerate(lens.tolist()):
            ref = reference_pair(q[row : row + 1], k_ref[row : row + 1, :length],
                                 v_ref[row : row + 1, :length])  # fmt: skip
            results = [
                compare("out", out[row : row + 1], *ref["out"]),
                compare("lse", lse[row : row + 1], *ref["lse"]),
            ]
            failed = [f"row {row} (len {length}, paged={bt is not None}): {r}" for r in results
                      if not r.ok]  # fmt: skip
            assert not failed, "\n".join(failed)
