"""attention_varlen and attention_with_kvcache against a per-sequence float64 oracle, on every
version that takes them here (fa2 under the Triton interpreter, torch), plus their errors,
selection and torch.compile. The oracle runs common.reference.attention_reference once per
sequence / cache row on that sequence's own lengths."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.arch import override_arch
from flashsuite.common.reference import attention_reference
from flashsuite.common.testing import compare
from tests.conftest import GPU_MEMORY, HAS_CUDA, runnable_names, runnable_versions

F16, BF16, F32, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int32
DEV = "cuda" if HAS_CUDA else "cpu"


def _versions(kind: str) -> list:
    """The versions with this entry point that run on any device, as runnable_versions' params
    (skipped with the reason where their software is missing). fa3's varlen forward and its
    decode run on an sm90 GPU only: tests/test_fa3_varlen.py and tests/test_fa3_kvcache.py."""
    return [p for p in runnable_versions() if p.values[0] in ("fa2", "torch")]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV
    )


def _rand(gen, *shape, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


def _oracle(q, k, v, do, **options):
    """Per-sequence (out, lse, dq, dk, dv) in float64 ("ref") and in the input dtype ("pt")."""
    result = {}
    if k.shape[1] == 0:  # no keys: out 0, lse -inf, zero gradients (the oracle needs Nk > 0)
        b, nq, hq, _ = q.shape
        entry = dict(
            out=q.new_zeros(b, nq, hq, v.shape[-1]), lse=q.new_full((b, hq, nq), -torch.inf)
        )
        entry.update(dq=torch.zeros_like(q), dk=torch.zeros_like(k), dv=torch.zeros_like(v))
        return {"ref": entry, "pt": entry}
    for tag, dtype in (("ref", torch.float64), ("pt", None)):
        qs, ks, vs = (t.detach().clone().requires_grad_(do is not None) for t in (q, k, v))
        out, lse = attention_reference(qs, ks, vs, compute_dtype=dtype, **options)
        entry = {"out": out.detach(), "lse": lse.detach()}
        if do is not None:
            grads = torch.autograd.grad(out, (qs, ks, vs), do.to(out.dtype))
            entry.update(zip(("dq", "dk", "dv"), grads, strict=True))
        result[tag] = entry
    return result


def _check_all(ours: dict, pieces: list[dict], cat: dict) -> None:
    """Compare `ours[name]` with the per-sequence oracle pieces joined by `cat[name]`."""
    for name, join in cat.items():
        ref = join([p["ref"][name] for p in pieces])
        pt = join([p["pt"][name] for p in pieces])
        factor = 3.0 if name.startswith("d") else 2.0
        dtype = torch.float32 if name == "lse" else ours["dtype"]  # the LSE is never cast
        c = compare(name, ours[name], ref, pt, factor=factor, dtype=dtype)
        assert c.ok, str(c)


# (lengths_q, lengths_k, Hq, Hkv, D, dtype, options, loose max_seqlen)
VARLEN_CASES = [
    ([37, 0, 1, 70], [37, 5, 1, 90], 4, 2, 32, F16, dict(causal=True), 0),
    ([20, 33, 1], [50, 12, 0], 2, 2, 64, F32, dict(window_size=(8, 3), softcap=5.0), 40),
    ([64, 17], [17, 64], 4, 1, 32, BF16, dict(), 0),
]


@pytest.mark.parametrize("version", _versions("varlen"))
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c[5]}-{c[6]}".replace(" ", ""))
def test_varlen_matches_per_sequence_oracle(version, case) -> None:
    lens_q, lens_k, hq, hkv, d, dtype, options, loose = case
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = _rand(gen, sum(lens_q), hq, d, dtype=dtype).requires_grad_()
    k = _rand(gen, sum(lens_k), hkv, d, dtype=dtype).requires_grad_()
    v = _rand(gen, sum(lens_k), hkv, d, dtype=dtype).requires_grad_()
    do = _rand(gen, sum(lens_q), hq, d, dtype=dtype)
    cq, ck = _cu(lens_q), _cu(lens_k)
    out, lse = dispatch.attention_varlen(
        q, k, v, cq, ck, max(lens_q) + loose, max(lens_k) + loose, return_lse=True,
        version=version, **options,
    )  # fmt: skip
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    pieces = []
    for b in range(len(lens_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        pieces.append(
            _oracle(q[None, sq], k[None, sk], v[None, sk], do[None, sq], **options)
        )  # (1, n, H, D) each
    rows = lambda ts: torch.cat([t[0] for t in ts])  # (total, H, D)
    ours = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dtype=dtype)
    lse_cat = lambda ts: torch.cat([t[0] for t in ts], dim=1)  # (H, total)
    _check_all(ours, pieces, dict(out=rows, lse=lse_cat, dq=rows, dk=rows, dv=rows))


def _paged(cache: torch.Tensor, page_size: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense cache (B, N, H, D) scattered over shuffled pages, plus its block table."""
    b, n, h, d = cache.shape
    per_row = n // page_size
    order = torch.randperm(b * per_row + 3, generator=torch.Generator().manual_seed(1))
    table = order[: b * per_row].reshape(b, per_row).to(torch.int32).to(DEV)  # (B, max_pages)
    pages = _rand(gen, b * per_row + 3, page_size, h, d, dtype=cache.dtype)  # spare pages: noise
    pages[table.long()] = cache.reshape(b, per_row, page_size, h, d)
    return pages, table


# (B, Nq, Nnew, Hq, Hkv, D, dtype, cache_seqlens, capacity, page_size, num_splits, options)
KVCACHE_CASES = [
    (3, 1, 0, 8, 2, 64, F16, [37, 0, 90], 128, 0, 0, dict()),
    (3, 4, 4, 4, 2, 64, F16, [37, 5, 80], 128, 16, 3, dict(causal=True)),
    (2, 16, 0, 4, 2, 32, F32, [60, 100], 144, 48, 2, dict(causal=True, window_size=(20, -1))),
    (2, 2, 2, 2, 1, 64, BF16, 30, 64, 32, 0, dict(softcap=5.0)),
]


@pytest.mark.parametrize("version", _versions("kvcache"))
@pytest.mark.parametrize(
    "case", KVCACHE_CASES, ids=lambda c: f"nq{c[1]}-new{c[2]}-page{c[9]}-splits{c[10]}"
)
def test_kvcache_matches_per_row_oracle(version, case) -> None:
    b, nq, n_new, hq, hkv, d, dtype, lens, cap, page, splits, options = case
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = _rand(gen, b, nq, hq, d, dtype=dtype)
    k_dense = _rand(gen, b, cap, hkv, d, dtype=dtype)
    v_dense = _rand(gen, b, cap, hkv, d, dtype=dtype)
    k_new = _rand(gen, b, n_new, hkv, d, dtype=dtype) if n_new else None
    v_new = _rand(gen, b, n_new, hkv, d, dtype=dtype) if n_new else None
    seqlens = lens if isinstance(lens, int) else torch.tensor(lens, dtype=torch.int32, device=DEV)
    old = [lens] * b if isinstance(lens, int) else lens
    if page:
        k_cache, table = _paged(k_dense, page, gen)
        v_cache, _ = _paged(v_dense, page, gen)
        v_cache[table.long()] = v_dense.reshape(b, cap // page, page, hkv, d)
    else:
        k_cache, v_cache, table = k_dense.clone(), v_dense.clone(), None
    out, lse = dispatch.attention_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table,
        num_splits=splits, return_lse=True, version=version, **options,
    )  # fmt: skip
    pieces = []
    for row in range(b):
        n = old[row]
        ks, vs = k_dense[row : row + 1, :n], v_dense[row : row + 1, :n]
        if n_new:
            ks = torch.cat([ks, k_new[row : row + 1]], dim=1)  # (1, n + Nnew, Hkv, D)
            vs = torch.cat([vs, v_new[row : row + 1]], dim=1)
            # the append wrote exactly these tokens into the cache, in place
            stored = k_cache[table[row].long()].flatten(0, 1) if page else k_cache[row]
            assert torch.equal(stored[n : n + n_new], k_new[row])
        pieces.append(_oracle(q[row : row + 1], ks, vs, None, **options))
    cat = lambda ts: torch.cat(ts)  # (B, ...)
    _check_all(dict(out=out, lse=lse, dtype=dtype), pieces, dict(out=cat, lse=cat))


# (B, Nq, Nnew, Hq, Hkv, D, dtype, cache_seqlens, cache_leftpad, capacity, num_splits,
# options): row b attends slots cache_leftpad[b] .. cache_seqlens[b] + Nnew - 1.
LEFTPAD_CASES = [
    (3, 1, 0, 8, 2, 64, F16, [37, 0, 90], [5, 0, 89], 128, 0, dict()),
    (3, 4, 2, 4, 2, 64, BF16, [37, 5, 80], [0, 5, 30], 128, 3, dict(causal=True)),
    (
        2,
        3,
        0,
        4,
        2,
        128,
        BF16,
        [100, 120],
        [70, 1],
        128,
        2,
        dict(causal=True, window_size=(20, -1)),
    ),
    (2, 2, 1, 2, 1, 64, F16, 30, [3, 30], 64, 0, dict(softcap=5.0)),
]


def leftpad_case(case, device: str, gen):
    """Inputs of a LEFTPAD_CASES case: q, the cache with NaN in every slot a row does not
    attend (before its left padding's end and past its keys), the new k, v, the lengths as
    given (an int or int32 tensor), the left padding, and each row's attended (k, v) for the
    oracle, (1, n, Hkv, D) each."""
    b, nq, n_new, hq, hkv, d, dtype, lens, pads, cap, _, _ = case
    q = torch.randn(b, nq, hq, d, generator=gen, device=device).to(dtype)
    k_cache, v_cache = (
        torch.randn(b, cap, hkv, d, generator=gen, device=device).to(dtype) for _ in "kv"
    )
    k_new, v_new = (
        torch.randn(b, n_new, hkv, d, generator=gen, device=device).to(dtype) if n_new else None
        for _ in "kv"
    )
    old = [lens] * b if isinstance(lens, int) else lens
    rows = []
    for row, (n, lp) in enumerate(zip(old, pads, strict=True)):
        ks, vs = k_cache[row : row + 1, lp:n].clone(), v_cache[row : row + 1, lp:n].clone()
        if n_new:
            ks = torch.cat([ks, k_new[row : row + 1]], dim=1)
            vs = torch.cat([vs, v_new[row : row + 1]], dim=1)
        rows.append((ks, vs))
        for t in (k_cache, v_cache):
            t[row, :lp] = math.nan
            t[row, n + n_new :] = math.nan
    seqlens = (
        lens if isinstance(lens, int) else torch.tensor(lens, dtype=torch.int32, device=device)
    )
    leftpad = torch.tensor(pads, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, k_new, v_new, seqlens, leftpad, rows


@pytest.mark.parametrize("version", _versions("kvcache"))
@pytest.mark.parametrize("case", LEFTPAD_CASES, ids=lambda c: f"nq{c[1]}-new{c[2]}-s{c[10]}")
def test_kvcache_leftpad_matches_per_row_oracle(version, case) -> None:
    """cache_leftpad (flash-attn's): row b attends cache slots cache_leftpad[b] ..
    cache_seqlens[b] + Nnew - 1, causal and windows aligned to their end, the new tokens
    appended at cache_seqlens[b]; NaN in every other slot (a read of one shows). Rows whose
    left padding reaches their length see no key but the new ones (or none: out 0, LSE
    -inf)."""
    *_, splits, options = case
    gen = torch.Generator(device=DEV).manual_seed(2)
    q, kc, vc, kn, vn, lens, pads, rows = leftpad_case(case, DEV, gen)
    out, lse = dispatch.attention_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=lens, cache_leftpad=pads, num_splits=splits,
        return_lse=True, version=version, **options,
    )  # fmt: skip
    pieces = [_oracle(q[r : r + 1], ks, vs, None, **options) for r, (ks, vs) in enumerate(rows)]
    cat = lambda ts: torch.cat(ts)  # (B, ...)
    _check_all(dict(out=out, lse=lse, dtype=q.dtype), pieces, dict(out=cat, lse=cat))


@pytest.mark.parametrize(
    ("change", "error", "name"),
    [
        ("int64", TypeError, "cache_leftpad"), ("rows", ValueError, "cache_leftpad"),
        ("past-length", ValueError, "cache_leftpad"), ("negative", ValueError, "cache_leftpad"),
        ("paged", ValueError, "cache_leftpad"),
    ],
)  # fmt: skip
def test_bad_cache_leftpad_raises(change, error, name) -> None:
    """cache_leftpad errors name it: not int32, not one entry a row, an entry past the row's
    length or below 0 (the value checks), a paged cache."""
    q = torch.zeros(2, 1, 4, 32, device=DEV)
    kc = torch.zeros(2, 32, 2, 32, device=DEV)
    pads = torch.tensor([1, 2], dtype=torch.int32, device=DEV)
    lens = torch.tensor([5, 6], dtype=torch.int32, device=DEV)
    table = None
    if change == "int64":
        pads = pads.long()
    elif change == "rows":
        pads = pads[:1]
    elif change == "past-length":
        pads[1] = 7
    elif change == "negative":
        pads[0] = -1
    elif change == "paged":
        kc = torch.zeros(4, 16, 2, 32, device=DEV)
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEV)
    with pytest.raises(error, match=f"^{name}: "):
        dispatch.attention_with_kvcache(
            q, kc, kc.clone(), cache_seqlens=lens, cache_leftpad=pads, block_table=table,
            version="torch",
        )  # fmt: skip


def test_fa2_varlen_split_dkdv_launches_match() -> None:
    """The two-launch dK/dV schedule (dV, then dK) some varlen entries use on the GPU gives the
    same gradients as the one-launch schedule the interpreter table picks."""
    if "fa2" not in runnable_names() or HAS_CUDA:
        pytest.skip("checks the interpreter tiles (the GPU runs the table's own)")
    from dataclasses import replace

    from flashsuite.common.validation import check_varlen_inputs
    from flashsuite.fa2 import configs, interface

    lens = [37, 0, 1, 50]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (_rand(gen, sum(lens), h, 32, dtype=F16) for h in (4, 2, 2, 4))
    cu = _cu(lens)
    vp = check_varlen_inputs(q, k, v, cu, cu, 50, 50, causal=True)
    out, lse = interface.varlen_forward(q, k, v, cu, cu, vp)
    one = interface.varlen_backward(do, q, k, v, out, lse, cu, cu, vp)
    split = replace(configs.INTERPRETER_BWD, split_dkdv=True)
    two = interface.varlen_backward(do, q, k, v, out, lse, cu, cu, vp, config=split)
    for name, a, b in zip(("dq", "dk", "dv"), one, two, strict=True):
        assert torch.equal(a, b), name


def test_kvcache_is_forward_only() -> None:
    q = torch.randn(1, 1, 2, 32, requires_grad=True)
    kc = torch.randn(1, 16, 2, 32)
    out = dispatch.attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=4, version="torch")
    assert not out.requires_grad


def test_inference_kernels_compile_for_sm90_without_spills() -> None:
    """The CI subset of benchmarks/inference_probe.py: real sm_90a compiles (ptxas from the
    triton wheel), so it runs in a subprocess without TRITON_INTERPRET."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parents[1] / "benchmarks" / "inference_probe.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, str(probe), "--quick"], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    rows = [line for line in res.stdout.splitlines() if "regs" in line]
    assert res.returncode == 0 and len(rows) >= 7, res.stdout[-3000:] + res.stderr[-2000:]


def test_split_heuristic() -> None:
    pytest.importorskip("triton")
    from flashsuite.fa2.decode import MAX_SPLITS, PROGRAMS_PER_SM, num_splits_heuristic

    sms = 132
    # B = 1, GQA 32/8, 128k keys in 64-key blocks: 8 programs alone leave the GPU idle.
    one = num_splits_heuristic(8, 2048, sms)
    assert 8 * one <= PROGRAMS_PER_SM * sms and one >= 32 and one <= MAX_SPLITS
    assert num_splits_heuristic(128 * 8, 512, sms) == 1  # B = 128 fills the GPU by itself
    assert num_splits_heuristic(8, 4, sms) == 1  # too few key blocks to split
    mid = num_splits_heuristic(8 * 8, 512, sms)  # B = 8, 32k
    assert 1 < mid < one


def _bad_varlen(**change):
    q = torch.randn(10, 4, 32)
    k = torch.randn(12, 2, 32)
    args = dict(
        q=q, k=k, v=k.clone(), cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 6, 12], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=6,
    )  # fmt: skip
    args.update(change)
    return args


VARLEN_ERRORS = [
    (
        dict(cu_seqlens_q=torch.tensor([0, 4, 10])),
        TypeError,
        "cu_seqlens_q: expected dtype int32, got int64",
    ),
    (
        dict(cu_seqlens_k=torch.tensor([0, 12], dtype=I32)),
        ValueError,
        "cu_seqlens_k: expected shape (3,), got (2,)",
    ),
    (
        dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=I32)),
        ValueError,
        "cu_seqlens_q: expected cu_seqlens[0] == 0, got 1",
    ),
    (
        dict(cu_seqlens_k=torch.tensor([0, 7, 6], dtype=I32)),
        ValueError,
        "cu_seqlens_k: expected non-decreasing values",
    ),
    (
        dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=I32)),
        ValueError,
        "cu_seqlens_q: expected the last value to be the total 10 (q.shape[0]), got 9",
    ),
    (
        dict(max_seqlen_k=5),
        ValueError,
        "max_seqlen_k: expected >= the longest sequence in cu_seqlens_k (6), got 5",
    ),
    (
        dict(k=torch.randn(12, 3, 32), v=torch.randn(12, 3, 32)),
        ValueError,
        "multiple of the number of key/value heads, got 3",
    ),
    (dict(q=torch.randn(10, 4, 32, 1)), ValueError, "q: expected a 3-D tensor"),
    (dict(v=torch.randn(11, 2, 32)), ValueError, "v: expected 12 tokens (k.shape[0]), got 11"),
]
if HAS_CUDA:
    VARLEN_ERRORS.append(
        (
            dict(cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")),
            ValueError,
            "cu_seqlens_q: expected device cpu (q's device), got cuda:0",
        )
    )


@pytest.mark.parametrize("change, exc, message", VARLEN_ERRORS, ids=lambda x: None)
def test_varlen_bad_input_is_a_clear_error(change, exc, message) -> None:
    with pytest.raises(exc) as info:
        dispatch.attention_varlen(**_bad_varlen(**change), version="torch")
    assert message in str(info.value)


def _bad_kvcache(**change):
    args = dict(
        q=torch.randn(2, 1, 4, 32), k_cache=torch.randn(8, 16, 2, 32),
        v_cache=torch.randn(8, 16, 2, 32), cache_seqlens=torch.tensor([5, 20], dtype=torch.int32),
        block_table=torch.tensor([[0, 3], [5, 7]], dtype=torch.int32),
    )  # fmt: skip
    args.update(change)
    return args


KVCACHE_ERRORS = [
    (
        dict(cache_seqlens=torch.tensor([5, 33], dtype=I32)),
        ValueError,
        "cache_seqlens: expected 0 <= cache_seqlens[1] + Nnew <= 32 (the cache capacity), got 33",
    ),
    (dict(cache_seqlens=33), ValueError, "cache_seqlens: expected cache_seqlens + Nnew <= 32"),
    (
        dict(cache_seqlens=torch.tensor([5, 20])),
        TypeError,
        "cache_seqlens: expected dtype int32, got int64",
    ),
    (
        dict(block_table=torch.tensor([[0, 3], [5, 8]], dtype=I32)),
        ValueError,
        "block_table: expected entries in [0, 8) (k_cache.shape[0]), got block_table[1, 1] = 8",
    ),
    (
        dict(block_table=torch.tensor([[0, 3], [-1, 7]], dtype=I32)),
        ValueError,
        "got block_table[1, 0] = -1",
    ),
    (  # every row on two pages: the same check over the whole used width
        dict(
            cache_seqlens=torch.tensor([20, 17], dtype=I32),
            block_table=torch.tensor([[0, 8], [5, 7]], dtype=I32),
        ),
        ValueError,
        "got block_table[0, 1] = 8",
    ),
    (
        dict(cache_seqlens=torch.tensor([3, -1], dtype=I32)),
        ValueError,
        "expected 0 <= cache_seqlens[1] + Nnew <= 32 (the cache capacity), got -1 + 0",
    ),
    (
        dict(block_table=torch.tensor([[0, 3]], dtype=I32)),
        ValueError,
        "block_table: expected shape (2, 'any'), got (1, 2)",
    ),
    (
        dict(k_cache=torch.randn(8, 24, 2, 32), v_cache=torch.randn(8, 24, 2, 32)),
        ValueError,
        "expected a page size (k_cache.shape[1]) that is a multiple of 16",
    ),
    (
        dict(k_cache=torch.randn(8, 16, 3, 32), v_cache=torch.randn(8, 16, 3, 32)),
        ValueError,
        "multiple of the number of key/value heads, got 3",
    ),
    (
        dict(k=torch.randn(2, 1, 2, 32)),
        ValueError,
        "v: expected a tensor (k and v are given together), got None",
    ),
    (
        dict(
            k=torch.randn(2, 1, 2, 32),
            v=torch.randn(2, 1, 2, 32),
            cache_seqlens=torch.tensor([5, 32], dtype=I32),
        ),
        ValueError,
        "got 32 + 1",
    ),
    (
        dict(
            block_table=None,
            k_cache=torch.randn(1, 16, 2, 32),
            v_cache=torch.randn(1, 16, 2, 32),
            cache_seqlens=3,
        ),
        ValueError,
        "k_cache: expected a batch of at least 2 (q.shape[0]), got 1",
    ),
    (
        dict(cache_seqlens=None),
        TypeError,
        "cache_seqlens: expected an int32 tensor of shape (B,) or an int, got None",
    ),
]


@pytest.mark.parametrize("change, exc, message", KVCACHE_ERRORS, ids=lambda x: None)
def test_kvcache_bad_input_is_a_clear_error(change, exc, message) -> None:
    with pytest.raises(exc) as info:
        dispatch.attention_with_kvcache(**_bad_kvcache(**change), version="torch")
    assert message in str(info.value)


@pytest.mark.parametrize(
    "lens, table",
    [([5, 20], [[0, -1], [5, 7]]), ([5, 5], [[0, 99], [5, -7]]), ([0, 0], [[-3, 99], [8, 9]])],
)
def test_kvcache_unused_block_table_entries_may_hold_anything(lens, table) -> None:
    """Only the entries a row's keys occupy (ceil((cache_seqlens + Nnew) / page_size)) are
    checked: padding such as -1 beyond them is what serving engines leave there."""
    args = _bad_kvcache(
        cache_seqlens=torch.tensor(lens, dtype=I32), block_table=torch.tensor(table, dtype=I32)
    )
    out = dispatch.attention_with_kvcache(**args, version="torch")
    assert out.shape == (2, 1, 4, 32) and out.isfinite().all()


def test_explain_on_sm90_picks_fa3_varlen_and_kvcache() -> None:
    """Packed sequences and KV-cache attention run fa3's kernels on sm90 where the CuTe DSL is
    importable, else fa2's, with fa3's reason."""
    pytest.importorskip("triton")
    from flashsuite.dispatch import registry

    q, k = torch.randn(10, 4, 64, dtype=BF16), torch.randn(10, 2, 64, dtype=BF16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with override_arch(90):
        choice = dispatch.select_varlen(q, k, k, cu, cu, 6, 6, causal=True)
        if registry.available("fa3")[0]:
            assert choice.version == "fa3", str(choice)
        else:
            assert choice.version == "fa2" and "fa3: no" in str(choice), str(choice)
        text = dispatch.explain_kvcache(q[None], k[None], k[None], cache_seqlens=3)
        if registry.available("fa3")[0]:
            assert text.splitlines()[0].endswith("-> fa3"), text
        else:
            assert text.splitlines()[0].endswith("-> fa2") and "fa3: no" in text, text
    with override_arch(None):
        assert (
            dispatch.select_kvcache(q[None], k[None], k[None], cache_seqlens=3).version == "torch"
        )


def test_explicit_version_without_the_entry_point_raises() -> None:
    """fa1 has neither packed-sequence nor KV-cache entry points: asked for by name, it raises."""
    if "fa1" not in runnable_names():
        pytest.skip("fa1 not runnable here")
    q, k = torch.randn(10, 4, 64), torch.randn(10, 2, 64)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(dispatch.Unsupported, match="version 'fa1' cannot run varlen"):
        dispatch.attention_varlen(q, k, k, cu, cu, 6, 6, version="fa1")
    with pytest.raises(dispatch.Unsupported, match="version 'fa1' cannot run"):
        dispatch.attention_with_kvcache(q[None], k[None], k[None], cache_seqlens=3, version="fa1")


def test_torch_compile_fullgraph() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(10, 4, 32, generator=gen, requires_grad=True)
    k = torch.randn(12, 2, 32, generator=gen, requires_grad=True)
    cq = torch.tensor([0, 4, 10], dtype=torch.int32)
    ck = torch.tensor([0, 6, 12], dtype=torch.int32)
    varlen = lambda q, k: dispatch.attention_varlen(q, k, k, cq, ck, 6, 6, causal=True)
    eager = varlen(q, k)
    compiled = torch.compile(varlen, fullgraph=True, backend="aot_eager")(q, k)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    (gq,) = torch.autograd.grad(compiled.sum(), (q,))
    (eq,) = torch.autograd.grad(eager.sum(), (q,))
    torch.testing.assert_close(gq, eq)

    kc, vc = torch.randn(2, 32, 2, 32, generator=gen), torch.randn(2, 32, 2, 32, generator=gen)
    kn, vn = torch.randn(2, 1, 2, 32, generator=gen), torch.randn(2, 1, 2, 32, generator=gen)
    lens = torch.tensor([3, 20], dtype=torch.int32)
    decode = lambda q, kc, vc: dispatch.attention_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=lens, causal=True
    )
    qd = q.detach()[:2, None]  # (2, 1, 4, 32): decode is forward-only
    eager = decode(qd, kc.clone(), vc.clone())
    kc2, vc2 = kc.clone(), vc.clone()
    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")(qd, kc2, vc2)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert torch.equal(kc2[1, 20], kn[1, 0])  # the append happened inside the graph


GPU_DECODE = [(b, n, page) for b, n in ((1, 131072), (8, 32768), (32, 4096)) for page in (0, 64)]


@pytest.mark.gpu
@GPU_MEMORY
@pytest.mark.parametrize("b, n, page", GPU_DECODE)
def test_gpu_decode_large(b, n, page) -> None:
    """GQA 32/8, D=128, bf16 decode at serving sizes against the portable version (fp32)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = _rand(gen, b, 1, 32, 128, dtype=BF16)
    k = _rand(gen, b, n, 8, 128, dtype=BF16)
    v = _rand(gen, b, n, 8, 128, dtype=BF16)
    lens = torch.randint(n // 2, n + 1, (b,), generator=gen, device=DEV).to(torch.int32)
    table = None
    if page:
        k, table = _paged(k, page, gen)
        v_pages, _ = _paged(v, page, gen)
        v_pages[table.long()] = v.reshape(b, n // page, page, 8, 128)
        v = v_pages
    out, lse = dispatch.attention_with_kvcache(
        q, k, v, cache_seqlens=lens, block_table=table, return_lse=True, version="fa2"
    )
    ref, ref_lse = dispatch.attention_with_kvcache(
        q.float(), k.float(), v.float(), cache_seqlens=lens, block_table=table,
        return_lse=True, version="torch",
    )  # fmt: skip
    # |out| is small here (a softmax average of thousands of random rows): relative bound.
    # On failure: the errors per row with its length, and the split count the heuristic chose
    # (which rows, how many splits, contiguous or paged: enough to tell the cause).
    from flashsuite.fa2 import decode, interface

    tiles = b * 8 * 1  # Hkv programs of one 16-row tile each (4 packed rows per K/V head)
    splits = decode.num_splits_heuristic(tiles, n // 64, interface._num_sms(q))
    out_err = (out.float() - ref).abs().amax(dim=(1, 2, 3))  # (B,)
    lse_err = (lse - ref_lse).abs().amax(dim=(1, 2))  # (B,)
    bound = 2e-2 * ref.abs().max().item()
    rows = [
        f"row {i}: len {int(lens[i])} out_err {out_err[i].item():.3g} "
        f"lse_err {lse_err[i].item():.3g}"
        for i in range(b)
    ]
    detail = f"splits={splits}, out bound {bound:.3g}, lse bound 1e-3\n" + "\n".join(rows)
    assert out_err.max().item() <= bound and lse_err.max().item() < 1e-3, detail


@pytest.mark.gpu
@GPU_MEMORY
def test_gpu_varlen_large() -> None:
    """Mixed lengths up to 4k, GQA 32/8, D=128, bf16, causal, forward and backward."""
    gen = torch.Generator().manual_seed(0)
    lens = [*torch.randint(1, 4096, (12,), generator=gen).tolist(), 0, 1]
    cu = _cu(lens)
    g = torch.Generator(device=DEV).manual_seed(0)
    q = _rand(g, sum(lens), 32, 128, dtype=BF16).requires_grad_()
    k = _rand(g, sum(lens), 8, 128, dtype=BF16).requires_grad_()
    v = _rand(g, sum(lens), 8, 128, dtype=BF16).requires_grad_()
    do = _rand(g, sum(lens), 32, 128, dtype=BF16)
    results = {}
    for version in ("fa2", "torch"):
        out = dispatch.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                        version=version)  # fmt: skip
        results[version] = (out, *torch.autograd.grad(out, (q, k, v), do))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results.values(), strict=True):
        err = (a.float() - b.float()).abs().max().item()
        assert err < 5e-2 * max(1.0, b.float().abs().max().item()), (name, err)


class _NoOpMode(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing: with it active, attention_with_kvcache takes its
    custom op, as under a tensor subclass or a tracing mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("version", ["torch", "fa2"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_eager_path_is_the_op_path(version, paged) -> None:
    """attention_with_kvcache's eager path (one validation and selection per static signature,
    the version's function called without its custom op) gives the op path's out, lse and
    cache, appends included; a repeat call is served from the memo; bad metadata values still
    raise on a memoised signature (they are checked per call)."""
    from flashsuite.dispatch import inference

    if version == "fa2":
        pytest.importorskip("triton")
    gen = torch.Generator(device=DEV).manual_seed(4)
    b, page = 2, 16
    q = _rand(gen, b, 2, 4, 32, dtype=BF16)
    kn, vn = (_rand(gen, b, 2, 2, 32, dtype=BF16) for _ in range(2))
    lens = torch.tensor([5, 20], dtype=I32, device=DEV)
    if paged:
        kc = _rand(gen, 8, page, 2, 32, dtype=BF16)
        table = torch.tensor([[3, 0], [5, 7]], dtype=I32, device=DEV)
    else:
        kc, table = _rand(gen, b, 32, 2, 32, dtype=BF16), None
    vc = _rand(gen, *kc.shape, dtype=BF16)
    results = []
    for mode in (None, _NoOpMode()):
        k_cache, v_cache = kc.clone(), vc.clone()
        inference._kv_plans.clear()
        with mode or contextlib.nullcontext():
            got = [
                dispatch.attention_with_kvcache(
                    q, k_cache, v_cache, kn, vn, cache_seqlens=lens + 2 * i, block_table=table,
                    causal=True, return_lse=True, version=version,
                )
                for i in range(2)
            ]  # fmt: skip
        results.append((got, k_cache, v_cache))
        assert len(inference._kv_plans) == 1  # two calls of one signature: one plan
    (eager, ke, ve), (op, ko, vo) = results
    for a, b_ in zip([*eager[0], *eager[1], ke, ve], [*op[0], *op[1], ko, vo], strict=True):
        torch.testing.assert_close(a, b_, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] \+ Nnew <= 32"):
        dispatch.attention_with_kvcache(
            q, kc.clone(), vc.clone(), kn, vn,
            cache_seqlens=torch.tensor([5, 31], dtype=I32, device=DEV), block_table=table,
            causal=True, version=version,
        )  # fmt: skip


@pytest.mark.parametrize("version", ["torch", "fa2"])
def test_varlen_eager_path_is_the_op_path(version) -> None:
    """attention_varlen's eager path (one validation and selection per static signature, the
    version's varlen forward and backward called from an autograd.Function without the ops)
    gives the op path's out, lse and gradients bit for bit; a repeat call is served from the
    memo."""
    from flashsuite.dispatch import inference

    if version == "fa2":
        pytest.importorskip("triton")
    gen = torch.Generator(device=DEV).manual_seed(5)
    lens = [9, 0, 23]
    cu = _cu(lens)
    q = _rand(gen, sum(lens), 4, 32, dtype=BF16)
    k, v = (_rand(gen, sum(lens), 2, 32, dtype=BF16) for _ in range(2))
    do = _rand(gen, sum(lens), 4, 32, dtype=BF16)
    results = []
    for mode in (None, _NoOpMode()):
        inference._varlen_plans.clear()
        with mode or contextlib.nullcontext():
            got = []
            for _ in range(2):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                out, lse = dispatch.attention_varlen(
                    *leaves, cu, cu, 23, 23, causal=True, return_lse=True, version=version
                )
                got += [out, lse, *torch.autograd.grad(out, leaves, do)]
            with torch.no_grad():
                got.append(dispatch.attention_varlen(q, k, v, cu, cu, 23, 23, version=version))
        results.append(got)
        assert len(inference._varlen_plans) == 2  # one per signature: with, without a gradient
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_varlen_plan_follows_the_backward_switches(monkeypatch) -> None:
    """The memoised varlen plan is decided afresh when a switch that chooses the backward
    changes (FLASHSUITE_<VERSION>_VARLEN_BWD, deterministic algorithms)."""
    from flashsuite.dispatch import inference

    gen = torch.Generator(device=DEV).manual_seed(8)
    q, k, v = (_rand(gen, 30, 2, 32, dtype=F32).requires_grad_() for _ in range(3))
    cu = _cu([10, 20])
    inference._varlen_plans.clear()
    dispatch.attention_varlen(q, k, v, cu, cu, 20, 20, version="torch")
    monkeypatch.setenv("FLASHSUITE_FA3_VARLEN_BWD", "0")
    dispatch.attention_varlen(q, k, v, cu, cu, 20, 20, version="torch")
    assert len(inference._varlen_plans) == 2
    with _deterministic_algorithms():
        dispatch.attention_varlen(q, k, v, cu, cu, 20, 20, version="torch")
    assert len(inference._varlen_plans) == 3


@contextlib.contextmanager
def _deterministic_algorithms():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _counted_checks(monkeypatch, name: str) -> list:
    """A list that grows by one on every call of common.metadata's value check `name`, the
    memo of checked metadata emptied first."""
    from flashsuite.common import metadata

    checks = []
    real = getattr(metadata, name)
    monkeypatch.setattr(metadata, name, lambda *a: (checks.append(1), real(*a)))
    metadata._checked.clear()
    return checks


def test_varlen_metadata_checked_once_per_tensor_version(monkeypatch) -> None:
    """A cu_seqlens pair that passed the value check is not copied to the host again while the
    same tensors are passed unchanged (a model's layers share theirs); an in-place write, other
    tensors or another max_seqlen check again, and bad values still raise."""
    checks = _counted_checks(monkeypatch, "check_varlen_metadata")
    gen = torch.Generator(device=DEV).manual_seed(6)
    q, k, v = (_rand(gen, 30, 2, 32, dtype=F32) for _ in range(3))
    cu = _cu([10, 20])

    def call(cu_q, cu_k, max_len=20):
        return dispatch.attention_varlen(q, k, v, cu_q, cu_k, max_len, max_len, version="torch")

    for _ in range(3):
        call(cu, cu)
    assert len(checks) == 1
    call(cu, cu, max_len=25)
    call(cu.clone(), cu)
    assert len(checks) == 3
    cu[1] = 25  # a length of 25 > max_seqlen 20: seen through the version counter
    with pytest.raises(ValueError, match="max_seqlen_q: expected >= the longest sequence"):
        call(cu, cu)
    cu[1] = 10
    call(cu, cu)
    assert len(checks) == 5
    monkeypatch.setenv("FLASHSUITE_CHECK_METADATA", "0")
    cu[1] = 25
    call(cu, cu)  # checks off: trusted, as flash-attn trusts it
    assert len(checks) == 5


def test_kvcache_metadata_checked_once_per_tensor_version(monkeypatch) -> None:
    """A decode step passes one cache_seqlens and block_table to every layer: the pair is
    copied to the host once while unchanged; an in-place update (the next step) checks again,
    bad values still raise, and an int length with a block table is remembered with the
    table."""
    checks = _counted_checks(monkeypatch, "check_kvcache_metadata")
    gen = torch.Generator(device=DEV).manual_seed(9)
    q = _rand(gen, 2, 1, 4, 32, dtype=BF16)
    pages = _rand(gen, 8, 16, 2, 32, dtype=BF16)
    table = torch.tensor([[3, 0], [5, 7]], dtype=I32, device=DEV)
    lens = torch.tensor([5, 20], dtype=I32, device=DEV)

    def layer(lengths, tbl=table):
        return dispatch.attention_with_kvcache(
            q, pages, pages, cache_seqlens=lengths, block_table=tbl, version="torch"
        )

    for _ in range(4):  # four layers of one step
        layer(lens)
    assert len(checks) == 1
    lens += 1  # the next step
    layer(lens)
    layer(lens)
    assert len(checks) == 2
    table[1, 1] = 8  # page 8 of 8 pages: out of range, for a row that uses it
    with pytest.raises(ValueError, match=r"block_table: expected entries in \[0, 8\)"):
        layer(lens)
    table[1, 1] = 7
    for _ in range(3):
        layer(12)  # an int length: checked on the host, the table once
    assert len(checks) == 4


@pytest.mark.gpu
def test_gpu_varlen_captures_in_a_cuda_graph_with_checks_on(monkeypatch) -> None:
    """With the metadata value checks on (the default), a varlen forward is captured in a CUDA
    graph (no host copy is captured: the checks skip while the stream captures) and the replay
    matches the eager call."""
    monkeypatch.setenv("FLASHSUITE_CHECK_METADATA", "1")
    gen = torch.Generator(device=DEV).manual_seed(7)
    lens = [100, 3, 250]
    cu = _cu(lens)
    q, k, v = (_rand(gen, sum(lens), 4, 128, dtype=BF16) for _ in range(3))
    with torch.no_grad():
        want = dispatch.attention_varlen(q, k, v, cu, cu, 250, 250, causal=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dispatch.attention_varlen(q, k, v, cu, cu, 250, 250, causal=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = dispatch.attention_varlen(q, k, v, cu, cu, 250, 250, causal=True)
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_kvcache_int_lengths_keep_one_plan(monkeypatch) -> None:
    """A decode loop that passes its growing length as an int (transformers' decode step)
    keeps one memoised plan; the value is still checked on every call, on the host: a
    contiguous cache's step runs no device-to-host value check."""
    from flashsuite.common import metadata
    from flashsuite.dispatch import inference

    checked = []
    real_check = metadata.check_kvcache_metadata
    monkeypatch.setattr(
        metadata, "check_kvcache_metadata", lambda *a: (checked.append(1), real_check(*a))
    )

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 4, 32, generator=gen).to(BF16)
    kc, vc = (torch.randn(1, 32, 2, 32, generator=gen).to(BF16) for _ in range(2))
    inference._kv_plans.clear()
    for n in (3, 4, 5, 32):
        got = dispatch.attention_with_kvcache(q, kc, vc, cache_seqlens=n, version="torch")
        ref = dispatch.attention(q, kc[:, :n], vc[:, :n], causal=True, version="torch")
        torch.testing.assert_close(got, ref, atol=1e-2, rtol=0)
    assert len(inference._kv_plans) == 1 and not checked
    lens = torch.tensor([5], dtype=I32)
    dispatch.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, version="torch")
    assert checked  # a tensor's values are checked
    for bad, exc in ((33, ValueError), (-1, ValueError)):
        with pytest.raises(exc, match="cache_seqlens"):
            dispatch.attention_with_kvcache(q, kc, vc, cache_seqlens=bad, version="torch")


def test_kvcache_int_length_tensor_is_shared_by_a_steps_layers() -> None:
    """An int cache_seqlens becomes one int32 (batch,) tensor per (device, stream, batch,
    length), shared by the layers of a decode step (one fill a step, not one a layer): the
    same tensor for the same length, a new one for the next step's, right values, the cache
    bounded; calls that append k, v through it leave it as it was."""
    from flashsuite.common import kvcache

    kvcache._length_tensors.clear()
    first = kvcache.length_tensor(3, 17, torch.device("cpu"))
    assert first.dtype == I32 and first.tolist() == [17, 17, 17]
    assert kvcache.length_tensor(3, 17, torch.device("cpu")) is first
    nxt = kvcache.length_tensor(3, 18, torch.device("cpu"))
    assert nxt is not first and nxt.tolist() == [18, 18, 18]
    assert kvcache.length_tensor(2, 17, torch.device("cpu")).tolist() == [17, 17]
    for n in range(2 * kvcache.LENGTH_TENSORS_MAX):
        kvcache.length_tensor(1, n, torch.device("cpu"))
    assert len(kvcache._length_tensors) <= kvcache.LENGTH_TENSORS_MAX

    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 1, 4, 32, generator=gen).to(BF16)
    kc, vc = (torch.randn(2, 16, 2, 32, generator=gen).to(BF16) for _ in range(2))
    kn, vn = (torch.randn(2, 1, 2, 32, generator=gen).to(BF16) for _ in range(2))
    shared = kvcache.length_tensor(2, 5, torch.device("cpu"))  # what the calls will take
    outs = []
    for _ in range(2):  # two layers of one step, each appending its token at slot 5
        outs.append(dispatch.attention_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=5, version="torch"))  # fmt: skip
    assert kvcache.length_tensor(2, 5, torch.device("cpu")) is shared
    assert shared.tolist() == [5, 5]  # read by the appends, never written
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    ref = dispatch.attention(q, kc[:, :6], vc[:, :6], causal=True, version="torch")
    torch.testing.assert_close(outs[0], ref, atol=1e-2, rtol=0)


@pytest.mark.gpu
def test_gpu_kvcache_int_length_under_capture_is_not_cached() -> None:
    """Under CUDA-graph capture an int length gets a tensor of its own (filled by the graph at
    each replay; a cached one could be dropped while the graph still reads it), and the replay
    matches the eager call, whose tensor is cached."""
    from flashsuite.common import kvcache

    gen = torch.Generator(device=DEV).manual_seed(4)
    q = _rand(gen, 2, 1, 8, 128, dtype=BF16)
    kc, vc = (_rand(gen, 2, 512, 2, 128, dtype=BF16) for _ in range(2))
    kvcache._length_tensors.clear()
    with torch.no_grad():
        want = dispatch.attention_with_kvcache(q, kc, vc, cache_seqlens=300)
        cached = dict(kvcache._length_tensors)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dispatch.attention_with_kvcache(q, kc, vc, cache_seqlens=300)
        torch.cuda.current_stream().wait_stream(stream)
        before = dict(kvcache._length_tensors)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = dispatch.attention_with_kvcache(q, kc, vc, cache_seqlens=300)
        after = kvcache._length_tensors  # nothing cached while capturing
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
        graph.replay()
    torch.cuda.synchronize()
    assert len(cached) == 1
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("n_new", [1, 5])
def test_append_kernel_is_the_torch_append(paged, n_new, device) -> None:
    """common.append_kernel.append (one Triton launch: compiled on a GPU, the interpreter on a
    CPU) writes exactly the slots common.kvcache.append_kv's indexing writes, GQA heads and
    Dv != D included, through strided k / v views; a negative length, a position past the
    capacity or a page index out of range (what the value checks refuse; they are off with
    FLASHSUITE_CHECK_METADATA=0) writes nothing rather than elsewhere."""
    pytest.importorskip("triton")
    from flashsuite.common import append_kernel, kvcache

    gen = torch.Generator().manual_seed(6)
    b, hkv, d, dv, page = 3, 2, 24, 40, 16
    # k / v as views of wider rows: outer strides of their own, unit last stride.
    k = torch.randn(b, n_new, hkv, d + 8, generator=gen).to(device, BF16)[..., :d]
    v = torch.randn(b, n_new, hkv, dv, generator=gen).to(device, BF16)
    lens = torch.tensor([0, 17, 40], dtype=I32, device=device)
    if paged:
        kc = torch.randn(9, page, hkv, d, generator=gen).to(device, BF16)
        table = torch.tensor([[4, 0, 8, 2], [1, 7, 3, 6], [5, 6, 0, 1]], dtype=I32, device=device)
    else:
        kc, table = torch.randn(b, 64, hkv, d, generator=gen).to(device, BF16), None
    vc = torch.randn(*kc.shape[:3], dv, generator=gen).to(device, BF16)
    ref_k, ref_v = kc.clone(), vc.clone()
    kvcache.append_kv(ref_k, ref_v, k, v, lens, table)
    got_k, got_v = kc.clone(), vc.clone()
    append_kernel.append(got_k, got_v, k, v, lens, table)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    assert not torch.equal(got_k, kc)  # something was written
    if device == "cuda":  # the compiled kernel ran, not the fallback
        from flashsuite.common import triton_launch

        assert append_kernel._append_kv in {key[0] for key in triton_launch._compiled}
    bad_lens = torch.tensor([-1, 64, 60], dtype=I32, device=device)  # row 2: partly fits
    bad_table = None
    if paged:
        bad_table = torch.tensor([[0] * 4, [0] * 4, [0, 0, 0, 99]], dtype=I32, device=device)
    got_k, got_v = kc.clone(), vc.clone()
    append_kernel.append(got_k, got_v, k, v, bad_lens, bad_table)
    if paged:  # row 2, positions 60..: page 99 does not exist
        assert torch.equal(got_k, kc) and torch.equal(got_v, vc)
    else:  # only row 2's tokens below 64 land, at their slots
        fits = min(n_new, 4)
        assert torch.equal(got_k[2, 60 : 60 + fits], k[2, :fits])
        assert torch.equal(got_v[2, 60 : 60 + fits], v[2, :fits])
        got_k[2, 60 : 60 + fits] = kc[2, 60 : 60 + fits]
        got_v[2, 60 : 60 + fits] = vc[2, 60 : 60 + fits]
        assert torch.equal(got_k, kc) and torch.equal(got_v, vc)
