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
- **What is refused, with an error naming it:** a mask pattern other than causal or
  bidirectional with padding (sliding windows, chunked attention, custom and/or overlays,
  packed sequences found from position_ids, a 4-D mask), caches whose keys start after
  position 0 (sliding-window caches), dropout in training, attention sinks, position biases,
  and returning attention probabilities.
"""

from __future__ import annotations

import torch

from flashsuite.dispatch import registry
from flashsuite.dispatch.api import attention
from flashsuite.dispatch.inference import attention_varlen, attention_with_kvcache

DEFAULT_NAME = "fsuite"
# Substrings that make transformers route a name to a backend of its own (see the module doc).
_RESERVED = ("flash", "sdpa", "flex_attention", "paged|")
_SUPPORTED = "causal or bidirectional attention (also cross-attention) with padding"


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
    are the last tokens seen, so the keys that hold tokens are the first
    L = q_offset + q_length of the kv_length slots (all of them for a dynamic cache, a prefix of
    a static one). Bidirectional (an encoder, or cross-attention to one): L = kv_length, the
    queries may be another sequence. Returns None when every one of the L tokens is real and
    L == kv_length, otherwise the (B, L) bool mask of real tokens (`attention_mask` is the
    (B, >= L) 2-D padding mask transformers passes, 1 = token).
    """
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        raise NotImplementedError(
            "flashsuite's transformers attention: this model builds a mask that it "
            f"cannot express (supported: {_SUPPORTED}; got the mask function "
            f"{getattr(mask_function, '__qualname__', mask_function)!r}, e.g. a sliding window, "
            "chunked attention, an overlay, or packed sequences found from position_ids); "
            "use attn_implementation='sdpa' for this model"
        )
    if kwargs.get("local_size") is not None:  # a sliding window passed beside a plain function
        raise NotImplementedError(
            "flashsuite's transformers attention: sliding-window masks are not supported "
            f"(local_size={kwargs['local_size']})"
        )
    if kv_offset != 0:
        raise NotImplementedError(
            f"kv_offset: expected 0 (keys from position 0, a dynamic or static cache), got "
            f"{kv_offset} (a sliding-window cache)"
        )
    # Key slots that hold tokens.
    seen = int(q_offset) + q_length if mask_function is causal_mask_function else kv_length
    if seen > kv_length:
        raise ValueError(
            f"q_offset + q_length: expected at most kv_length = {kv_length}, got {seen}"
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
    if mask.shape[1] < seen:  # as transformers pads it: positions past the mask are no token
        mask = torch.nn.functional.pad(mask, (0, seen - mask.shape[1]))
    mask = mask[:, :seen]
    if seen == kv_length and bool(mask.all()):
        return None
    return mask


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
    version: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with `AttentionInterface`.

    query (B, Hq, Nq, D), key (B, Hkv, Nk, D), value (B, Hkv, Nk, Dv) as transformers passes
    them (after the cache update: keys of the past tokens first, the queries' own last);
    `attention_mask` is what `padding_mask` returned. Returns (out (B, Nq, Hq, Dv), None).
    """
    _refuse_unsupported(module, dropout, sliding_window, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and getattr(getattr(module, "config", None), "is_causal", True) is False:
        raise NotImplementedError(
            "config.is_causal: False makes a causal module attend both ways through its mask; "
            "flashsuite takes causality from the module: set module.is_causal instead"
        )
    options = dict(
        causal=causal,
        softmax_scale=scaling,
        softcap=float(softcap) if softcap else 0.0,
        version=version,
    )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, N, H, D) views
    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, options), None
    nq, nk = q.shape[1], k.shape[1]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if nq < nk and causal and not needs_grad:
        # A decode or chunked-prefill step: the cache is already appended, so attend its Nk
        # tokens (bottom-right causal), through the KV-cache entry point.
        out = attention_with_kvcache(q, k, v, cache_seqlens=nk, **options)
    else:
        out = attention(q, k, v, **options)
    return out, None


def _refuse_unsupported(module, dropout, sliding_window, kwargs) -> None:
    if dropout and module.training:
        raise ValueError(
            f"dropout: flashsuite has no attention dropout; expected 0.0, got {dropout} "
            "(set config.attention_dropout = 0.0)"
        )
    if sliding_window is not None:
        raise NotImplementedError(
            f"sliding_window: not supported by the transformers adapter, got {sliding_window}"
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions: flashsuite never forms the attention probabilities; "
            "use attn_implementation='eager' to get them"
        )
    for arg in ("s_aux", "position_bias"):
        if kwargs.get(arg) is not None:
            raise NotImplementedError(f"{arg}: not supported by flashsuite's attention")


def _padded(q, k, v, mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention over the real tokens of each row: mask (B, L) marks them among the first L key
    slots. Causal: the queries are the last Nq of those slots, and padding queries get zeros.
    Not causal: every query attends to the real keys (the queries may be another sequence, as
    in cross-attention). Output (B, Nq, Hq, Dv)."""
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
    if options["causal"]:
        q_mask = mask[:, seen - nq :]  # (B, Nq)
    else:
        q_mask = torch.ones(b, nq, dtype=torch.bool, device=mask.device)  # (B, Nq)
    lens = torch.stack([q_mask.sum(1), mask.sum(1)]).to(torch.int32)  # (2, B): q, k lengths
    cu = torch.nn.functional.pad(lens.cumsum(1, dtype=torch.int32), (1, 0))  # (2, B + 1)
    max_q, max_k = (int(x) for x in lens.amax(1).tolist())
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
