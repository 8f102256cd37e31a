"""Hugging Face transformers adapter: flashsuite as an `attn_implementation`.

    name = dispatch.register_transformers()          # "fsuite"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

`register_transformers` registers an attention function with transformers'
`AttentionInterface` and its mask function with `AttentionMaskInterface` under one name.

- **The name has no "flash" in it.** transformers treats every implementation name that
  contains "flash" as a flash-attn build: it tries to import it from the flash-attn packages or
  download it as a hub kernel, and fails for any other name. Names containing "sdpa" or
  "flex_attention" get those backends' checks; a name shaped "org/repo" is a hub kernel.
- **The mask is a padding mask, not a dense one** (what transformers' flash-attention mask
  function does too): None when no token is padding, otherwise the (B, L) bool mask of the
  tokens that exist, L the number of key positions that hold tokens. Causality comes from the
  attention module (`is_causal`), never from an N x N mask.
- **Padded batches run as packed sequences.** The attention function removes the padding
  (`dispatch.attention_varlen` over the real tokens of each row, bottom-right causal on each
  row's own lengths), then scatters the output back, zeros at padding positions; without
  padding it calls `dispatch.attention` (bottom-right causal, which is what transformers means
  for a query block at the end of a KV cache). A decode step without a gradient
  (`generate()`) goes through `dispatch.attention_with_kvcache` on the cache's own storage
  (split-KV decode where the version has it): without padding, with left padding (each row's
  keys from its first token, `cache_leftpad`) and on a static cache's filled prefix.
- **Sliding windows** (Mistral, Qwen2, Gemma2 with its softcap, Gemma3, ModernBERT) reach every
  path as `window_size`. The mask function must be transformers' own
  `sliding_window_causal_mask_function(w)` or `sliding_window_bidirectional_mask_function(w)`
  with `local_size=w`, recognised from its closures; anything composed with it is refused. The
  window is the one transformers' sdpa mask draws: causal, query q sees keys q - w < kv <= q,
  `(w - 1, 0)` with w the module's `sliding_window`; bidirectional, |q - kv| <= w, `(w, w)`
  with w the module's `config.sliding_window` (the modules pass w or w + 1). A sliding cache
  that dropped its oldest tokens (`kv_offset > 0`) is attended as it lies. Packing keeps
  distances only where each row's tokens are one run (left or right padding).
- **What is refused, with an error naming it:** mask patterns other than causal, bidirectional
  and those two windows, each with padding (chunked attention, custom and/or overlays, a
  window composed with other functions, packed sequences found from position_ids, a 4-D mask),
  keys that start after position 0 outside a causal sliding-window layer, padding between the
  tokens of a row under a window, a bidirectional window on cross-attention, dropout in
  training, position biases, and returning attention probabilities.
- **Attention sinks** (gpt-oss's `s_aux`, one logit s_h per query head, a column of every row's
  softmax that is dropped from the output) go to whichever entry point runs as its `sinks`
  (`dispatch.api.with_sinks`: out * sigmoid(lse - s_h) from the LSE over the real keys, in
  float32): differentiable in q, k, v and the sinks; a row without keys gives zeros.
"""

from __future__ import annotations

import torch

from flashsuite.dispatch import registry
from flashsuite.dispatch.api import attention, check_sinks
from flashsuite.dispatch.inference import attention_varlen, attention_with_kvcache

DEFAULT_NAME = "fsuite"
# Substrings that make transformers route a name to a backend of its own (see the module doc).
_RESERVED = ("flash", "sdpa", "flex_attention", "paged|")
_SUPPORTED = (
    "causal or bidirectional attention (also cross-attention) with padding, and "
    "transformers' own causal or bidirectional sliding window alone"
)


def register_transformers(version: str = "auto", name: str = DEFAULT_NAME) -> str:
    """Register flashsuite's attention and mask functions with transformers under `name` and
    return it, the value to pass as `attn_implementation` (`from_pretrained`, `from_config`,
    `model.set_attn_implementation`). `version` is passed to every dispatch call ("auto" or
    a version name; an explicit version never falls back). Registering again replaces the
    functions under that name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "register_transformers needs the transformers package: pip install flashsuite[hf]"
        ) from exc
    if version != "auto":
        registry.check_name(version)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    bad = [s for s in _RESERVED if s in name] + (["/"] if "/" in name else [])
    if bad or name == "eager":
        raise ValueError(
            f"name: transformers gives names containing {(*_RESERVED, '/')} (and 'eager') "
            f"a meaning of their own; expected a name without them, got {name!r}"
        )

    def attention(module, query, key, value, attention_mask, **kw):
        return attention_forward(module, query, key, value, attention_mask, version=version, **kw)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask function registered with `AttentionMaskInterface`.

    Causal (self-attention): queries sit at positions q_offset .. q_offset + q_length - 1 and
    are the last tokens seen; key slot s holds position kv_offset + s (kv_offset > 0 only on a
    sliding-window cache that dropped its oldest tokens), so the slots that hold tokens are the
    first L = q_offset + q_length - kv_offset of the kv_length (all of them for a dynamic
    cache, a prefix of a static one). Bidirectional (an encoder, or cross-attention to one):
    L = kv_length, the queries may be another sequence. Returns None when every one of the L
    tokens is real and L == kv_length, otherwise the (B, L) bool mask of real tokens
    (`attention_mask` is the (B, >= kv_offset + L) 2-D padding mask transformers passes,
    1 = token, read from column kv_offset on). A sliding window's mask is the same: the window
    reaches the attention function through the module (see `_window`).
    """
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    local_size = kwargs.get("local_size")
    window = None
    if mask_function in (causal_mask_function, bidirectional_mask_function):
        if local_size is not None:  # a window passed beside a plain function
            raise NotImplementedError(
                "flashsuite's transformers attention: a local_size beside a plain causal or "
                f"bidirectional mask function is not supported (local_size={local_size})"
            )
        causal = mask_function is causal_mask_function
    elif (window := _sliding_window_of(mask_function, local_size)) is not None:
        causal = window[0] == "causal"
    else:
        raise NotImplementedError(
            "flashsuite's transformers attention: this model builds a mask that it "
            f"cannot express (supported: {_SUPPORTED}; got the mask function "
            f"{getattr(mask_function, '__qualname__', mask_function)!r}, e.g. a sliding window "
            "combined with another mask, chunked attention, an overlay, or packed sequences "
            "found from position_ids); use attn_implementation='sdpa' for this model"
        )
    sliding_cache = window is not None and causal
    if kv_offset != 0 and not (sliding_cache and isinstance(kv_offset, int) and kv_offset > 0):
        raise NotImplementedError(
            "kv_offset: expected 0 (keys from position 0, a dynamic or static cache) or, on a "
            f"causal sliding-window layer, a position > 0; got {kv_offset}"
        )
    kv_offset = int(kv_offset)
    seen = kv_length  # key slots that hold tokens
    if causal:
        seen = int(q_offset) + q_length - kv_offset
        if not q_length <= seen <= kv_length:
            raise ValueError(
                f"q_offset + q_length - kv_offset: expected between q_length = {q_length} and "
                f"kv_length = {kv_length}, got {seen}"
            )
    device = kwargs.get("device", "cpu")
    if attention_mask is None:
        if seen == kv_length:
            return None
        return torch.ones(batch_size, seen, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask: expected the 2-D (batch, tokens) padding mask, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(dtype=torch.bool)
    end = kv_offset + seen
    if mask.shape[1] < end:  # as transformers pads it: positions past the mask are no token
        mask = torch.nn.functional.pad(mask, (0, end - mask.shape[1]))
    mask = mask[:, kv_offset:end]
    if seen == kv_length and bool(mask.all()):
        return None
    return mask


def _sliding_window_of(mask_function, local_size) -> tuple[str, int] | None:
    """("causal", w) when `mask_function` is transformers' sliding_window_causal_mask_function(w),
    ("bidirectional", w) for sliding_window_bidirectional_mask_function(w), with w == local_size;
    None for anything else, a composition with other functions included. Read from the
    closures: and_masks' tuple of exactly the overlay's inner function and the base function."""
    from transformers import masking_utils as mu

    and_code = mu.and_masks(mu.causal_mask_function).__code__
    if getattr(mask_function, "__code__", None) is not and_code:
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    overlay, base = parts
    kinds = (
        ("causal", "sliding_window_overlay", mu.causal_mask_function),
        ("bidirectional", "sliding_window_bidirectional_overlay", mu.bidirectional_mask_function),
    )
    for kind, overlay_name, base_function in kinds:
        make_overlay = getattr(mu, overlay_name, None)
        if base is not base_function or make_overlay is None:
            continue
        if getattr(overlay, "__code__", None) is make_overlay(1).__code__:
            size = _closure(overlay).get("sliding_window")
            if type(size) is int and size >= 1 and size == local_size:
                return kind, size
    return None


def _closure(function) -> dict:
    """A nested function's free variables by name ({} when it has none)."""
    cells = getattr(function, "__closure__", None) or ()
    names = function.__code__.co_freevars
    try:
        return {name: cell.cell_contents for name, cell in zip(names, cells, strict=True)}
    except ValueError:  # an empty cell, or a closure that does not match the code
        return {}


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    version: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with `AttentionInterface`.

    query (B, Hq, Nq, D), key (B, Hkv, Nk, D), value (B, Hkv, Nk, Dv) as transformers passes
    them (after the cache update: keys of the past tokens first, the queries' own last);
    `attention_mask` is what `padding_mask` returned; `s_aux` (Hq,) the attention sinks' logits
    or None (`dispatch.api.with_sinks`). Returns (out (B, Nq, Hq, Dv), None).
    """
    _refuse_unsupported(module, dropout, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and getattr(getattr(module, "config", None), "is_causal", True) is False:
        raise NotImplementedError(
            "config.is_causal: False makes a causal module attend both ways through its mask; "
            "flashsuite takes causality from the module: set module.is_causal instead"
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, N, H, D) views
    if s_aux is not None:
        check_sinks(s_aux, q, "s_aux")
    nq, nk = q.shape[1], k.shape[1]
    options = dict(
        causal=causal,
        softmax_scale=scaling,
        window_size=_window(module, causal, sliding_window, nq, nk),
        softcap=float(softcap) if softcap else 0.0,
        version=version,
    )
    if s_aux is not None:  # every entry point applies them (dispatch.api.with_sinks)
        options["sinks"] = s_aux
    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, options)
    else:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if nq < nk and causal and not needs_grad:
            # A decode or chunked-prefill step: the cache is already appended, so attend its Nk
            # tokens (bottom-right causal), through the KV-cache entry point.
            out = attention_with_kvcache(q, k, v, cache_seqlens=nk, **options)
        else:
            out = attention(q, k, v, **options)
    return out, None


def _window(module, causal: bool, sliding_window, nq: int, nk: int) -> tuple[int, int]:
    """`window_size` for the module's `sliding_window` (None on a full-attention layer), drawn
    as transformers' sdpa mask draws it: causal, query q sees keys q - w < kv <= q, so
    (w - 1, 0) with w the module's value; bidirectional, |q - kv| <= w with w the config's
    `sliding_window` (the value the mask reads; modules pass w or w + 1), so (w, w), on
    self-attention only. (-1, -1) where the window cannot bite (w >= Nk)."""
    if sliding_window is None:
        return (-1, -1)
    if not causal:
        sliding_window = getattr(getattr(module, "config", None), "sliding_window", None)
    if type(sliding_window) is not int or sliding_window < 1:
        where = "sliding_window" if causal else "module.config.sliding_window"
        raise ValueError(f"{where}: expected an int >= 1, got {sliding_window!r}")
    if not causal and nq != nk:
        raise NotImplementedError(
            f"sliding_window: a bidirectional window needs self-attention (Nq == Nk), got "
            f"Nq = {nq}, Nk = {nk}"
        )
    if sliding_window >= nk:
        return (-1, -1)
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def _refuse_unsupported(module, dropout, kwargs) -> None:
    if dropout and module.training:
        raise ValueError(
            f"dropout: flashsuite has no attention dropout; expected 0.0, got {dropout} "
            "(set config.attention_dropout = 0.0)"
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions: flashsuite never forms the attention probabilities; "
            "use attn_implementation='eager' to get them"
        )
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("position_bias: not supported by flashsuite's attention")


def _padded(q, k, v, mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention over the real tokens of each row: mask (B, L) marks them among the first L key
    slots. Causal: the queries are the last Nq of those slots, and padding queries get zeros.
    Not causal: every query attends to the real keys (the queries may be another sequence, as
    in cross-attention); under a window the queries are the L tokens themselves, and padding
    queries get zeros. A window needs each row's tokens in one run (left or right padding):
    packing keeps distances only then. Output (B, Nq, Hq, Dv)."""
    b, nq, hq, _ = q.shape
    if mask.dim() != 2 or mask.shape[0] != b or mask.dtype != torch.bool:
        raise ValueError(
            f"attention_mask: expected the (batch={b}, tokens) bool mask of the registered mask "
            f"function, got {mask.dtype} of shape {tuple(mask.shape)}"
        )
    seen = mask.shape[1]
    low = nq if options["causal"] else 1
    if not low <= seen <= k.shape[1]:
        raise ValueError(
            f"attention_mask: expected between {low} and Nk = {k.shape[1]} token slots, got {seen}"
        )
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if options["causal"] and nq < seen and not needs_grad:
        left, pads = _left_padding(mask, nq)
        if left:
            # A decode (or chunk) step of a left-padded batch, or of a static cache's filled
            # prefix: the cache itself, each row from its first token (cache_leftpad).
            return attention_with_kvcache(
                q, k, v, cache_seqlens=seen, cache_leftpad=pads, **options
            )
    windowed = options["window_size"] != (-1, -1)
    if options["causal"]:
        q_mask = mask[:, seen - nq :]  # (B, Nq)
    elif windowed:  # self-attention: the queries are the keys' own tokens
        if seen != nq:
            raise ValueError(
                f"attention_mask: a bidirectional window expected Nq = {nq} token slots, got {seen}"
            )
        q_mask = mask
    else:
        q_mask = torch.ones(b, nq, dtype=torch.bool, device=mask.device)  # (B, Nq)
    lens = torch.stack([q_mask.sum(1), mask.sum(1)]).to(torch.int32)  # (2, B): q, k lengths
    cu = torch.nn.functional.pad(lens.cumsum(1, dtype=torch.int32), (1, 0))  # (2, B + 1)
    stats = lens.amax(1)  # (2,): max_q, max_k
    if windowed:  # and the number of rows whose tokens are not one run, in the same read
        starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0))  # (B, L): a run begins
        stats = torch.cat([stats, (starts.sum(1) > 1).sum(0, keepdim=True).to(stats.dtype)])
    max_q, max_k, *split_rows = (int(x) for x in stats.tolist())
    if split_rows and split_rows[0]:
        raise NotImplementedError(
            f"attention_mask: {split_rows[0]} row(s) have padding between their tokens; under a "
            "sliding window, packing would bring those tokens closer than their positions "
            "(supported: each row's tokens in one run, left or right padding)"
        )
    if max_q == 0:  # every query is padding
        return q.new_zeros(b, nq, hq, v.shape[-1])
    out = attention_varlen(
        q[q_mask],  # (total_q, Hq, D)
        k[:, :seen][mask],  # (total_k, Hkv, D)
        v[:, :seen][mask],
        cu[0],
        cu[1],
        max_q,
        max(max_k, 1),  # a row of padding only has no key
        **options,
    )  # (total_q, Hq, Dv)
    full = out.new_zeros(b, nq, hq, out.shape[-1])
    return full.index_put((q_mask,), out)  # (B, Nq, Hq, Dv)


def _left_padding(mask: torch.Tensor, nq: int) -> tuple[bool, torch.Tensor | None]:
    """Whether the padding of every row of `mask` (B, L) comes before its tokens and leaves
    its last nq slots (the queries) real, and then each row's padding as int32 (B,), or None
    where no row has any: one device-to-host read."""
    seen = mask.shape[1]
    pads = (~mask).sum(1, dtype=torch.int32)  # (B,)
    slots = torch.arange(seen, device=mask.device)
    left = (mask == (slots[None, :] >= pads[:, None])).all() & (pads <= seen - nq).all()
    left, padded = torch.stack([left, pads.any()]).tolist()
    return bool(left), (pads if padded else None)
