"""The transformers adapter (`dispatch.register_transformers`) on tiny models built from configs
(random weights, nothing downloaded), against transformers' own "sdpa": Llama, sliding-window
models (Mistral, every layer windowed; Gemma2, a windowed and a full layer with the attention
softcap; Gemma3; Qwen2; a ModernBERT encoder's two-sided window), gpt-oss (attention sinks,
a windowed and a full layer, experts), BERT and BART.

Logits and gradients follow the suite's comparison rule (`common.testing.compare`): the
reference is the same model in float64 under "sdpa", the yardstick the float32 model under
"sdpa", and ours the float32 model under flashsuite (the `torch` version, so the test is the
same on every machine). sdpa has no softcap, so Gemma2's yardstick is its float32 "eager" and
its reference eager's arithmetic in float64 on transformers' own sdpa mask (`_exact_attention`).
gpt-oss has no sdpa: its reference and yardstick are its own "eager" (softmax over the scores
and the sink's column, in the inputs' dtype) in float64 and float32.
Padding positions carry no meaning (no loss, no token reads them) and are left out. Each test
also counts which dispatch entry point ran, so a path that silently stopped being taken fails.
"""

from __future__ import annotations

import collections
import copy
import functools
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashsuite import dispatch  # noqa: E402
from flashsuite.common.testing import compare  # noqa: E402
from flashsuite.dispatch import hf  # noqa: E402

VOCAB, PAD = 101, 0
WINDOW = 4  # below the 11 tokens of a row, so the window bites on the prompt
EXACT = "exact64"  # the float64 reference where sdpa cannot run (Gemma2's softcap)
SDPA = ("sdpa", "sdpa")
# family: (config class, model class, config overrides, implementations of the float64
# reference and the float32 yardstick)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}, SDPA),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=WINDOW),
        SDPA,
    ),
    "gemma2": (  # attn_logit_softcapping 50 and query_pre_attn_scalar 256, their defaults
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            sliding_window=WINDOW, head_dim=16, layer_types=["sliding_attention", "full_attention"]
        ),
        (EXACT, "eager"),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            sliding_window=WINDOW, head_dim=16, layer_types=["sliding_attention", "full_attention"]
        ),
        SDPA,
    ),
    "qwen2": (  # layer 0 full, layer 1 windowed
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
        SDPA,
    ),
    # Attention sinks (s_aux); layer 0 windowed, layer 1 full; no sdpa: eager in float64 is
    # the reference (its softmax runs in the inputs' dtype). The experts' loop, not grouped_mm
    # (no float64 on a CPU).
    "gpt_oss": (
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation="eager",
        ),
        ("eager", "eager"),
    ),
}


def _config(family: str = "llama", **overrides):
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.5,  # peaked attention, so a wrong mask shows in the logits
        attention_dropout=0.0,
    )
    config_cls, _, family_overrides, _ = FAMILIES[family]
    cfg.update(family_overrides)
    cfg.update(overrides)
    return config_cls(**cfg)


def _sliding_layers(config) -> int:
    """Layers that attend through a sliding window (Mistral's config has no layer_types)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return config.num_hidden_layers if getattr(config, "sliding_window", None) else 0
    return list(layer_types).count("sliding_attention")


def _exact_attention(module, query, key, value, attention_mask, scaling, softcap=None, **kw):
    """transformers' eager arithmetic (softcap included) in the inputs' dtype throughout, on
    transformers' own sdpa mask; a row that sees no key gives zeros. transformers' eager takes
    the softmax in float32, where a float64 mask's minimum turns into -inf: NaN rows."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    s = query @ key.transpose(-1, -2) * scaling  # (B, H, Nq, Nk)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    seen = attention_mask.any(-1, keepdim=True)  # (B, 1, Nq, 1): rows with a key
    p = torch.softmax(s.masked_fill(~attention_mask, float("-inf")).masked_fill(~seen, 0), -1)
    return ((p * seen) @ value).transpose(1, 2), None


def _exact_mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False  # always the dense (B, 1, Nq, Nk) bool mask
    return sdpa_mask(*args, **kwargs)


@functools.cache
def _family(family: str):
    """(float64 reference, float32 yardstick, float32 flashsuite), the same weights."""
    from transformers.masking_utils import AttentionMaskInterface

    _, cls, _, impls = FAMILIES[family]
    if impls[0] == EXACT:
        transformers.AttentionInterface.register(EXACT, _exact_attention)
        AttentionMaskInterface.register(EXACT, _exact_mask)
    trio = _trio(cls, _config(family), seed=0, impls=impls)
    if family == "gpt_oss":  # sinks of std 1 (the init's is 0.5): a sink dropped shows
        gen = torch.Generator().manual_seed(1)
        heads = trio[0].config.num_attention_heads
        sinks = [torch.randn(heads, generator=gen) for _ in trio[0].model.layers]
        with torch.no_grad():
            for model in trio:
                for layer, value in zip(model.model.layers, sinks, strict=True):
                    layer.self_attn.sinks.copy_(value)
    return trio


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2", "gemma3", "gpt_oss"])
def models(request):
    """(reference, yardstick, flashsuite) of one family (see the module doc)."""
    ours = _family(request.param)[2]
    assert ours.config._attn_implementation == "fsuite"
    return _family(request.param)


@pytest.fixture
def calls(monkeypatch):
    """How often each dispatch entry point ran inside the adapter."""
    counts: collections.Counter = collections.Counter()
    for fn in ("attention", "attention_varlen", "attention_with_kvcache"):
        real = getattr(hf, fn)

        def counted(*args, _real=real, _fn=fn, **kwargs):
            counts[_fn] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(hf, fn, counted)
    return counts


def _batch(padding: str, seed: int = 0, pads: tuple[int, int] = (3, 7)):
    """input_ids (3, 11) and attention_mask: row 0 full, rows 1 and 2 padded on `padding`
    (`pads` tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    for row, n_pad in zip((1, 2), pads, strict=True):
        pads = slice(0, n_pad) if padding == "left" else slice(11 - n_pad, 11)
        mask[row, pads] = 0
        ids[row, pads] = PAD
    return ids, mask


def _assert_close(name: str, ours, ref, pt) -> None:
    c = compare(name, ours, ref, pt)
    assert c.ok, str(c)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_match_sdpa(models, calls, padding: str) -> None:
    ours_m = models[2]
    ids, mask = _batch("left" if padding == "none" else padding)
    if padding == "none":
        mask = torch.ones_like(mask)
    with torch.no_grad():
        ref, pt, ours = (m(input_ids=ids, attention_mask=mask).logits for m in models)
    real = mask.bool()  # (B, N): logits at padding positions mean nothing
    _assert_close("logits", ours[real], ref[real], pt[real])
    layers = ours_m.config.num_hidden_layers
    expected = "attention" if padding == "none" else "attention_varlen"
    assert calls == {expected: layers}
    # A mask pattern that had been ignored (padding keys attended) would be far off.
    assert (ours[real] - ref[real].float()).abs().max() < 1e-3 * ref[real].abs().max()


@pytest.mark.parametrize("padding", ["none", "right"])
def test_one_training_step_matches_sdpa(models, calls, padding: str) -> None:
    ids, mask = _batch("right")
    if padding == "none":
        mask = torch.ones_like(mask)
    labels = ids.masked_fill(mask == 0, -100)
    grads, sink_grads, losses, after = [], [], [], []
    for model in models:
        trained = type(model)(model.config)  # a copy: the module-scoped models stay untouched
        trained.load_state_dict(model.state_dict())
        trained.to(next(model.parameters()).dtype).train()
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        loss = trained(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        missing = [n for n, p in trained.named_parameters() if p.grad is None]
        assert not missing, f"no gradient reached {missing}"
        losses.append(loss.detach().reshape(1))
        grads.append(torch.cat([p.grad.flatten() for p in trained.parameters()]))
        sinks = [p.grad for n, p in trained.named_parameters() if n.endswith(".sinks")]
        sink_grads.append(torch.cat(sinks) if sinks else None)
        opt.step()
        with torch.no_grad():
            after.append(trained(input_ids=ids, attention_mask=mask).logits[mask.bool()])
    ref, pt, ours = grads
    assert ours.abs().max() > 0
    _assert_close("loss", losses[2], losses[0], losses[1])
    _assert_close("grads", ours, ref, pt)
    if sink_grads[0] is not None:  # gpt-oss: the sinks' own, a few among many
        assert sink_grads[2].abs().max() > 0
        _assert_close("sinks' grads", sink_grads[2], sink_grads[0], sink_grads[1])
    _assert_close("logits after one step", after[2], after[0], after[1])
    kind = "attention" if padding == "none" else "attention_varlen"
    assert calls[kind] == 2 * models[2].config.num_hidden_layers  # forward, then after the step


@pytest.mark.parametrize("cache", ["own", "full"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_generate_greedy_same_tokens_as_sdpa(models, calls, padding: str, cache: str) -> None:
    """cache "own": the model's, whose sliding layers drop the tokens that left the window (the
    mask's kv_offset > 0); "full": a DynamicCache() built without the config keeps every token,
    so the window bites on each decode step's keys. Row 2's 9 padding tokens outlast the
    first tokens a sliding cache drops, so its first decode steps see padding on the left."""
    _, pt_m, ours_m = models
    ids, mask = _batch("left", seed=3, pads=(3, 9))
    if padding == "none":
        ids, mask = ids[:1], mask[:1]
    new = 8

    def gen(model):
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        if cache == "full":
            kw["past_key_values"] = transformers.DynamicCache()
        return model.generate(input_ids=ids, attention_mask=mask, **kw)

    expected, got = gen(pt_m), gen(ours_m)
    assert got.shape == (ids.shape[0], ids.shape[1] + new)
    assert torch.equal(got, expected), f"reference {expected[:, -new:]}\nours {got[:, -new:]}"
    layers = ours_m.config.num_hidden_layers
    if padding == "none":  # the prompt densely, then one KV-cache decode per new token
        assert calls == {"attention": layers, "attention_with_kvcache": (new - 1) * layers}
    else:  # the prompt packed, then each decode on the cache, rows from their first token
        assert calls == {"attention_varlen": layers, "attention_with_kvcache": (new - 1) * layers}


def test_static_cache_generate(models, calls) -> None:
    _, pt_m, ours_m = models
    ids, mask = _batch("left", seed=5)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation="static")
    expected = pt_m.generate(input_ids=ids[:1], attention_mask=mask[:1], **kw)
    got = ours_m.generate(input_ids=ids[:1], attention_mask=mask[:1], **kw)
    assert torch.equal(got, expected)
    # The static cache (11 + 5 slots) has empty slots until the last step: the prompt runs
    # packed on the slots that hold tokens, each decode step on the cache with cache_seqlens
    # the filled prefix (the last step fills it). A sliding layer's static cache holds the
    # window (4 slots): the prompt attends its own 11 keys (dense, no mask), then each step
    # rolls the cache (kv_offset > 0) and attends its 4 full slots.
    layers, sliding = ours_m.config.num_hidden_layers, _sliding_layers(ours_m.config)
    assert calls == collections.Counter(
        attention=sliding, attention_varlen=layers - sliding, attention_with_kvcache=4 * layers
    )


def _trio(cls, cfg, seed: int = 1, impls: tuple[str, str] = ("sdpa", "sdpa")):
    """The model under (float64 impls[0], float32 impls[1], float32 flashsuite), the same
    weights."""
    name = dispatch.register_transformers(version="torch")
    torch.manual_seed(seed)
    # A config of its own per model: _from_config records the implementation in it.
    ref, pt, ours = (
        cls._from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype)
        for impl, dtype in (
            (impls[0], torch.float64),
            (impls[1], torch.float32),
            (name, torch.float32),
        )
    )
    state = {k: t.float() for k, t in ref.state_dict().items()}
    pt.load_state_dict(state)
    ours.load_state_dict(state)
    return ref, pt, ours


def test_encoder_and_cross_attention_match_sdpa(calls) -> None:
    """Bidirectional attention: a BERT encoder, and a BART encoder-decoder whose decoder
    attends (cross-attention) to a right-padded encoder output of another length."""
    ids, mask = _batch("right")
    real = mask.bool()
    bert = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, initializer_range=0.5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    with torch.no_grad():
        ref, pt, ours = (
            m(input_ids=ids, attention_mask=mask).last_hidden_state[real]
            for m in _trio(transformers.BertModel, bert)
        )
    _assert_close("bert hidden states", ours, ref, pt)
    assert calls == {"attention_varlen": 2}
    calls.clear()

    bart = transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, init_std=0.5, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=64,
    )  # fmt: skip
    models = _trio(transformers.BartForConditionalGeneration, bart)
    decoder_ids = torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, pt, ours = (
            m(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
            for m in models
        )
    _assert_close("bart logits", ours, ref, pt)
    # encoder self-attention and cross-attention packed, decoder self-attention dense
    assert calls == {"attention_varlen": 2, "attention": 1}
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5)
    assert torch.equal(models[2].generate(**kw), models[1].generate(**kw))


def test_padding_mask_function() -> None:
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    kw = dict(batch_size=2, mask_function=causal_mask_function, device="cpu")
    full = torch.ones(2, 6, dtype=torch.long)
    assert hf.padding_mask(q_length=6, kv_length=6, attention_mask=full, **kw) is None
    assert hf.padding_mask(q_length=1, kv_length=6, q_offset=5, attention_mask=None, **kw) is None
    left = full.clone()
    left[1, :2] = 0
    got = hf.padding_mask(q_length=1, kv_length=6, q_offset=5, attention_mask=left, **kw)
    assert torch.equal(got, left.bool())
    # A static cache of 10 slots holding 6 tokens: the mask covers the 6.
    got = hf.padding_mask(q_length=1, kv_length=10, q_offset=5, attention_mask=full, **kw)
    assert got.shape == (2, 6) and bool(got.all())
    got = hf.padding_mask(q_length=1, kv_length=10, q_offset=torch.tensor(5), **kw)
    assert got.shape == (2, 6) and bool(got.all())

    # A sliding layer's cache that dropped positions 0-7: slot s holds position 8 + s, so the
    # mask is read from column 8 on, padded on the right where it is short (no token there).
    kw = dict(kw, mask_function=sliding_window_causal_mask_function(4), local_size=4)
    step = dict(q_length=1, kv_length=4, q_offset=11, kv_offset=8)
    left = torch.ones(2, 12, dtype=torch.long)
    left[1, :10] = 0
    assert torch.equal(hf.padding_mask(attention_mask=left, **step, **kw), left[:, 8:].bool())
    assert hf.padding_mask(attention_mask=torch.ones_like(left), **step, **kw) is None
    got = hf.padding_mask(attention_mask=left[:, :11], **step, **kw)
    assert torch.equal(got, torch.tensor([[True, True, True, False], [False, False, True, False]]))
    # A static sliding layer (4 slots) holding 2 tokens: the mask covers the 2.
    got = hf.padding_mask(q_length=1, kv_length=4, q_offset=1, **kw)
    assert got.shape == (2, 2) and bool(got.all())


@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
def test_padding_mask_and_window_draw_the_sdpa_mask(kind: str) -> None:
    """padding_mask's key slots with attention_forward's window_size, read as the dispatch
    entry points read them (queries bottom-right aligned on the slots), allow the same (query,
    key) pairs as transformers' own sdpa mask, at the sizes its sliding caches ask for: a
    prompt, a decode step and a chunk on a cache that dropped old tokens, a static sliding
    cache not yet full."""
    from transformers import masking_utils as mu

    w, n = 3, 12
    tokens = torch.ones(3, n, dtype=torch.long)
    tokens[1, :8] = 0  # left padding, into the slots a sliding cache keeps
    tokens[2, 7:] = 0  # right padding
    if kind == "causal":
        function = mu.sliding_window_causal_mask_function(w)
        sizes = [(9, 9, 0, 0), (1, w, 9, 9 - w + 1), (3, w + 2, 9, 9 - w + 1), (1, w, 1, 0)]
        module, module_window = None, w
    else:  # ModernBERT's way: the mask reads config.sliding_window, the module passes it + 1
        function = mu.sliding_window_bidirectional_mask_function(w)
        sizes = [(n, n, 0, 0), (w, w, 0, 0)]
        module = types.SimpleNamespace(config=types.SimpleNamespace(sliding_window=w))
        module_window = w + 1
    for q_length, kv_length, q_offset, kv_offset in sizes:
        args = dict(
            batch_size=3, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=function, local_size=w,
            attention_mask=tokens[:, : q_offset + q_length],
        )  # fmt: skip
        want = mu.sdpa_mask(**args, allow_is_causal_skip=False)[:, 0]  # (B, Nq, Nk)
        slots = hf.padding_mask(**args)  # (B, L) or None: all kv_length slots hold tokens
        if slots is None:
            slots = torch.ones(3, kv_length, dtype=torch.bool)
        seen = slots.shape[1]
        left, right = hf._window(module, kind == "causal", module_window, q_length, kv_length)
        i = torch.arange(q_length)[:, None] + seen - q_length  # (Nq, 1): each query's slot
        j = torch.arange(kv_length)[None, :]  # (1, Nk)
        pairs = j <= i if kind == "causal" else torch.ones_like(j == i)
        if left >= 0:
            pairs = pairs & (j >= i - left) & (j <= i + right)
        keys = torch.nn.functional.pad(slots, (0, kv_length - seen))  # (B, Nk)
        got = pairs[None] & keys[:, None, :]  # (B, Nq, Nk)
        assert torch.equal(got, want), (q_length, kv_length, q_offset, kv_offset)


@pytest.mark.parametrize("window", [(-1, -1), (2, 0)], ids=["full", "window"])
def test_decode_step_with_left_padding_reads_the_cache(calls, window) -> None:
    """A decode step (one query a row, no gradient) whose mask pads rows on the left only runs
    on the cache with cache_leftpad; a mask with padding between tokens takes the packed path;
    both give each row's attention over its real keys (the torch version, float64 oracle).
    Under a window, packing would bring a split row's tokens closer: refused."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 1, 4, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(3, 8, 2, 16, generator=gen, dtype=torch.float64) for _ in "kv")
    left = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    hole = left.clone()
    hole[0, 2] = False
    assert hf._left_padding(left, 1)[0] and torch.equal(
        hf._left_padding(left, 1)[1], torch.tensor([0, 2, 5], dtype=torch.int32)
    )
    assert hf._left_padding(torch.ones(3, 6, dtype=torch.bool), 1) == (True, None)
    assert not hf._left_padding(hole, 1)[0] and not hf._left_padding(left, 2)[0]
    options = dict(causal=True, softmax_scale=None, window_size=window, softcap=0.0,
                   version="torch")  # fmt: skip
    for mask, path in ((left, "attention_with_kvcache"), (hole, "attention_varlen")):
        calls.clear()
        if mask is hole and window != (-1, -1):
            split = r"attention_mask: 1 row\(s\) have padding between their tokens"
            with torch.no_grad(), pytest.raises(NotImplementedError, match=split):
                hf._padded(q, k, v, mask, options)
            with pytest.raises(NotImplementedError, match=split):  # a training step
                hf._padded(q.clone().requires_grad_(), k, v, mask, options)
            continue
        with torch.no_grad():
            out = hf._padded(q, k, v, mask, options)
        assert calls == {path: 1}, calls
        for b in range(3):
            keep = mask[b].nonzero().flatten()
            want = dispatch.attention(q[b : b + 1], k[b : b + 1, keep], v[b : b + 1, keep],
                                      causal=True, window_size=window, version="torch")  # fmt: skip
            torch.testing.assert_close(out[b : b + 1], want)


@pytest.mark.parametrize(
    "wrong", ["window+1", "window-1", "no-window", "no-softcap", "no-sinks", "sink-sign"]
)
def test_a_wrong_window_or_softcap_fails_the_comparison(monkeypatch, wrong: str) -> None:
    """The models and batches above tell a window off by one either way, a window ignored, a
    softcap ignored, gpt-oss's sinks ignored and a sink of the wrong sign (sigmoid(lse + s))
    from the right ones: the comparison fails by far on each."""
    family = {"no-softcap": "gemma2", "no-sinks": "gpt_oss", "sink-sign": "gpt_oss"}
    models = _family(family.get(wrong, "mistral"))
    if wrong in ("no-sinks", "sink-sign"):
        from flashsuite.dispatch import api

        real_sinks = api.with_sinks
        if wrong == "no-sinks":
            monkeypatch.setattr(api, "with_sinks", lambda out, lse, s, r=False: real_sinks(
                out, lse, s.new_full(s.shape, -torch.inf), r))  # fmt: skip
        else:
            monkeypatch.setattr(
                api, "with_sinks", lambda out, lse, s, r=False: real_sinks(out, lse, -s, r)
            )
    elif wrong == "no-softcap":
        real_varlen = hf.attention_varlen
        monkeypatch.setattr(
            hf, "attention_varlen", lambda *a, **kw: real_varlen(*a, **dict(kw, softcap=0.0))
        )
    else:
        real_window = hf._window

        def window(*args):
            left, right = real_window(*args)
            assert left >= 0  # Mistral: every layer windowed, 4 < 11 tokens
            shift = {"window+1": 1, "window-1": -1}.get(wrong)
            return (-1, -1) if shift is None else (left + shift, right)

        monkeypatch.setattr(hf, "_window", window)
    ids, mask = _batch("left")
    real = mask.bool()
    with torch.no_grad():
        ref, pt, ours = (m(input_ids=ids, attention_mask=mask).logits[real] for m in models)
    c = compare("logits", ours, ref, pt)
    assert not c.ok and c.err > 100 * c.bound, str(c)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_bidirectional_window_encoder_matches_sdpa(calls, padding: str) -> None:
    """ModernBERT: a windowed layer (|q - kv| <= config.sliding_window = local_attention // 2 =
    2; the module passes 3, flash-attn's convention) and a full one."""
    cfg = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, local_attention=4, initializer_range=0.5,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=PAD, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2, attention_dropout=0.0,
        embedding_dropout=0.0, mlp_dropout=0.0,
    )  # fmt: skip
    models = _trio(transformers.ModernBertModel, cfg)
    ids, mask = _batch("left" if padding == "none" else padding)
    if padding == "none":
        mask = torch.ones_like(mask)
    real = mask.bool()
    with torch.no_grad():
        ref, pt, ours = (
            m(input_ids=ids, attention_mask=mask).last_hidden_state[real] for m in models
        )
    _assert_close("modernbert hidden states", ours, ref, pt)
    assert calls == {"attention" if padding == "none" else "attention_varlen": 2}


def test_qwen2_windows_its_upper_layers(calls) -> None:
    """Qwen2 windows the layers from max_window_layers on (here layer 1; layer 0 is full)."""
    ref, pt, ours = _family("qwen2")
    ids, mask = _batch("left")
    real = mask.bool()
    with torch.no_grad():
        logits = [m(input_ids=ids, attention_mask=mask).logits[real] for m in (ref, pt, ours)]
    _assert_close("qwen2 logits", logits[2], logits[0], logits[1])
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    ids, mask = _batch("left", seed=3)
    expected = pt.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(ours.generate(input_ids=ids, attention_mask=mask, **kw), expected)
    assert calls == {"attention_varlen": 4, "attention_with_kvcache": 14}


def test_refusals_name_the_problem() -> None:
    from transformers import masking_utils as mu

    with pytest.raises(ValueError, match=r"name: .*got 'flashsuite'"):
        dispatch.register_transformers(name="flashsuite")  # transformers would load flash-attn
    with pytest.raises(ValueError, match=r"name: .*got 'org/kernel'"):
        dispatch.register_transformers(name="org/kernel")
    with pytest.raises(ValueError, match=r"version: expected one of"):
        dispatch.register_transformers(version="fa9")
    causal, sliding = mu.causal_mask_function, mu.sliding_window_causal_mask_function(4)

    def extra(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx >= 0

    # Only transformers' own sliding functions, as create_*_mask passes them, are windows.
    for function, local_size in (
        (mu.and_masks(causal, causal), None),
        (mu.and_masks(sliding, extra), 4),  # an and_mask_function on top
        (mu.or_masks(sliding, extra), 4),  # an or_mask_function on top
        (mu.and_masks(mu.sliding_window_overlay(4), causal, extra), 4),
        (mu.and_masks(causal, mu.sliding_window_overlay(4)), 4),  # not the function's order
        (mu.and_masks(mu.sliding_window_overlay(4), mu.bidirectional_mask_function), 4),
        (sliding, 5),  # local_size is not the closure's window
        (sliding, None),
        (mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)), 4),
        (
            mu.packed_sequence_compatibility_function(sliding, torch.zeros(2, 4), torch.ones(2, 4)),
            4,
        ),
    ):
        with pytest.raises(NotImplementedError, match="cannot express"):
            hf.padding_mask(2, 4, 4, mask_function=function, local_size=local_size)
    with pytest.raises(NotImplementedError, match=r"local_size beside a plain .* \(local_size=4\)"):
        hf.padding_mask(2, 4, 4, mask_function=causal, local_size=4)
    with pytest.raises(NotImplementedError, match=r"kv_offset: expected 0 .*got 3"):
        hf.padding_mask(2, 1, 4, q_offset=6, kv_offset=3, mask_function=causal)
    bidirectional = mu.sliding_window_bidirectional_mask_function(4)
    with pytest.raises(NotImplementedError, match=r"kv_offset: expected 0 .*got 3"):
        hf.padding_mask(2, 4, 4, kv_offset=3, mask_function=bidirectional, local_size=4)

    ours = _family("llama")[2]
    ids, mask = _batch("left")
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions"):
        ours(input_ids=ids, attention_mask=mask, output_attentions=True)
    attn = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 3, 16)
    attn.train()
    try:
        with pytest.raises(ValueError, match=r"dropout: .* got 0.1"):
            hf.attention_forward(attn, q, kv, kv, None, dropout=0.1)
    finally:
        attn.eval()
    with pytest.raises(ValueError, match=r"sliding_window: expected an int >= 1, got 0"):
        hf.attention_forward(attn, q, kv, kv, None, sliding_window=0)
    # A two-sided window is the config's (Llama's has none), on self-attention only.
    with pytest.raises(ValueError, match=r"module.config.sliding_window: .* got None"):
        hf.attention_forward(attn, q, kv, kv, None, is_causal=False, sliding_window=4)
    with pytest.raises(ValueError, match=r"attention_mask: expected the \(batch=1, tokens\)"):
        hf.attention_forward(attn, q, kv, kv, torch.zeros(1, 1, 3, 3))

    split = _batch("left")[1]
    split[0, 5] = 0  # padding between the tokens of row 0
    with torch.no_grad(), pytest.raises(NotImplementedError, match="attention_mask: 1 row"):
        _family("mistral")[2](input_ids=ids, attention_mask=split)


def test_sinks_are_checked_and_match_a_softmax_with_their_column() -> None:
    """s_aux must be a floating (Hq,) tensor on the query's device. A padded batch with sinks
    (the packed call's, scattered back) is a softmax over [scores, s] with the sink's column
    dropped, values and gradients (q, k, v and the sinks) against that formula in float64; a
    row without keys (row 1: every query padding) gives zeros and zero gradients."""
    attn = _family("gpt_oss")[2].model.layers[1].self_attn
    q, kv = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    for s_aux, got in (
        (torch.zeros(3), r"float32 of shape \(3,\) on cpu"),
        (torch.zeros(1, 4), r"float32 of shape \(1, 4\) on cpu"),
        (torch.zeros(4, dtype=torch.long), r"int64 of shape \(4,\) on cpu"),
        (torch.zeros(4, device="meta"), r"float32 of shape \(4,\) on meta"),
        ([0.0] * 4, "list"),
    ):
        expected = r"s_aux: expected .* floating tensor of shape \(4,\) .* on cpu, got "
        with pytest.raises(ValueError, match=expected + got + "$"):
            hf.attention_forward(attn, q, kv, kv, None, s_aux=s_aux)
    with pytest.raises(NotImplementedError, match="position_bias"):
        hf.attention_forward(attn, q, kv, kv, None, position_bias=torch.zeros(1))

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 3, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 2, 16, generator=gen, dtype=torch.float64) for _ in "kv")
    k.requires_grad_(), v.requires_grad_()
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 3, [False] * 3])
    options = dict(causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   version="torch", sinks=sinks)  # fmt: skip
    got = hf._padded(q, k, v, mask, options)  # (2, 3, 4, 16)
    assert got.dtype == q.dtype and not got[1].any()
    scores = torch.einsum("qhd,khd->hqk", q[0], k[0].repeat_interleave(2, 1)) / 4
    scores = scores.masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(torch.cat([scores, sinks[:, None, None].expand(4, 3, 1)], -1), -1)
    want = torch.einsum("hqk,khd->qhd", p[..., :-1], v[0].repeat_interleave(2, 1))
    torch.testing.assert_close(got[0], want)
    weights = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v, sinks), allow_unused=True)
    assert grads[3] is not None, "no gradient reached the sinks"
    wants = torch.autograd.grad((want * weights[0]).sum(), (q, k, v, sinks))  # 0 on row 1
    for grad, w in zip(grads, wants, strict=True):
        torch.testing.assert_close(grad, w)


def test_composed_sliding_masks_are_refused() -> None:
    """Gemma3 attending both ways (use_bidirectional_attention) or-s an overlay onto its
    masks: refused by name, not run with a one-sided window."""
    name = dispatch.register_transformers(version="torch")
    cfg = _config("gemma3", use_bidirectional_attention=True)
    model = transformers.Gemma3ForCausalLM._from_config(cfg, attn_implementation=name)
    ids, mask = _batch("left")
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"cannot express .*or_mask"):
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_oss"])
def test_gpu_bf16_with_the_auto_versions(calls, family: str) -> None:
    """On a GPU, bf16, version "auto" (sm90: fa3 for the dense calls, fa2 for the packed and
    KV-cache ones), head_dim 64: logits and one step's gradients by the comparison rule, and
    greedy tokens that are the exact model's best up to bf16's error; Llama, Mistral with
    every layer windowed (4 of the 11 tokens), and gpt-oss (sinks, a windowed and a full layer;
    "eager" for the reference and the yardstick, as it has no sdpa)."""
    name = dispatch.register_transformers(name="fsuite-auto")
    cfg = _config(
        family, hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64
    )
    cls, theirs = FAMILIES[family][1], FAMILIES[family][3][1]
    torch.manual_seed(0)
    ref, pt, ours = (
        cls._from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype).cuda()
        for impl, dtype in (
            (theirs, torch.float64),
            (theirs, torch.bfloat16),
            (name, torch.bfloat16),
        )
    )
    state = {k: t.bfloat16() for k, t in ref.state_dict().items()}
    pt.load_state_dict(state)
    ours.load_state_dict(state)
    ref.load_state_dict(state)  # the same (bf16-representable) weights, in float64
    layers = cfg.num_hidden_layers
    for padding in ("none", "left", "right"):
        ids, mask = (t.cuda() for t in _batch("left" if padding == "none" else padding))
        if padding == "none":
            mask = torch.ones_like(mask)
        real = mask.bool()
        with torch.no_grad():
            logits = [m(input_ids=ids, attention_mask=mask).logits[real] for m in (ref, pt, ours)]
        _assert_close(f"logits ({padding} padding)", logits[2], logits[0], logits[1])
    assert calls == {"attention": layers, "attention_varlen": 2 * layers}

    ids, mask = (t.cuda() for t in _batch("right"))
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (ref, pt, ours):
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        model.zero_grad()
    _assert_close("grads", grads[2], grads[0], grads[1])

    new = 6
    for padding in ("none", "left"):
        ids, mask = (t.cuda() for t in _batch("left", seed=3))
        if padding == "none":
            ids, mask = ids[:1], mask[:1]
        out = ours.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
            do_sample=False,
        )  # fmt: skip
        full = torch.cat([mask, torch.ones_like(mask[:, :new])], dim=1)
        with torch.no_grad():
            exact = ref(input_ids=out, attention_mask=full).logits  # (B, N + new, V)
            approx = pt(input_ids=out, attention_mask=full).logits
        err = (approx.double() - exact).abs()[full.bool()].max().item()  # bf16's own error
        steps = exact[:, ids.shape[1] - 1 : -1]  # the logits each new token was chosen from
        chosen = steps.gather(-1, out[:, ids.shape[1] :, None]).squeeze(-1)
        gap = steps.amax(-1) - chosen  # 0 where the exact model agrees
        assert gap.max().item() <= 6 * err + 1e-6, (gap, err)
