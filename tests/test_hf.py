"""The transformers adapter (`dispatch.register_transformers`) on a tiny Llama-style model built
from a config (random weights, nothing downloaded), against transformers' own "sdpa".

Logits and gradients follow the suite's comparison rule (`common.testing.compare`): the
reference is the same model in float64 under "sdpa", the yardstick the float32 model under
"sdpa", and ours the float32 model under flashsuite (the `torch` version, so the test is the
same on every machine). Padding positions carry no meaning (no loss, no token reads them) and
are left out. Each test also counts which dispatch entry point ran, so a path that silently
stopped being taken fails.
"""

from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashsuite import dispatch  # noqa: E402
from flashsuite.common.testing import compare  # noqa: E402
from flashsuite.dispatch import hf  # noqa: E402

VOCAB, PAD = 101, 0


def _config(**overrides):
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
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)


@pytest.fixture(scope="module")
def models():
    """(float64 sdpa, float32 sdpa, float32 flashsuite), the same weights."""
    name = dispatch.register_transformers(version="torch")
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM
    ref = cls._from_config(_config(), attn_implementation="sdpa", dtype=torch.float64)
    pt = cls._from_config(_config(), attn_implementation="sdpa", dtype=torch.float32)
    ours = cls._from_config(_config(), attn_implementation=name, dtype=torch.float32)
    state = {k: t.float() for k, t in ref.state_dict().items()}
    pt.load_state_dict(state)
    ours.load_state_dict(state)
    assert ours.config._attn_implementation == name == "fsuite"
    return ref, pt, ours


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


def _batch(padding: str, seed: int = 0):
    """input_ids (3, 11) and attention_mask: row 0 full, rows 1 and 2 padded on `padding`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    for row, n_pad in ((1, 3), (2, 7)):
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
    grads, losses, after = [], [], []
    for model in models:
        trained = type(model)(model.config)  # a copy: the module-scoped models stay untouched
        trained.load_state_dict(model.state_dict())
        trained.to(next(model.parameters()).dtype).train()
        opt = torch.optim.SGD(trained.parameters(), lr=0.1)
        loss = trained(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach().reshape(1))
        grads.append(torch.cat([p.grad.flatten() for p in trained.parameters()]))
        opt.step()
        with torch.no_grad():
            after.append(trained(input_ids=ids, attention_mask=mask).logits[mask.bool()])
    ref, pt, ours = grads
    assert ours.abs().max() > 0
    _assert_close("loss", losses[2], losses[0], losses[1])
    _assert_close("grads", ours, ref, pt)
    _assert_close("logits after one step", after[2], after[0], after[1])
    kind = "attention" if padding == "none" else "attention_varlen"
    assert calls[kind] == 2 * models[2].config.num_hidden_layers  # forward, then after the step


@pytest.mark.parametrize("padding", ["none", "left"])
def test_generate_greedy_same_tokens_as_sdpa(models, calls, padding: str) -> None:
    _, pt_m, ours_m = models
    ids, mask = _batch("left", seed=3)
    if padding == "none":
        ids, mask = ids[:1], mask[:1]
    new = 8
    gen = functools.partial(
        lambda m: m.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
            min_new_tokens=new,
        )
    )  # fmt: skip
    expected, got = gen(pt_m), gen(ours_m)
    assert got.shape == (ids.shape[0], ids.shape[1] + new)
    assert torch.equal(got, expected), f"sdpa {expected[:, -new:]}\nours {got[:, -new:]}"
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
    # the filled prefix (the last step fills it).
    layers = ours_m.config.num_hidden_layers
    assert calls == {"attention_varlen": layers, "attention_with_kvcache": 4 * layers}


def _trio(cls, cfg):
    """The model under (float64 sdpa, float32 sdpa, float32 flashsuite), the same weights."""
    name = dispatch.register_transformers(version="torch")
    torch.manual_seed(1)
    # A config of its own per model: _from_config records the implementation in it.
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float64)
    pt = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float32)
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation=name, dtype=torch.float32)
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
    from transformers.masking_utils import causal_mask_function

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


def test_decode_step_with_left_padding_reads_the_cache(calls) -> None:
    """A decode step (one query a row, no gradient) whose mask pads rows on the left only runs
    on the cache with cache_leftpad; a mask with padding between tokens takes the packed path;
    both give each row's attention over its real keys (the torch version, float64 oracle)."""
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
    options = dict(causal=True, softmax_scale=None, softcap=0.0, version="torch")
    for mask, path in ((left, "attention_with_kvcache"), (hole, "attention_varlen")):
        calls.clear()
        with torch.no_grad():
            out = hf._padded(q, k, v, mask, options)
        assert calls == {path: 1}, calls
        for b in range(3):
            keep = mask[b].nonzero().flatten()
            want = dispatch.attention(q[b : b + 1], k[b : b + 1, keep], v[b : b + 1, keep],
                                      causal=True, version="torch")  # fmt: skip
            torch.testing.assert_close(out[b : b + 1], want)


def test_refusals_name_the_problem(models) -> None:
    from transformers.masking_utils import and_masks, causal_mask_function

    with pytest.raises(ValueError, match=r"name: .*got 'flashsuite'"):
        dispatch.register_transformers(name="flashsuite")  # transformers would load flash-attn
    with pytest.raises(ValueError, match=r"name: .*got 'org/kernel'"):
        dispatch.register_transformers(name="org/kernel")
    with pytest.raises(ValueError, match=r"version: expected one of"):
        dispatch.register_transformers(version="fa9")
    with pytest.raises(NotImplementedError, match="cannot express"):
        hf.padding_mask(
            2, 4, 4, mask_function=and_masks(causal_mask_function, causal_mask_function)
        )
    with pytest.raises(NotImplementedError, match=r"kv_offset: expected 0 .*got 3"):
        hf.padding_mask(2, 1, 4, q_offset=6, kv_offset=3, mask_function=causal_mask_function)
    ours = models[2]
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
    with pytest.raises(NotImplementedError, match=r"sliding_window: .* got 4"):
        hf.attention_forward(attn, q, kv, kv, None, sliding_window=4)
    with pytest.raises(ValueError, match=r"attention_mask: expected the \(batch=1, tokens\)"):
        hf.attention_forward(attn, q, kv, kv, torch.zeros(1, 1, 3, 3))


def test_sliding_window_model_is_refused() -> None:
    name = dispatch.register_transformers(version="torch")
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
    )  # fmt: skip
    model = transformers.MistralForCausalLM._from_config(cfg, attn_implementation=name)
    ids, mask = _batch("left")
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"cannot express|sliding"):
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.gpu
def test_gpu_bf16_with_the_auto_versions(calls) -> None:
    """On a GPU, bf16, version "auto" (sm90: fa3 for the dense calls, fa2 for the packed and
    KV-cache ones), head_dim 64: logits and one step's gradients by the comparison rule, and
    greedy tokens that are the exact model's best up to bf16's error."""
    name = dispatch.register_transformers(name="fsuite-auto")
    cfg = _config(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    ref, pt, ours = (
        cls._from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype).cuda()
        for impl, dtype in (
            ("sdpa", torch.float64),
            ("sdpa", torch.bfloat16),
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
