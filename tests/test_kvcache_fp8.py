"""A float8_e4m3fn KV cache under fp16 / bf16 queries (attention_with_kvcache's descale_k,
descale_v; flash_attn_with_kvcache's k_descale, v_descale): every version that reads one (fa2
under the Triton interpreter, torch; fa3 refuses it) against a per-row float64 oracle on the
dequantised cache, the e4m3 append, the op path, selection and the errors."""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.arch import override_arch
from flashsuite.common.fp8 import dequantize_e4m3, quantize_e4m3
from flashsuite.common.testing import compare
from tests.conftest import HAS_CUDA, runnable_versions
from tests.test_inference import _NoOpMode, _oracle

F16, BF16, F32, I32 = torch.float16, torch.bfloat16, torch.float32, torch.int32
E4M3 = torch.float8_e4m3fn
DEV = "cuda" if HAS_CUDA else "cpu"
VERSIONS = [p for p in runnable_versions() if p.values[0] in ("fa2", "torch")]


def _rand(gen, *shape, dtype=F32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


def _problem(case, gen):
    """q, the e4m3 caches and their descales (paged over a shuffled table when page > 0), the
    new e4m3 tokens, and the real (dequantised, float32) keys and values of every slot."""
    b, nq, n_new, hq, hkv, d, dtype, _, cap, page, _, scaled, _ = case
    q = _rand(gen, b, nq, hq, d, dtype=dtype)
    # Heads of different magnitudes, so that a descale read for the wrong (row, head) shows.
    spread = 0.25 + 4 * torch.rand(b, 1, hkv, 1, generator=gen, device=DEV)
    k8, dk = quantize_e4m3(_rand(gen, b, cap, hkv, d) * spread)
    v8, dv = quantize_e4m3(_rand(gen, b, cap, hkv, d) * spread.flip(2))
    if not scaled:  # descales None: the cache's values are the real ones
        dk = dv = None
    kn = vn = None
    if n_new:
        kn = quantize_e4m3(_rand(gen, b, n_new, hkv, d), descale=dk)[0] if scaled else None
        vn = quantize_e4m3(_rand(gen, b, n_new, hkv, d), descale=dv)[0] if scaled else None
        if not scaled:
            kn, vn = (_rand(gen, b, n_new, hkv, d).to(E4M3) for _ in "kv")
    table = None
    k_cache, v_cache = k8.clone(), v8.clone()
    if page:
        per_row = cap // page
        order = torch.randperm(b * per_row + 2, generator=torch.Generator().manual_seed(1))
        table = order[: b * per_row].reshape(b, per_row).to(I32).to(DEV)  # (B, max_pages)
        k_cache, v_cache = (
            _rand(gen, b * per_row + 2, page, hkv, d).to(E4M3) for _ in "kv"
        )  # spare pages: noise
        k_cache[table.long()] = k8.reshape(b, per_row, page, hkv, d)
        v_cache[table.long()] = v8.reshape(b, per_row, page, hkv, d)
    return q, k_cache, v_cache, kn, vn, dk, dv, table, k8, v8


def _real(x8, descale):
    return x8.float() if descale is None else dequantize_e4m3(x8, descale)


# (B, Nq, Nnew, Hq, Hkv, D, dtype, cache_seqlens, capacity, page_size, num_splits, scaled,
# options)
CASES = [
    (3, 1, 0, 8, 2, 64, BF16, [37, 0, 90], 128, 0, 0, True, {}),
    (3, 4, 2, 4, 2, 64, F16, [37, 5, 80], 128, 16, 3, True, dict(causal=True)),
    (2, 3, 0, 4, 4, 128, BF16, [100, 120], 128, 0, 2, True,
     dict(causal=True, window_size=(20, -1))),  # MHA
    (2, 2, 1, 2, 1, 64, F16, 30, 64, 32, 0, False, dict(softcap=5.0)),  # descales None
]  # fmt: skip


def _case_id(c) -> str:
    return f"nq{c[1]}-new{c[2]}-page{c[9]}-splits{c[10]}-{'scaled' if c[11] else 'unscaled'}"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp8_cache_matches_per_row_oracle(version, case) -> None:
    """Out and LSE of each row against the float64 oracle on its dequantised keys and values
    (the yardstick: the same in q's dtype), after the e4m3 append wrote the new tokens' bytes
    into the cache in place."""
    b, _, n_new, _, _, _, dtype, lens, _, page, splits, _, options = case
    gen = torch.Generator(device=DEV).manual_seed(0)
    q, k_cache, v_cache, kn, vn, dk, dv, table, k8, v8 = _problem(case, gen)
    seqlens = lens if isinstance(lens, int) else torch.tensor(lens, dtype=I32, device=DEV)
    old = [lens] * b if isinstance(lens, int) else lens
    out, lse = dispatch.attention_with_kvcache(
        q, k_cache, v_cache, kn, vn, cache_seqlens=seqlens, block_table=table,
        num_splits=splits, return_lse=True, version=version, descale_k=dk, descale_v=dv,
        **options,
    )  # fmt: skip
    for row in range(b):
        n = old[row]
        ks, vs = k8[row : row + 1, :n], v8[row : row + 1, :n]  # e4m3 (1, n, Hkv, D)
        if n_new:
            stored = k_cache[table[row].long()].flatten(0, 1) if page else k_cache[row]
            assert torch.equal(stored[n : n + n_new].view(torch.uint8), kn[row].view(torch.uint8))
            ks, vs = torch.cat([ks, kn[row : row + 1]], 1), torch.cat([vs, vn[row : row + 1]], 1)
        row_dk = None if dk is None else dk[row : row + 1]
        row_dv = None if dv is None else dv[row : row + 1]
        kr, vr = _real(ks, row_dk), _real(vs, row_dv)  # float32 (1, n + Nnew, Hkv, D)
        ref = _oracle(q[row : row + 1], kr.to(dtype), vr.to(dtype), None, **options)["pt"]
        exact = _oracle(q[row : row + 1].double(), kr.double(), vr.double(), None, **options)
        for name, got in (("out", out), ("lse", lse)):
            c = compare(name, got[row : row + 1], exact["ref"][name], ref[name],
                        dtype=F32 if name == "lse" else dtype)  # fmt: skip
            assert c.ok, f"row {row}: {c}"


def test_a_wrong_descale_fails_the_oracle() -> None:
    """The check above cannot pass with the descales misread: the same call with descale_k and
    descale_v swapped fails it (each head's keys and values are scaled differently)."""
    case = CASES[0]
    gen = torch.Generator(device=DEV).manual_seed(0)
    q, k_cache, v_cache, _, _, dk, dv, _, k8, v8 = _problem(case, gen)
    lens = torch.tensor(case[7], dtype=I32, device=DEV)
    n = case[7][2]
    kr, vr = _real(k8[2:, :n], dk[2:]), _real(v8[2:, :n], dv[2:])
    ref = _oracle(q[2:], kr.to(BF16), vr.to(BF16), None)["pt"]["out"]
    exact = _oracle(q[2:].double(), kr.double(), vr.double(), None)["ref"]["out"]
    for scales, ok in (((dk, dv), True), ((dv, dk), False)):
        out = dispatch.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, descale_k=scales[0], descale_v=scales[1],
            version="torch",
        )  # fmt: skip
        assert compare("out", out[2:], exact, ref).ok == ok


@pytest.mark.parametrize("version", VERSIONS)
def test_fp8_cache_op_path_and_flash_attn_names(version) -> None:
    """The custom op's path (under a torch-function mode) gives the eager path's bits, and
    flash_attn_with_kvcache's k_descale / v_descale are attention_with_kvcache's descales."""
    from flashsuite.dispatch import inference

    case = CASES[1]
    gen = torch.Generator(device=DEV).manual_seed(2)
    q, k_cache, v_cache, kn, vn, dk, dv, table, *_ = _problem(case, gen)
    lens = torch.tensor(case[7], dtype=I32, device=DEV)
    results = []
    for mode in (None, _NoOpMode()):
        kc, vc = k_cache.clone(), v_cache.clone()
        inference._kv_plans.clear()
        with mode or contextlib.nullcontext():
            got = dispatch.attention_with_kvcache(
                q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, causal=True,
                return_lse=True, version=version, descale_k=dk, descale_v=dv,
            )  # fmt: skip
        results.append((*got, kc.view(torch.uint8), vc.view(torch.uint8)))
    for a, b_ in zip(*results, strict=True):
        assert torch.equal(a, b_)
    fa = dispatch.flash_attn_with_kvcache(
        q, k_cache.clone(), v_cache.clone(), kn, vn, cache_seqlens=lens, block_table=table,
        causal=True, k_descale=dk, v_descale=dv,
    )  # fmt: skip
    want = dispatch.attention_with_kvcache(
        q, k_cache.clone(), v_cache.clone(), kn, vn, cache_seqlens=lens, block_table=table,
        causal=True, descale_k=dk, descale_v=dv,
    )  # fmt: skip
    assert torch.equal(fa, want)


def test_fp8_cache_under_torch_compile_fullgraph() -> None:
    """attention_with_kvcache on a float8 cache, new tokens in q's dtype rounded inside the
    graph, compiles with fullgraph=True and gives the eager call's out and cache bytes."""
    gen = torch.Generator(device=DEV).manual_seed(8)
    q = _rand(gen, 2, 1, 4, 32, dtype=BF16)
    kc8, vc8 = (_rand(gen, 2, 32, 2, 32).to(E4M3) for _ in "kv")
    kn, vn = (_rand(gen, 2, 1, 2, 32, dtype=BF16) for _ in "kv")
    dk, dv = (0.5 + torch.rand(2, 2, generator=gen, device=DEV) for _ in "kv")
    lens = torch.tensor([3, 20], dtype=I32, device=DEV)

    def decode(q, kc, vc):
        return dispatch.attention_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=lens, causal=True, descale_k=dk, descale_v=dv
        )

    runs = []
    for fn in (decode, torch.compile(decode, fullgraph=True, backend="aot_eager")):
        kc, vc = kc8.clone(), vc8.clone()
        runs.append((fn(q, kc, vc), kc.view(torch.uint8), vc.view(torch.uint8)))
    for a, b_ in zip(*runs, strict=True):
        assert torch.equal(a, b_)
    assert not torch.equal(runs[0][1], kc8.view(torch.uint8))  # the append happened


def test_selection_on_sm90_runs_fa2_and_says_why() -> None:
    """On sm90 a float8 cache runs on fa2's decode kernel (fa3's reads 16-bit caches only) and
    explain() says so; a 16-bit cache still runs on fa3."""
    pytest.importorskip("triton")
    q = torch.empty(2, 1, 8, 128, dtype=BF16, device="meta")
    k8 = torch.empty(2, 256, 2, 128, dtype=E4M3, device="meta")
    with override_arch(90):
        choice = dispatch.select_kvcache(q, k8, k8, cache_seqlens=10)
        assert choice.version == "fa2", choice
        text = dispatch.explain_kvcache(q, k8, k8, cache_seqlens=10)
        assert "fa3: its decode kernel reads 16-bit caches only" in text
        assert "float8_e4m3fn converted as loaded" in text
        k16 = torch.empty(2, 256, 2, 128, dtype=BF16, device="meta")
        assert dispatch.select_kvcache(q, k16, k16, cache_seqlens=10).version == "fa3"
    with override_arch(80):
        text = dispatch.explain_kvcache(q, k8, k8, cache_seqlens=10, version="auto")
        assert "needs sm89+" in text


def _bad(**change):
    gen = torch.Generator(device=DEV).manual_seed(5)
    args = dict(
        q=_rand(gen, 2, 1, 4, 32, dtype=BF16),
        k_cache=_rand(gen, 2, 16, 2, 32).to(E4M3),
        v_cache=_rand(gen, 2, 16, 2, 32).to(E4M3),
        cache_seqlens=4,
        descale_k=torch.ones(2, 2, device=DEV),
        descale_v=torch.ones(2, 2, device=DEV),
        version="torch",
    )
    args.update(change)
    return args


Z = torch.zeros
FP8_ERRORS = [
    (dict(descale_k=torch.ones(2, 3)), ValueError,
     r"descale_k: expected shape \(B, Hkv\) = \(2, 2\), got \(2, 3\)"),
    (dict(descale_v=torch.ones(2, 2, dtype=torch.float64)), TypeError,
     "descale_v: expected dtype float32, got float64"),
    (dict(descale_k=[[1.0, 1.0]] * 2), TypeError, "descale_k: expected a torch.Tensor, got list"),
    (dict(v_cache=Z(2, 16, 2, 32, dtype=BF16)), TypeError,
     "v_cache: expected float8_e4m3fn .* got bfloat16"),
    (dict(k_cache=Z(2, 16, 2, 32, dtype=BF16), v_cache=Z(2, 16, 2, 32, dtype=BF16)), ValueError,
     "descale_k: descale factors are for a float8_e4m3fn cache, the cache is bfloat16"),
    (dict(q=Z(2, 1, 4, 32, dtype=F32)), TypeError,
     "q: expected float16 or bfloat16 with a float8_e4m3fn cache, got float32"),
    (dict(q=Z(2, 1, 4, 32).to(E4M3)), TypeError,
     "q: expected float16 or bfloat16 with a float8_e4m3fn cache, got float8_e4m3fn"),
    (dict(k_cache=Z(2, 16, 2, 32, dtype=E4M3, device="meta")), ValueError,
     r"k_cache: expected device \S+ \(q's\), got meta"),
    (dict(k=Z(2, 1, 2, 32, dtype=F16), v=Z(2, 1, 2, 32, dtype=F16)), TypeError,
     r"k: expected dtype float8_e4m3fn .*\(k_cache's\) or bfloat16 \(q's, quantised on the "
     r"append\), got float16"),
]  # fmt: skip


@pytest.mark.parametrize("change, exc, message", FP8_ERRORS, ids=lambda x: None)
def test_fp8_cache_bad_input_is_a_clear_error(change, exc, message) -> None:
    def here(t):  # the stated tensors on the test's device, a meta one where it stays
        return t.to(DEV) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t

    change = {name: here(t) for name, t in change.items()}
    with pytest.raises(exc, match=message):
        dispatch.attention_with_kvcache(**_bad(**change))


@pytest.mark.parametrize("version", VERSIONS)
def test_new_tokens_in_qs_dtype_are_rounded_into_the_cache(version) -> None:
    """New k, v in q's dtype are rounded to e4m3 with the cache's descales by the append:
    the same cache bytes and output as appending quantize_e4m3's result, also when only one of
    them comes in e4m3; with flash-attn's
    rotary tables, q and the new k are rotated first (the call on pre-rotated inputs gives the
    same bits); rotary tables with new k already in e4m3 are refused."""
    from flashsuite.dispatch.flash_attn import _rotate

    gen = torch.Generator(device=DEV).manual_seed(6)
    case = CASES[1]
    q, k_cache, v_cache, _, _, dk, dv, table, *_ = _problem(case, gen)
    lens = torch.tensor(case[7], dtype=I32, device=DEV)
    kn, vn = (_rand(gen, 3, 2, 2, 64, dtype=F16) for _ in "kv")
    runs = []
    k8n, v8n = quantize_e4m3(kn, dk)[0], quantize_e4m3(vn, dv)[0]
    for new in ((kn, vn), (k8n, v8n), (k8n, vn), (kn, v8n)):  # each rounded on its own
        kc, vc = k_cache.clone(), v_cache.clone()
        out = dispatch.attention_with_kvcache(
            q, kc, vc, *new, cache_seqlens=lens, block_table=table, causal=True,
            descale_k=dk, descale_v=dv, version=version,
        )  # fmt: skip
        runs.append((out, kc.view(torch.uint8), vc.view(torch.uint8)))
    for run in runs[1:]:
        for a, b_ in zip(runs[0], run, strict=True):
            assert torch.equal(a, b_)
    cos, sin = (_rand(gen, 130, 16) for _ in "cs")
    kc = k_cache.clone()
    got = dispatch.flash_attn_with_kvcache(
        q, kc, v_cache.clone(), kn, vn, cos, sin, lens, block_table=table, causal=True,
        k_descale=dk, v_descale=dv,
    )  # fmt: skip
    qr, kr = _rotate(q, kn, vn, cos, sin, lens, 128, True, True)
    want = dispatch.attention_with_kvcache(
        qr, k_cache.clone(), v_cache.clone(), kr, vn, cache_seqlens=lens, block_table=table,
        causal=True, descale_k=dk, descale_v=dv,
    )  # fmt: skip
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="rotary_cos: the new k must be in q's dtype"):
        dispatch.flash_attn_with_kvcache(
            q, kc, v_cache.clone(), kn.to(E4M3), vn.to(E4M3), cos, sin, lens,
            block_table=table, k_descale=dk, v_descale=dv,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["fa2", "auto"])
@pytest.mark.parametrize("page", [0, 64])
def test_gpu_fp8_cache_at_serving_size(version, page) -> None:
    """GQA 32/8, D 128, 4k-token rows of uneven lengths, paged or not, the heuristic's splits:
    out and LSE against the float64 oracle on the dequantised cache."""
    case = (4, 1, 1, 32, 8, 128, BF16, [4000, 17, 2500, 4094], 4096, page, 0, True, {})
    gen = torch.Generator(device=DEV).manual_seed(7)
    q, k_cache, v_cache, kn, vn, dk, dv, table, k8, v8 = _problem(case, gen)
    lens = torch.tensor(case[7], dtype=I32, device=DEV)
    out, lse = dispatch.attention_with_kvcache(
        q, k_cache, v_cache, kn, vn, cache_seqlens=lens, block_table=table, return_lse=True,
        version=version, descale_k=dk, descale_v=dv,
    )  # fmt: skip
    for row, n in enumerate(case[7]):
        ks = torch.cat([k8[row : row + 1, :n], kn[row : row + 1]], 1)
        vs = torch.cat([v8[row : row + 1, :n], vn[row : row + 1]], 1)
        kr, vr = _real(ks, dk[row : row + 1]), _real(vs, dv[row : row + 1])
        ref = _oracle(q[row : row + 1], kr.to(BF16), vr.to(BF16), None)["pt"]
        exact = _oracle(q[row : row + 1].double(), kr.double(), vr.double(), None)["ref"]
        for name, got in (("out", out), ("lse", lse)):
            c = compare(name, got[row : row + 1], exact[name], ref[name])
            assert c.ok, f"row {row}: {c}"
