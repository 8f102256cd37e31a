"""torch.compile with dynamic shapes and torch.export over a model that calls
dispatch.attention: selection is decided at trace time on static facts only (dtype, head dims,
options, architecture), so new batch sizes and sequence lengths run the same graph, and
changed options are what recompiles. The Triton versions run under the interpreter on a CPU.
(The custom ops themselves pass torch.library.opcheck in tests/test_attention.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.testing import CompileCounterWithBackend
from torch.export import Dim

from flashsuite import dispatch
from flashsuite.common.arch import override_arch
from flashsuite.common.testing import compare, reference_pair
from flashsuite.dispatch import registry
from tests.conftest import HAS_CUDA, must_run

# A head_dim and dtype every version takes: fa3 (on an sm90 GPU only) wants 16-bit inputs and
# head_dim >= 64; on a CPU the Triton interpreter runs float32 and the smallest fa2 tile.
HEAD_DIM = 64 if HAS_CUDA else 32
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32


class TinyAttention(torch.nn.Module):
    """x (B, N, dim) -> (B, N, dim): projections around one dispatch.attention call, GQA."""

    def __init__(self, version: str, heads: int = 4, kv_heads: int = 2, **options) -> None:
        super().__init__()
        self.version, self.heads, self.kv_heads, self.options = version, heads, kv_heads, options
        dim = heads * HEAD_DIM
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * HEAD_DIM)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM, self.kv_heads * HEAD_DIM], dim=-1
        )
        q = q.view(b, n, self.heads, HEAD_DIM)  # (B, N, Hq, D)
        k = k.view(b, n, self.kv_heads, HEAD_DIM)  # (B, N, Hkv, D)
        v = v.view(b, n, self.kv_heads, HEAD_DIM)
        out = dispatch.attention(q, k, v, version=self.version, **self.options)
        return self.proj(out.reshape(b, n, -1))


def _require(version: str) -> None:
    ok, reason = registry.available(version)
    if not ok and not must_run(version):
        pytest.skip(f"{version} unavailable: {reason}")


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the gradients of the parameters and of x for a fixed loss."""
    x = x.detach().requires_grad_(True)
    out = model(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    return out.detach(), list(grads)


# (B, N): lengths and batches of 1 included (dynamo specialises sizes 0 and 1 unless
# backed_size_oblivious is set; the test sets it, as a model serving any length would).
SIZES = [(2, 16), (3, 40), (1, 1), (5, 7), (1, 64), (4, 1)]
if not HAS_CUDA:  # the Triton interpreter: ~5 ms per block step
    SIZES = [(2, 16), (3, 24), (1, 1), (2, 7), (1, 33), (3, 1)]


@pytest.mark.parametrize("version", ["torch", "fa2", "fa1", "fa3"])
def test_dynamic_compile_never_recompiles_for_new_sizes(version: str, device: str) -> None:
    """fullgraph, dynamic=True: one graph for every (batch, length), forward and backward
    equal to eager."""
    _require(version)
    torch.manual_seed(0)
    model = TinyAttention(version, causal=True).to(device, DTYPE)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    torch._dynamo.reset()
    frames = []
    with fx_config.patch(backed_size_oblivious=True):
        for b, n in SIZES:
            x = torch.randn(b, n, model.heads * HEAD_DIM, device=device, dtype=DTYPE)
            got, got_grads = _step(compiled, x)
            want, want_grads = _step(model, x)
            torch.testing.assert_close(got, want)
            for g, w in zip(got_grads, want_grads, strict=True):
                torch.testing.assert_close(g, w)
            frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], f"recompiled: frames per call {frames}"


def test_changed_options_recompile_and_lengths_do_not() -> None:
    """What selection depends on is guarded: a new softcap compiles a second graph, a new
    length does not, and the first softcap's graph is reused."""
    torch.manual_seed(0)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(
        lambda q, k, v, cap: dispatch.attention(q, k, v, softcap=cap, version="torch"),
        fullgraph=True,
        dynamic=True,
        backend=counter,
    )
    frames = []
    for n, cap in [(16, 5.0), (24, 5.0), (16, 7.0), (40, 7.0), (33, 5.0)]:
        q, k, v = (torch.randn(3, n, 2, HEAD_DIM) for _ in range(3))
        out = fn(q, k, v, cap)
        torch.testing.assert_close(out, dispatch.attention(q, k, v, softcap=cap, version="torch"))
        frames.append(counter.frame_count)
    assert frames[1] == frames[0] and frames[2] > frames[1], frames
    assert frames[4] == frames[3] == frames[2], frames


@pytest.mark.parametrize("version", ["torch", "fa2", "fa3"])
def test_export_with_dynamic_batch_and_length(version: str, device: str) -> None:
    """torch.export with Dims for batch and length: the graph holds the version's op and the
    exported program runs other sizes, matching eager."""
    _require(version)
    torch.manual_seed(0)
    model = TinyAttention(version, causal=True).to(device, DTYPE).eval()
    x = torch.randn(2, 24, model.heads * HEAD_DIM, device=device, dtype=DTYPE)
    shapes = {"x": {0: Dim("batch", max=64), 1: Dim("seqlen", max=16384)}}
    exported = torch.export.export(model, (x,), dynamic_shapes=shapes)
    assert f"flashsuite.{version}_fwd" in exported.graph_module.code
    for b, n in [(3, 40), (1, 7), (4, 1)]:
        x = torch.randn(b, n, model.heads * HEAD_DIM, device=device, dtype=DTYPE)
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(x), model(x))


def test_sdpa_route_under_compile_and_export(device: str) -> None:
    """Where no kernel fits on a GPU (planned for sm90 here: head_dim 80), the traced graph
    calls PyTorch's SDPA, bottom-right causal with Nq < Nk through a boolean mask (the
    `causal_lower_right` bias of the eager path cannot be built under torch.compile)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, n, h, 80, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
        for n, h in ((24, 4), (40, 2), (40, 2))
    )
    do = torch.randn(2, 24, 4, 80, generator=gen).to(device, torch.bfloat16)
    fn = lambda q, k, v: dispatch.attention(q, k, v, causal=True)
    torch._dynamo.reset()
    with override_arch(90):
        assert dispatch.select(q, k, v, causal=True).version == "sdpa"
        eager = fn(q, k, v)
        got = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")(q, k, v)
        grads = torch.autograd.grad(got, (q, k, v), do)

        class Attn(torch.nn.Module):
            def forward(self, q, k, v):
                return fn(q, k, v)

        args = (q.detach(), k.detach(), v.detach())
        graph = torch.export.export(Attn(), args).graph_module.code
        assert "scaled_dot_product_attention" in graph and "flashsuite" not in graph
    pairs = reference_pair(q, k, v, grad_out=do, causal=True)
    for name, ours in zip(("out", "out", "dq", "dk", "dv"), (eager, got, *grads), strict=True):
        res = compare(name, ours, *pairs[name])
        assert res.ok, res


@pytest.mark.parametrize("version", ["torch", "fa2"])
def test_opcheck_inference_ops(version: str, device: str) -> None:
    """torch.library.opcheck on the varlen forward and backward ops and the KV-cache op (which
    mutates the cache) of every version that has them: schema, fake implementation, autograd
    registration, AOT dispatch."""
    from flashsuite.dispatch import inference

    _require(version)
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, DTYPE)
    cu = torch.tensor([0, 5, 17, 26], dtype=torch.int32, device=device)
    q, k, v = rand(26, 4, HEAD_DIM), rand(26, 2, HEAD_DIM), rand(26, 2, HEAD_DIM)
    scalars = (12, 12, True, HEAD_DIM**-0.5, -1, 0, 0.0)
    varlen = inference._op("varlen", version)
    torch.library.opcheck(varlen.fwd, (q.requires_grad_(), k, v, cu, cu, *scalars))
    out, lse = varlen.fwd(q.detach(), k, v, cu, cu, *scalars)
    torch.library.opcheck(varlen.bwd, (rand(26, 4, HEAD_DIM), q.detach(), k, v, out, lse, cu, cu,
                                       *scalars))  # fmt: skip
    kvcache = inference._op("kvcache", version)
    caches = rand(3, 32, 2, HEAD_DIM), rand(3, 32, 2, HEAD_DIM)
    new = rand(3, 2, 2, HEAD_DIM), rand(3, 2, 2, HEAD_DIM)
    lens = torch.tensor([0, 7, 30], dtype=torch.int32, device=device)
    args = (rand(3, 2, 4, HEAD_DIM), *caches, *new, lens, None, True, HEAD_DIM**-0.5, -1, 0, 0.0, 0)
    torch.library.opcheck(kvcache, args)


def test_explicit_version_that_cannot_run_raises_under_compile() -> None:
    """An explicit version never falls back under torch.compile either: without fullgraph the
    compiled call raises dispatch.Unsupported itself, with fullgraph dynamo's error carries
    its message."""
    q = torch.randn(2, 16, 2, 64)
    call = lambda q: dispatch.attention(q, q, q, version="fa1", softcap=3.0)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(call, fullgraph=fullgraph, backend="eager")
        with pytest.raises(Exception, match=r"version 'fa1' cannot run .*softcap") as info:
            compiled(q)
        assert isinstance(info.value, dispatch.Unsupported) != fullgraph, type(info.value)


@pytest.mark.parametrize("forced", [None, "torch"])
def test_sdpa_drop_in_under_compile(forced: str | None, monkeypatch) -> None:
    """dispatch.sdpa traced with dynamic shapes: PyTorch's SDPA where auto would pick no
    kernel (a CPU), the version's op where FLASHSUITE_VERSION forces one; no recompiles for
    new lengths either way, results equal to the eager call."""
    if forced is None:
        monkeypatch.delenv("FLASHSUITE_VERSION", raising=False)
    else:
        monkeypatch.setenv("FLASHSUITE_VERSION", forced)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = lambda q, k, v: dispatch.sdpa(q, k, v, is_causal=True)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for n in (16, 24, 40):
        q, k, v = (torch.randn(2, 4, n, HEAD_DIM) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v))
        frames.append(counter.frame_count)
    assert frames[-1] == frames[0], frames
    graph = "\n".join(g.code for g in counter.graphs)
    assert ("flashsuite.torch_fwd" in graph) == (forced is not None), graph
    assert ("scaled_dot_product_attention" in graph) == (forced is None), graph
