"""Mutation check: does the test suite catch deliberate, small bugs in the kernels?

Each mutant is one exact source-text replacement (the pattern must occur exactly once, so a
refactor that moves the code makes the mutant fail loudly instead of silently testing
nothing). For each mutant the script copies the repository to a temporary directory, applies
the replacement there, and runs a short, targeted pytest selection (with -x) against the copy;
the copy's package is what gets imported (checked: flashsuite's modules must load from the
copy). A mutant is killed when a test fails; the table says which one.

    python scripts/mutants.py                 # the CPU part: torch, fa1, fa2 (interpreter)
    python scripts/mutants.py --gpu           # fa3 and the fp8 path (on an sm90 GPU)
    python scripts/mutants.py --only fa2      # names containing "fa2"
    python scripts/mutants.py --out FILE.md   # also write the table as markdown
    python scripts/mutants.py --gpu --jobs 6  # six mutants at a time, each in its own copy

Exit status: 0 when every selected mutant is killed, 1 when one survives, 2 when a pattern no
longer matches or a selection runs no test. docs/testing.md lists the mutants and the result.
common/reference.py (the oracle) is never mutated.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "dispatch", "fa1", "fa2", "fa3")  # flashsuite.<name> lives in <name>/
ATT = "tests/test_attention.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    select: str  # pytest -k expression
    files: tuple[str, ...] = (ATT,)
    gpu: bool = False


def _fwd(version: str, extra: str = "") -> str:
    return f"test_forward_and_lse and {version}" + (f" and {extra}" if extra else "")


def _bwd(version: str, extra: str = "") -> str:
    return f"test_backward and {version}" + (f" and {extra}" if extra else "")


T, F1 = "dispatch/portable.py", "fa1/kernels.py"
F2F, F2B, F2I = "fa2/fwd_kernels.py", "fa2/bwd_kernels.py", "fa2/interface.py"

MUTANTS = [
    # --- torch (dispatch/portable.py) ------------------------------------------------------
    Mutant(
        "torch fwd: out x1.01",
        T,
        "out[:, rows] = o.reshape(",
        "out[:, rows] = 1.01 * o.reshape(",
        _fwd("torch", "bfloat16"),
    ),
    Mutant(
        "torch fwd: LSE + 0.01",
        T,
        "lse[:, :, rows] = chunk_lse.reshape(p.batch, p.heads_q, -1).float()",
        "lse[:, :, rows] = chunk_lse.reshape(p.batch, p.heads_q, -1).float() + 0.01",
        _fwd("torch", "bfloat16"),
    ),
    Mutant(
        "torch fwd: LSE in base 2",
        T,
        "m + torch.log(den)).squeeze(-1)",
        "(m + torch.log(den)) * 1.4426950408889634).squeeze(-1)",
        _fwd("torch", "bfloat16"),
    ),
    Mutant(
        "torch fwd: no max subtraction",
        T,
        "e = torch.exp(s - m)",
        "e = torch.exp(s)",
        _fwd("torch", "x12"),
    ),
    Mutant(
        "torch fwd+bwd: causal top-left",
        T,
        "diag = i + p.shift",
        "diag = i",
        _fwd("torch", "causal"),
    ),
    Mutant(
        "torch fwd+bwd: GQA head off by one",
        T,
        "    return t.unsqueeze(2)",
        "    return t.roll(1, dims=1).unsqueeze(2)",
        _fwd("torch", "h4-2"),
    ),
    Mutant(
        "torch fwd+bwd: softcap ignored",
        T,
        "    if p.softcap > 0:\n        tanh = ",
        "    if False:\n        tanh = ",
        _fwd("torch", "cap"),
    ),
    Mutant(
        "torch fwd+bwd: window off by one",
        T,
        "visible &= j >= diag - p.window_left",
        "visible &= j >= diag - p.window_left - 1",
        _fwd("torch", "win"),
    ),
    Mutant(
        "torch bwd: dq x1.01",
        T,
        "dq[:, rows] = dqc.reshape(",
        "dq[:, rows] = 1.01 * dqc.reshape(",
        _bwd("torch", "float32"),
    ),
    Mutant(
        "torch bwd: dk x1.01",
        T,
        "dk = dk.squeeze(2).transpose(1, 2).to(k.dtype)",
        "dk = (1.01 * dk).squeeze(2).transpose(1, 2).to(k.dtype)",
        _bwd("torch", "float32"),
    ),
    Mutant(
        "torch bwd: dv x1.01",
        T,
        "dv = dv.squeeze(2).transpose(1, 2).to(v.dtype)",
        "dv = (1.01 * dv).squeeze(2).transpose(1, 2).to(v.dtype)",
        _bwd("torch", "float32"),
    ),
    Mutant(
        "torch bwd: saved LSE read in base 2",
        T,
        "lse_safe = torch.where(torch.isinf(lse), torch.inf, lse).to(dt)",
        "lse_safe = torch.where(torch.isinf(lse), torch.inf, lse * 1.4426950408889634).to(dt)",
        _bwd("torch", "float16"),
    ),
    Mutant(
        "torch fp8: descale (b, h) read from (h, b)",
        T,
        "dequantised(k, descale_k), ",
        "dequantised(k, descale_k.reshape(descale_k.shape[1], descale_k.shape[0]).t()), ",
        "fp8 and torch",
        ("tests/test_fp8.py",),
    ),
    # --- fa1 (fa1/kernels.py) --------------------------------------------------------------
    Mutant(
        "fa1 fwd: out x1.01",
        F1,
        "tl.store(out_ptrs, o_new.to(out_base.dtype.element_ty), mask=o_mask)",
        "tl.store(out_ptrs, (o_new * 1.01).to(out_base.dtype.element_ty), mask=o_mask)",
        _fwd("fa1", "bfloat16"),
    ),
    Mutant(
        "fa1 fwd: LSE + 0.01",
        F1,
        "tl.store(lse_base + row0 + offs_m, lse, mask=row_ok)",
        "tl.store(lse_base + row0 + offs_m, lse + 0.01, mask=row_ok)",
        _fwd("fa1", "bfloat16"),
    ),
    Mutant(
        "fa1 fwd: LSE in base 2",
        F1,
        "(m_new + tl.log2(l_safe)) * LN2,",
        "(m_new + tl.log2(l_safe)),",
        _fwd("fa1", "bfloat16"),
    ),
    Mutant(
        "fa1 fwd: running-max rescale dropped",
        F1,
        "o_new = o_i * (l_i * alpha * inv_l)[:, None]",
        "o_new = o_i * (l_i * inv_l)[:, None]",
        _fwd("fa1"),
    ),
    Mutant(
        "fa1 fwd (split K/V): second-half rescale dropped",
        F1,
        "o_new = o_new * beta[:, None]",
        "o_new = o_new",
        "test_tma_path_matches_oracle",
        ("tests/test_fa1_tma.py",),
    ),
    Mutant(
        "fa1 fwd: causal top-left",
        F1,
        "    l_base = L + pid.to(tl.int64) * n_q  # (Nq,)\n    shift = n_k - n_q",
        "    l_base = L + pid.to(tl.int64) * n_q  # (Nq,)\n    shift = 0 * (n_k - n_q)",
        _fwd("fa1", "causal"),
    ),
    Mutant(
        "fa1 fwd: GQA head off by one",
        F1,
        "    hk = h // group\n",
        "    hk = (h // group + 1) % (heads_q // group)\n",
        _fwd("fa1", "h4-2"),
    ),
    Mutant(
        "fa1 bwd: causal top-left",
        F1,
        "    dv_base = DV + b64 * stride_dvb + hk64 * stride_dvh\n    shift = n_k - n_q",
        "    dv_base = DV + b64 * stride_dvb + hk64 * stride_dvh\n    shift = 0 * (n_k - n_q)",
        _bwd("fa1", "causal"),
    ),
    Mutant(
        "fa1 bwd: GQA head off by one",
        F1,
        "pid_bh = b64 * heads_q + hk64 * group + g\n            h64 = hk64 * group + g\n",
        "h64 = (hk64 * group + g + 1) % heads_q\n            pid_bh = b64 * heads_q + h64\n",
        _bwd("fa1", "h4-2"),
    ),
    Mutant(
        "fa1 bwd: saved LSE read in base 2",
        F1,
        'lse2 = tl.where(lse == -float("inf"), 0.0, lse * LOG2E)',
        'lse2 = tl.where(lse == -float("inf"), 0.0, lse)',
        _bwd("fa1", "float16"),
    ),
    Mutant(
        "fa1 bwd: dq x1.01",
        F1,
        "(dq * sm_scale).to(dq_base.dtype.element_ty)",
        "(dq * sm_scale * 1.01).to(dq_base.dtype.element_ty)",
        _bwd("fa1", "float32"),
    ),
    Mutant(
        "fa1 bwd: dk x1.01",
        F1,
        "dk_out = (dk * sm_scale).to(DK.dtype.element_ty)",
        "dk_out = (dk * sm_scale * 1.01).to(DK.dtype.element_ty)",
        _bwd("fa1", "float32"),
    ),
    Mutant(
        "fa1 bwd: dv x1.01",
        F1,
        "tl.store(dv_ptrs, dv.to(DV.dtype.element_ty)",
        "tl.store(dv_ptrs, (dv * 1.01).to(DV.dtype.element_ty)",
        _bwd("fa1", "float32"),
    ),
    # --- fa2 (fa2/fwd_kernels.py, fa2/bwd_kernels.py, fa2/interface.py) --------------------
    Mutant(
        "fa2 fwd: out x1.01",
        F2F,
        "tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=o_mask)",
        "tl.store(o_ptrs, (acc * 1.01).to(Out.dtype.element_ty), mask=o_mask)",
        _fwd("fa2", "bfloat16"),
    ),
    Mutant(
        "fa2 fwd: LSE + 0.01",
        F2F,
        "tl.store(l_ptrs, lse, mask=m_ok)",
        "tl.store(l_ptrs, lse + 0.01, mask=m_ok)",
        _fwd("fa2", "bfloat16"),
    ),
    Mutant(
        "fa2 fwd: LSE in base 2",
        F2F,
        "(m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2,",
        "(m_i + tl.math.log2(tl.where(seen, l_i, 1.0))),",
        _fwd("fa2", "bfloat16"),
    ),
    Mutant(
        "fa2 fwd: running-max rescale dropped",
        F2F,
        "        acc = acc * alpha[:, None]\n",
        "        acc = acc\n",
        _fwd("fa2"),
    ),
    Mutant(
        "fa2 fwd+bwd: causal top-left",
        F2I,
        "        shift=p.shift,\n",
        "        shift=0,\n",
        _fwd("fa2", "causal"),
    ),
    Mutant(
        "fa2 fwd: GQA head off by one",
        F2F,
        "- 1 - tl.program_id(0)\n    off_h = tl.program_id(1)\n    off_b = tl.program_id(2)\n"
        "    off_hkv = off_h // group\n",
        "- 1 - tl.program_id(0)\n    off_h = tl.program_id(1)\n    off_b = tl.program_id(2)\n"
        "    off_hkv = (off_h // group + 1) % (tl.num_programs(1) // group)\n",
        _fwd("fa2", "h4-2"),
    ),
    Mutant(
        "fa2 fwd+bwd: softcap ignored",
        F2I,
        "    softcap = p.softcap > 0\n",
        "    softcap = False\n",
        _fwd("fa2", "cap"),
    ),
    Mutant(
        "fa2 fwd+bwd: window off by one",
        F2I,
        "        window_left=max(p.window_left, 0),\n",
        "        window_left=max(p.window_left, 0) + 1,\n",
        _fwd("fa2", "win"),
    ),
    Mutant(
        "fa2 bwd: GQA head off by one",
        F2B,
        "        off_h = off_hkv * group + g\n",
        "        off_h = (off_hkv * group + g + 1) % num_heads\n",
        _bwd("fa2", "h4-2"),
    ),
    Mutant(
        "fa2 bwd: saved LSE read in base 2",
        "common/bwd_preprocess.py",  # the preprocess fa2 (and fa3) launch
        'float("inf"), lse * LOG2E)',
        'float("inf"), lse)',
        _bwd("fa2", "float16"),
    ),
    Mutant(
        "fa2 bwd: dq x1.01",
        F2B,
        "    dq = dq * scale\n",
        "    dq = dq * scale * 1.01\n",
        _bwd("fa2", "float32"),
    ),
    Mutant(
        "fa2 bwd: dk x1.01",
        F2B,
        "        dk = dk * scale  #",
        "        dk = dk * scale * 1.01  #",
        _bwd("fa2", "float32"),
    ),
    Mutant(
        "fa2 bwd: dv x1.01",
        F2B,
        "tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=n_ok & dv_ok)",
        "tl.store(dv_ptrs, (dv * 1.01).to(dV.dtype.element_ty), mask=n_ok & dv_ok)",
        _bwd("fa2", "float32"),
    ),
    Mutant(
        "fa3 varlen bwd preprocess: a sequence's padded rows one tile late",
        "common/bwd_preprocess.py",
        "return (tl.load(CuQ + b) + b * TILE_M) // TILE_M * TILE_M",
        "return (tl.load(CuQ + b) + (b + 1) * TILE_M) // TILE_M * TILE_M",
        "host_path or preprocess",
        ("tests/test_fa3_varlen_bwd.py",),
    ),
    Mutant(
        "fa3 dQ postprocess: the first padding row written",
        "common/bwd_postprocess.py",
        "r_ok = r_ok & (dst_rows < seqlen_q)",
        "r_ok = r_ok & (dst_rows <= seqlen_q)",
        "dense",
        ("tests/test_bwd_postprocess.py",),
    ),
    Mutant(
        "fa3 dQ postprocess: the shared-memory swizzle ORs instead of XORs (not a permutation)",
        "fa3/bwd_prepost.py",
        "a = a ^ ((a >> (shift - base)) & (((1 << bits) - 1) << base))",
        "a = a | ((a >> (shift - base)) & (((1 << bits) - 1) << base))",
        "swizzle",
        ("tests/test_fa3_bwd_prepost.py",),
    ),
    Mutant(
        "fa3 sectioned grid order (causal bwd, packed causal fwd): the last section taken as wide "
        "as the others",
        "fa3/bwd_blocks.py",
        "width = cutlass.min(section, pairs - sec * section)",
        "width = section",
        "head_section",
        ("tests/test_fa3_bwd_compile.py",),
    ),
    Mutant(
        "deterministic dQ under a window: every row block's turns start at column block 0 "
        "(the adds would wait forever)",
        "fa3/bwd_host.py",
        "first = _first_column_block(rows, nk - nq, left, key.cfg.tile_n)",
        "first = rows * 0",
        "turn_counters",
        ("tests/test_fa3_bwd_compile.py",),
    ),
    Mutant(
        "deterministic varlen dQ under a window: turns started from the totals' alignment, not "
        "each sequence's own lengths",
        "fa3/bwd_host.py",
        "first = _first_column_block(m * tm, shift, left, tn)",
        "first = _first_column_block(m * tm, total_k - total_q, left, tn)",
        "varlen_turn_counters",
        ("tests/test_fa3_varlen_bwd.py",),
    ),
    Mutant(
        "boxed paged decode: a box past the row's end starts outside the view (the H200 faulted)",
        "fa3/decode.py",
        "return page, key - index * page_size, cutlass",
        "return page, first - index * page_size, cutlass",
        "page_boxes_start",
        ("tests/test_fa3_kvcache.py",),
    ),
    # --- host-path memos: a remembered answer must follow what it depends on ---------------
    Mutant(
        "metadata checked once: version counters ignored (an in-place write not re-checked)",
        "common/metadata.py",
        "*(t._version for t in tensors), *(t.data_ptr() for t in tensors), *problem",
        "*(t.data_ptr() for t in tensors), *problem",
        "checked_once",
        ("tests/test_inference.py",),
    ),
    Mutant(
        "int cache_seqlens: its kept tensor keyed without the length (a stale length reused)",
        "common/kvcache.py",
        "key = (device, None, batch, length)",
        "key = (device, None, batch)",
        "length_tensor",
        ("tests/test_inference.py",),
    ),
    Mutant(
        "decode: every split call on the two-CTA build (the idle-SM test dropped)",
        "fa3/decode_host.py",
        "        and tiles * splits < decode_configs.DECODE_TWO_CTAS_SPLITS_FILL * num_sms\n",
        "",
        "two_ctas_per_sm_plan",
        ("tests/test_fa3_kvcache.py",),
    ),
    Mutant(
        "decode: split partials keyed without the stream (two streams' calls share them)",
        "fa3/decode_host.py",
        'key = (*_stream_key(device), n, d) if device.type == "cuda"',
        'key = (_stream_key(device)[0], None, n, d) if device.type == "cuda"',
        "split_partials",
        ("tests/test_fa3_kvcache.py",),
    ),
    Mutant(
        "flash-attn names: the varlen qkvpacked form takes k and v in each other's place",
        "dispatch/flash_attn.py",
        'q, k, v = _unpack("qkv", qkv, 3, "(total, 3, H, D)")',
        'q, v, k = _unpack("qkv", qkv, 3, "(total, 3, H, D)")',
        "packed_functions",
        ("tests/test_flash_attn_api.py",),
    ),
    Mutant(
        "flash-attn names: paged varlen keys one slot off within their page",
        "dispatch/flash_attn.py",
        "* page + j % page",
        "* page + (j + 1) % page",
        "varlen_block_table",
        ("tests/test_flash_attn_api.py",),
    ),
    Mutant(
        "fa2 decode: K read from slot 0 of a left-padded row (cache_leftpad)",
        "fa2/decode.py",
        """BlockTable, off_b, keys + first_key, key_ok, start_n, page_size, stride_btb,
            stride_kb,""",
        """BlockTable, off_b, keys, key_ok, start_n, page_size, stride_btb,
            stride_kb,""",
        "leftpad and fa2",
        ("tests/test_inference.py",),
    ),
    Mutant(
        "torch kvcache: cache_leftpad ignored",
        "dispatch/portable_inference.py",
        "lp = min(max(lp, 0), n)",
        "lp = 0",
        "leftpad and torch",
        ("tests/test_inference.py",),
    ),
    Mutant(
        "transformers: a right-padded decode step taken as left padding",
        "dispatch/hf.py",
        "left = (mask == (slots[None, :] >= pads[:, None])).all() & (pads <= seen - nq).all()",
        "left = (pads <= seen - nq).all()",
        "left_padding",
        ("tests/test_hf.py",),
    ),
    Mutant(
        "flash-attn names: a paged varlen batch's uneven queries padded at the front",
        "dispatch/flash_attn.py",
        "slots = (seq * max_q + max_q - cu[seq + 1] + t).clamp(0, b * max_q - 1)",
        "slots = (seq * max_q - cu[seq] + t).clamp(0, b * max_q - 1)",
        "few_queries",
        ("tests/test_flash_attn_api.py",),
    ),
    Mutant(
        "flash-attn names: a paged decode batch's cache lengths one key short",
        "dispatch/flash_attn.py",
        "lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)",
        "lens = (cu_k[1:] - cu_k[:-1] - 1).clamp(min=0).to(torch.int32)",
        "few_queries",
        ("tests/test_flash_attn_api.py",),
    ),
    Mutant(
        "fa3: dense problems without GQA on the decode kernel whatever their grid",
        "common/kvcache.py",
        "and (p.group_size > 1 or p.batch * p.heads_q < mha_max_ctas)",
        "and (p.group_size > 0 or p.batch * p.heads_q < mha_max_ctas)",
        "decode_route",
        ("tests/test_fa3_kvcache.py", "tests/test_fa2_decode_route.py"),
    ),
    Mutant(
        "fa3: a dense problem on the decode kernel reads one key fewer",
        "fa3/interface.py",
        "lens = length_tensor(kp.attn.batch, kp.attn.seqlen_k, q.device)",
        "lens = length_tensor(kp.attn.batch, kp.attn.seqlen_k - 1, q.device)",
        "decode_route",
        ("tests/test_fa3_kvcache.py",),
    ),
    Mutant(
        "fa2 route: a dense problem on the decode kernel reads one key fewer",
        F2I,
        "lens = length_tensor(kp.attn.batch, kp.attn.seqlen_k, q.device)",
        "lens = length_tensor(kp.attn.batch, kp.attn.seqlen_k - 1, q.device)",
        "dense_problems",
        ("tests/test_fa2_decode_route.py",),
    ),
    Mutant(
        "fa2 fp8 cache: every row reads batch row 0's key descales",
        "fa2/decode.py",
        "scale = qk_scale * tl.load(DescaleK + off_b * (num_heads // group) + off_hkv)",
        "scale = qk_scale * tl.load(DescaleK + off_hkv)",
        "fp8_cache_matches",
        ("tests/test_kvcache_fp8.py",),
    ),
    Mutant(
        "fa2 fp8 cache: the value descale left out of the output",
        "fa2/decode.py",
        "        denom = denom / tl.load(DescaleV + off_b * (num_heads // group) + off_hkv)",
        "        denom = denom * 1.0",
        "fp8_cache_matches",
        ("tests/test_kvcache_fp8.py",),
    ),
    Mutant(
        "fa2 lse: the gradient reaching the LSE dropped from the backward",
        F2I,
        "        delta[:, :, :nq] -= dlse",
        "        delta[:, :, :nq] -= 0 * dlse",
        "gradient_through_out_and_lse and fa2",
        ("tests/test_lse_grad.py",),
    ),
    Mutant(
        "fa2 lse: a packed sequence's LSE gradient taken off the rows without the padding",
        F2I,
        "        delta[:, tokens + seq * row_pad] -= dlse",
        "        delta[:, tokens] -= dlse",
        "varlen_gradient and fa2",
        ("tests/test_lse_grad.py",),
    ),
    Mutant(
        "torch lse: the gradient reaching the LSE dropped from the backward",
        T,
        "            delta = delta - dlse[:, :, rows].to(dt).reshape(delta.shape)",
        "            delta = delta - 0 * dlse[:, :, rows].to(dt).reshape(delta.shape)",
        "gradient_through_out_and_lse and torch",
        ("tests/test_lse_grad.py",),
    ),
    Mutant(
        "torch sinks: the sink's logit taken with the wrong sign",
        "dispatch/api.py",
        "    keep = torch.sigmoid(lse.to(dtype) - s)  # (..., Hq, Nq)",
        "    keep = torch.sigmoid(lse.to(dtype) + s)  # (..., Hq, Nq)",
        "sinks",
        ("tests/test_sinks.py",),
    ),
    Mutant(
        "flash-attn names: cache_batch_idx ignored (batch row b reads cache row b)",
        "dispatch/flash_attn.py",
        "table = (index.long()[:, None] * per_row + steps)",
        "table = (torch.arange(len(index), device=index.device)[:, None] * per_row + steps)",
        "cache_batch_idx",
        ("tests/test_flash_attn_api.py",),
    ),
    Mutant(
        "flash-attn names: rotary tables put non-causal queries at their own positions",
        "common/rotary_kernel.py",
        "            if LOCAL:\n                pos = start + t",
        "            if True:\n                pos = start + t",
        "rotates_q_and_the_new_k or rotate_kernel",
        ("tests/test_flash_attn_api.py",),
    ),
    Mutant(
        "varlen eager plan: FLASHSUITE_<V>_VARLEN_BWD left out of its key",
        "dispatch/api.py",
        '    *(f"FLASHSUITE_{name.upper()}_VARLEN_BWD" for name in registry.VERSIONS),\n',
        "",
        "backward_switches",
        ("tests/test_inference.py",),
    ),
    Mutant(
        "decode launch plans: DECODE_LOOP_MASK_TEST left out of their key",
        "fa3/decode_host.py",
        "decode_configs.DECODE_KV_EVICT_FIRST, decode_configs.DECODE_LOOP_MASK_TEST,",
        "decode_configs.DECODE_KV_EVICT_FIRST,",
        "loop_mask_test_switch",
        ("tests/test_fa3_kvcache.py",),
    ),
    Mutant(
        "split counters: one view per count, whatever the stream (launches may share a pair)",
        "fa3/decode_host.py",
        "key = (*_stream_key(device), n)",
        "key = (_stream_key(device)[0], 0, n)",
        "split_counters_repeat",
        ("tests/test_fa3_kvcache.py",),
    ),
    Mutant(
        "split counters: views of a replaced buffer still handed out",
        "fa3/decode_host.py",
        "        for stale in [k for k in list(views) if k[:2] == stream]:\n",
        "        for stale in []:\n",
        "split_counters_repeat",
        ("tests/test_fa3_kvcache.py",),
    ),
    Mutant(
        "fp8 block descales: a materialised per-row descale taken as a block view",
        "common/validation.py",
        "    if block > 1 and ds.stride(3) != 0:",
        "    if False:",
        "names_a_bad_block_descale",
        ("tests/test_fp8_blocks.py",),
    ),
    Mutant(
        "fa3 fp8 blocks: a per-head k as one block beside a per-block v",
        "fa3/interface.py",
        "                _block_descale(descale_k, b, hkv, q.device, nk, kv_block),",
        "                _block_descale(descale_k, b, hkv, q.device),",
        "partners_blocks",
        ("tests/test_fp8_blocks.py",),
    ),
    Mutant(
        "fa3 fp8 blocks: the table's key tile whatever the block size",
        "fa3/configs.py",
        "    candidates = [_plain(c) for c in (cfg, *_fp8_block_candidates(head_dim, causal))]",
        "    candidates = [_plain(cfg)]",
        "key_tile_that_divides",
        ("tests/test_fp8_blocks.py",),
    ),
    Mutant(
        "fa3 fp8: a keys-major V kept on the smem build (copied token-major first)",
        "fa3/configs.py",
        '    if p.is_fp8 and p.v_keys_major and cfg.v_transpose == "smem":',
        '    if p.is_fp8 and p.v_keys_major and cfg.v_transpose == "none":',
        "keys_major or smem_transpose_build_takes",
        ("tests/test_fa3_fp8_compile.py",),
    ),
    Mutant(
        "fa3 fp8 blocks: the persistent entry's scheduler kept",
        "fa3/configs.py",
        "    candidates = [_plain(c) for c in (cfg, *_fp8_block_candidates(head_dim, causal))]",
        "    candidates = [c for c in (cfg, *_fp8_block_candidates(head_dim, causal))]",
        "key_tile_that_divides",
        ("tests/test_fp8_blocks.py",),
    ),
    Mutant(
        "fa3 fp8: the smem-Vᵀ build keeps the persistent entry's scheduler",
        "fa3/configs.py",
        '    cfg = replace(_plain(base), v_transpose="smem")',
        '    cfg = replace(base, v_transpose="smem")',
        "who_transposes",
        ("tests/test_fa3_fp8_compile.py",),
    ),
    Mutant(
        "fa3: causal D 96 on its 192-row tiles at every key length",
        "fa3/configs.py",
        "SHORT_CAUSAL_SEQLEN_K = 1024",
        "SHORT_CAUSAL_SEQLEN_K = 0",
        "short_keys_pick_their_own_config",
        ("tests/test_fa3_compile.py",),
    ),
    Mutant(
        "fa3: short non-causal D 64 on v2 with one Q buffer",
        "fa3/configs.py",
        "return _two_q(_overlap(cfg)) if short and head_dim in _SHORT_PERSISTENT_DIMS else cfg",
        "return _overlap(cfg) if short and head_dim in _SHORT_PERSISTENT_DIMS else cfg",
        "short_keys_pick_their_own_config",
        ("tests/test_fa3_compile.py",),
    ),
    Mutant(
        "fa3: causal D 64 without two Q buffers at short key lengths",
        "fa3/configs.py",
        "SHORT_CAUSAL_TWO_Q = {64: 2048}",
        "SHORT_CAUSAL_TWO_Q = {64: 0}",
        "short_keys_pick_their_own_config",
        ("tests/test_fa3_compile.py",),
    ),
    Mutant(
        "fa3: softcap and windowed problems keep the stage's descriptors",
        "fa3/configs.py",
        "wg_slice=False, stage_desc=False, split_loops=False,",
        "wg_slice=False, split_loops=False,",
        "ship_where_they_were_measured",
        ("tests/test_fa3_softmax_overlap.py",),
    ),
    Mutant(
        "fa3: non-causal D 64 without exponentials under P·V (pv_wait_exps)",
        "fa3/configs.py",
        "            pv_wait_exps=FA4_LOOP_EXPS if fa4_loop else 0,",
        "            pv_wait_exps=0,",
        "ship_where_they_were_measured or d64_table_build_runs_fa4s_loop",
        ("tests/test_fa3_softmax_overlap.py",),
    ),
    Mutant(
        "fa3: softcap and windowed problems keep the exponentials under P·V",
        "fa3/configs.py",
        "                   pv_wait_exps=0)  # fmt: skip",
        "                   )  # fmt: skip",
        "ship_where_they_were_measured",
        ("tests/test_fa3_softmax_overlap.py",),
    ),
    Mutant(
        "fa3: non-causal D 64 without FA4's descriptors (stage_desc)",
        "fa3/configs.py",
        "            stage_desc=fa4_loop,",
        "            stage_desc=False,",
        "ship_where_they_were_measured or d64_table_build_runs_fa4s_loop",
        ("tests/test_fa3_softmax_overlap.py",),
    ),
    Mutant(
        "fa3: softcap and windowed problems keep P·V's wait after the row max",
        "fa3/configs.py",
        "                   loop_mask_test=True, pv_wait_after_max=False,",
        "                   loop_mask_test=True,",
        "ship_where_they_were_measured",
        ("tests/test_fa3_softmax_overlap.py",),
    ),
    Mutant(
        "fa3 fp8: the smem-Vᵀ D 128 build on the host build's tile",
        "fa3/configs.py",
        "    base = _FP8_SMEM_TILES.get((head_dim, causal)) or _fp8_tiles(head_dim, causal)",
        "    base = _fp8_tiles(head_dim, causal)",
        "ship_where_they_were_measured",
        ("tests/test_fa3_softmax_overlap.py",),
    ),
    Mutant(
        "fa3: spec_exps admitted without a rescale threshold (every block taken twice)",
        "fa3/configs.py",
        "        cfg.rescale_threshold > 0\n        and cfg.intra_wg_overlap",
        "        cfg.intra_wg_overlap",
        "spec_exps_needs",
        ("tests/test_fa3_softmax_options.py",),
    ),
    Mutant(
        "fa3 fp8: a keys-major V on the build that permutes its keys (a copy)",
        "fa3/configs.py",
        "    if p.is_fp8 and p.v_keys_major and cfg.permute_v_keys:",
        "    if False:",
        "skips_the_host_copy",
        ("tests/test_fa3_fp8_compile.py",),
    ),
    Mutant(
        "fa3: the second Q buffer left out of the shared-memory count",
        "fa3/configs.py",
        "    q = cfg.tile_m * head_dim * elem * cfg.q_stages\n",
        "    q = cfg.tile_m * head_dim * elem\n",
        "second_q_buffer",
        ("tests/test_fa3_q_stages.py",),
    ),
    Mutant(
        "keys-major copy: the channels past the first channel block left unwritten",
        "common/transpose.py",
        "    grid = (-(-n_out // BLOCK_N), b * h, -(-d // BLOCK_D))",
        "    grid = (-(-n_out // BLOCK_N), b * h, 1)",
        "keys_major_copy",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "permuted Vᵀ copy: the keys left in their own order",
        "common/transpose.py",
        "        n = col - r + (r // 16) * 16 + ((r // 2) % 2) * 8 + ((r // 4) % 4) * 2 + r % 2",
        "        n = col",
        "permuted_keys",
        ("tests/test_fa3_fp8_compile.py",),
    ),
    Mutant(
        "own-backward choice memo: FLASHSUITE_<V>_BWD left out of its key",
        "dispatch/registry.py",
        "mkey = (name, p, arch, _deterministic(), env_table.get(switch))",
        "mkey = (name, p, arch, _deterministic())",
        "chosen_per_call",
        ("tests/test_dispatch.py",),
    ),
    Mutant(
        "fa3 config: q_in_regs allowed on three consumer warpgroups",
        "fa3/configs.py",
        "head_dim > 128 or cfg.num_consumer_wgs != 2):",
        "head_dim > 128):",
        "q_in_regs",
        ("tests/test_fa3_q_in_regs.py",),
    ),
    Mutant(
        "fa3_timeline: a CTA's launch gap counted from the previous CTA's start",
        "benchmarks/fa3_timeline.py",
        'gap = recs[0][F["cta_start"]] - max(r[F["epilogue_end"]] for r in prev)',
        'gap = recs[0][F["cta_start"]] - prev[0][F["cta_start"]]',
        "analyse",
        ("tests/test_fa3_trace.py",),
    ),
    Mutant(
        "fa3 table: D = 64's sections build past the key lengths it was timed at",
        "fa3/configs.py",
        "and p.seqlen_k <= SECTIONS_MAX_SEQLEN_K:",
        "and p.seqlen_k <= 2 * SECTIONS_MAX_SEQLEN_K:",
        "dense_runs",
        ("tests/test_fa3_q_in_regs.py",),
    ),
    Mutant(
        "fa3 table: causal D = 64's short tiles at every length the counter takes",
        "fa3/configs.py",
        "if short_keys and p.head_dim in _SHORT_CAUSAL:",
        "if p.head_dim in _SHORT_CAUSAL:",
        "counter_where_measured",
        ("tests/test_fa3_tile_counter.py",),
    ),
    Mutant(
        "fa3 table: causal D = 256's 64-key tiles past the 4k keys they were timed at",
        "fa3/configs.py",
        "_CAUSAL_KEY_TILES = {256: (4096, 64)}",
        "_CAUSAL_KEY_TILES = {256: (16384, 64)}",
        "counter_where_measured",
        ("tests/test_fa3_tile_counter.py",),
    ),
    Mutant(
        "fa3 table: the Q-in-registers build for query lengths its LSE store cannot take",
        "fa3/configs.py",
        "if p.seqlen_q % 4 == 0 and (short",
        "if p.seqlen_q % 1 == 0 and (short",
        "dense_runs",
        ("tests/test_fa3_q_in_regs.py",),
    ),
]

# fa3 and the fp8 path (GPU only). The patterns live in one table so that a reorganisation of
# fa3's files only needs the paths and patterns here re-pointed.
FA3_KERNEL = "fa3/fwd_consumer.py"  # the forward consumer tile: main loop, epilogue
FA3_SOFTMAX = "fa3/softmax.py"  # online softmax, final 1/l and LSE
FA3_LOOP = "fa3/fwd_mainloop.py"  # the per-K/V-block steps
FA3_MASK = "fa3/mask.py"
FA3_PIPE = "fa3/pipeline.py"  # the producer's loads (K/V head of a query head)
FA3_HOST = "fa3/interface.py"  # the launcher: fp8 descales and Vᵀ
FA3_BWD = "fa3/bwd_pointwise.py"
FA3_VARLEN = "fa3/varlen.py"  # packed sequences: ragged views, the virtual-block grid
VARLEN_TESTS = ("tests/test_fa3_varlen.py",)
FA3_VARLEN_BWD = "fa3/bwd_varlen.py"  # packed sequences in the backward
VARLEN_BWD_TESTS = ("tests/test_fa3_varlen_bwd.py",)
FA3_DECODE = "fa3/decode.py"  # KV-cache decode: page bounds, GQA packing, split ranges
KVCACHE_TESTS = ("tests/test_fa3_kvcache.py",)
FA3_BWD_PREPOST = "fa3/bwd_prepost.py"  # the dense backward's pre- and postprocess (GPU)
OWN = "test_backward_fa3_own"  # the shared backward cases through fa3's own backward
GPU_MUTANTS = [
    Mutant(
        "fa3 softmax: spec_exps keeps the running-max P where one row (not every row) kept",
        "fa3/softmax.py",
        "    if cute.arch.vote_all_sync(kept[0] & kept[1]):",
        "    if cute.arch.vote_any_sync(kept[0] | kept[1]):",
        "spec_exps_gives_the_same_bits",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fa3: the exponentials taken before P·V's wait taken again after it",
        FA3_SOFTMAX,
        "                    p = x if early else _exp2(x, emulated(k, ex2_emu))",
        "                    p = _exp2(x, emulated(k, ex2_emu))",
        "fa4loop",
        ("tests/test_fa3_softmax_options.py",),
    ),
    Mutant(
        "fa3: stage_desc's Vᵀ descriptors from stage 0",
        "fa3/utils.py",
        "        tOrVt = tOrVt[None, None, None, stage]",
        "        tOrVt = tOrVt[None, None, None, 0]",
        "fa4loop or stage",
        ("tests/test_fa3_softmax_options.py",),
    ),
    Mutant(
        "fa3 fwd: out x1.01",
        FA3_SOFTMAX,
        "o_scale(cute.arch.rcp_approx(l_tot))",
        "o_scale(cute.arch.rcp_approx(l_tot) * Float32(1.01))",
        _fwd("fa3", "bfloat16"),
    ),
    Mutant(
        "fa3 fwd: LSE + 0.01",
        FA3_KERNEL,
        "                mLSE[row, head, batch] = lse\n",
        "                mLSE[row, head, batch] = lse + Float32(0.01)\n",
        _fwd("fa3", "bfloat16"),
    ),
    Mutant(
        "fa3 fwd: LSE in base 2",
        FA3_SOFTMAX,
        "cute.math.log2(l_tot, fastmath=True)) * LN2",
        "cute.math.log2(l_tot, fastmath=True))",
        _fwd("fa3", "bfloat16"),
    ),
    Mutant(
        "fa3 fwd: running-max rescale dropped (serial K/V step)",
        FA3_LOOP,
        "        self.probs_to_operand(ctx)\n        self.rescale_o(ctx, corr)\n",
        "        self.probs_to_operand(ctx)\n",
        _fwd("fa3"),
    ),
    Mutant(
        "fa3 fwd: running-max rescale dropped (overlapped K/V step)",
        FA3_LOOP,
        "        else:\n            self.rescale_o(ctx, corr)\n",
        "        else:\n            pass\n",
        _fwd("fa3"),
    ),
    Mutant(
        "fa3 fwd: O not rescaled when a row's max grew past the threshold (D = 256)",
        FA3_LOOP,
        "            if needs_rescale(corr):\n",
        "            if not needs_rescale(corr):\n",
        "test_gpu_rescale_threshold_against_the_oracle_while_the_max_grows",
        ("tests/test_fa3_softmax_options.py",),
    ),
    Mutant(
        "fa3 fwd: the split causal loop's masked blocks run unmasked",
        FA3_LOOP,
        "kv_state = self.step_overlap(ctx, kv_state, n_block - 1 - i, True, acc)",
        "kv_state = self.step_overlap(ctx, kv_state, n_block - 1 - i, None, acc)",
        "schedule_options and split",
        ("tests/test_fa3_softmax_options.py",),
    ),
    Mutant(
        "fa3 fwd: causal top-left (mask)",
        FA3_MASK,
        "    shift = seqlen_k - seqlen_q\n",
        "    shift = seqlen_k - seqlen_k\n",
        _fwd("fa3", "causal"),
    ),
    Mutant(
        "fa3 fwd: GQA head off by one",
        FA3_PIPE,
        "    head_kv = head // group\n",
        "    head_kv = head // group + 1\n",
        _fwd("fa3", "h4-2"),
    ),
    Mutant(
        "fa3 fwd: softcap ignored",
        FA3_LOOP,
        "cute.math.tanh(acc_S[i] * ctx.softcap_pre, fastmath=True)",
        "acc_S[i] * ctx.softcap_pre",
        _fwd("fa3", "cap"),
    ),
    Mutant(
        "fa3 fwd: window off by one (mask)",
        FA3_MASK,
        "limit_lo = row + shift - window_left - col0",
        "limit_lo = row + shift - window_left - 1 - col0",
        _fwd("fa3", "win"),
    ),
    Mutant(
        "fa3 bwd: dq x1.01",
        FA3_BWD_PREPOST,
        "                    vals[k] = x\n",
        "                    vals[k] = x * Float32(1.01)\n",
        f"{OWN} and float16",
    ),
    Mutant(
        "fa3 bwd: D (rowsum dO*O) x1.01 in the preprocess",
        FA3_BWD_PREPOST,
        "mDelta[b, h, row] = delta if real else Float32(0.0)",
        "mDelta[b, h, row] = delta * Float32(1.01) if real else Float32(0.0)",
        f"{OWN} and float16",
    ),
    Mutant(
        "fa3 bwd: dk, dv x1.01 (TMA epilogue)",
        FA3_BWD,
        "            self.pack(acc, r)\n",
        "            for i in cutlass.range_constexpr(cute.size(acc)):\n"
        "                acc[i] = acc[i] * Float32(1.01)\n"
        "            self.pack(acc, r)\n",
        f"{OWN} and float16",
    ),
    Mutant(
        "fa3 bwd: P recomputed with the natural-log LSE",
        FA3_BWD,
        "acc_S[i] = cute.math.exp2(acc_S[i] * scale_log2 - lse, fastmath=True)",
        "acc_S[i] = cute.math.exp2(acc_S[i] * scale_log2 - lse * Float32(0.6931471805599453), "
        "fastmath=True)",
        OWN,
    ),
    Mutant(
        "fa3 bwd: LSE and D shuffled from the neighbouring lane (stats_shfl, D 64)",
        FA3_BWD,
        "vals[2 * (j // 8) + c], 4 * (j % 8) + q)",
        "vals[2 * (j // 8) + c], 4 * (j % 8) + (q ^ 1))",
        f"{OWN} and 64",
    ),
    Mutant(
        "fa3 bwd: D (rowsum dO*O) ignored",
        FA3_BWD,
        "ds = p * (dp - d)",
        "ds = p * dp",
        OWN,
    ),
    Mutant(
        "fa3 bwd: window's left edge off by one (mask)",
        FA3_BWD,
        "hi, lo = diag + win[1] + 1, diag - win[0]",
        "hi, lo = diag + win[1] + 1, diag - win[0] - 1",
        f"{OWN} and win",
    ),
    Mutant(
        "fa3 bwd: window's last row block of a column block skipped",
        "fa3/bwd_blocks.py",
        "row_end = cutlass.max(last_key - shift + window_left + 1, 0)",
        "row_end = cutlass.max(last_key - shift + window_left + 1 - self.TILE_M, 0)",
        f"{OWN} and win",
    ),
    Mutant(
        "fa3 varlen: Q/O rows bounded one past the sequence (a write into the next one)",
        FA3_VARLEN,
        "return self._rows(t, head, self.offset_q, self.seqlen_q)",
        "return self._rows(t, head, self.offset_q, self.seqlen_q + 1)",
        "gpu_varlen_matches",
        VARLEN_TESTS,
    ),
    Mutant(
        "fa3 varlen: the next sequence's first key visible",
        FA3_VARLEN,
        "seqlen_k = mCuSeqlensK[batch + 1] - offset_k\n",
        "seqlen_k = mCuSeqlensK[batch + 1] - offset_k + 1\n",
        "gpu_varlen_matches",
        VARLEN_TESTS,
    ),
    Mutant(
        "fa3 varlen: virtual blocks of a sequence undercounted",
        FA3_VARLEN,
        "return (mCuSeqlensQ[b] + b * self.TILE_M) // self.TILE_M",
        "return (mCuSeqlensQ[b] + b * (self.TILE_M - 64)) // self.TILE_M",
        "gpu_varlen_matches",
        VARLEN_TESTS,
    ),
    Mutant(
        "fa3 varlen bwd: LSE, D and dQ rows of a sequence one tile late",
        FA3_VARLEN_BWD,
        "pad_row = self.rows._first_block(mCuSeqlensQ, batch) * self.TILE_M",
        "pad_row = (self.rows._first_block(mCuSeqlensQ, batch) + 1) * self.TILE_M",
        "gpu_varlen_bwd_matches",
        VARLEN_BWD_TESTS,
    ),
    Mutant(
        "fa3 varlen bwd: dK / dV rows one past the sequence's first",
        FA3_VARLEN_BWD,
        "return cute.domain_offset((self.offset_k, 0), t[None, None, head_kv])",
        "return cute.domain_offset((self.offset_k + 1, 0), t[None, None, head_kv])",
        "gpu_varlen_bwd_matches",
        VARLEN_BWD_TESTS,
    ),
    Mutant(
        "fa3 varlen bwd: the next sequence's first key visible",
        FA3_VARLEN_BWD,
        "seqlen_k = mCuSeqlensK[batch + 1] - offset_k\n",
        "seqlen_k = mCuSeqlensK[batch + 1] - offset_k + 1\n",
        "gpu_varlen_bwd_matches",
        VARLEN_BWD_TESTS,
    ),
    Mutant(
        "fa3 decode: a page's TMA bound one token past the row's keys (reads a NaN slot)",
        FA3_DECODE,
        "cutlass.min(page_size, seqlen_k - index * page_size)",
        "cutlass.min(page_size, seqlen_k + 1 - index * page_size)",
        "gpu_decode_matches",
        KVCACHE_TESTS,
    ),
    Mutant(
        "fa3 decode: packed rows masked by their row, not their query token",
        FA3_MASK,
        "            row = query_of[r]\n",
        "            row = query_of[r] * 0 + row\n",
        "gpu_decode_matches",
        KVCACHE_TESTS,
    ),
    Mutant(
        "fa3 decode: the last key block of every split dropped",
        FA3_DECODE,
        "return n_block_min, cutlass.min(n_block_min + per_split, hi_blk)",
        "return n_block_min, cutlass.min(n_block_min + per_split - 1, hi_blk)",
        "gpu_decode_matches",
        KVCACHE_TESTS,
    ),
    Mutant(
        "fa3 decode: cache_leftpad not added to a contiguous row's first key",
        FA3_DECODE,
        "start = first + tile.first_key",
        "start = first",
        "gpu_decode_leftpad",
        KVCACHE_TESTS,
    ),
    Mutant(
        "fa3 fp8: descale (b, h) read from (h, b)",
        FA3_HOST,
        "    if t is not None:\n        return t.contiguous()\n",
        "    if t is not None:\n"
        "        return t.reshape(t.shape[1], t.shape[0]).t().contiguous()\n",
        "fp8 and fa3",
        ("tests/test_fp8.py",),
        gpu=True,
    ),
    Mutant(
        "fa3: O's direct store writes the rows past Nq of the last row tile",
        "fa3/epilogue.py",
        "if m_block * tile_m + tOcO[0, m, 0][0] < seqlen_q:",
        "if m_block * tile_m + tOcO[0, m, 0][0] < seqlen_q + tile_m:",
        "direct_o_store",
        ("tests/test_fa3_q_stages.py",),
    ),
    Mutant(
        "fa3: the LSE's TMA store writes every warpgroup's slab to the first one's rows",
        "fa3/epilogue.py",
        "(m_block * num_wgs + cwg,))",
        "(m_block * num_wgs,))",
        "lse_by_tma",
        ("tests/test_fa3_q_stages.py",),
    ),
    Mutant(
        "fa3: every tile's Q·Kᵀ reads the first Q buffer",
        FA3_KERNEL,
        "sQ = sQ[None, None, q_state.index]",
        "sQ = sQ[None, None, 0]",
        "two_q_buffers",
        ("tests/test_fa3_q_stages.py",),
    ),
    Mutant(
        "fa3 fp8 blocks: O's units not carried from one v block to the next",
        FA3_LOOP,
        "ratio = blk.dsv[0] / blk.cur[1]",
        "ratio = blk.cur[1] / blk.cur[1]",
        "fp8_blocks",
        ("tests/test_fp8_blocks.py",),
    ),
    Mutant(
        "fa3 fp8 blocks: k/v descales of the wrong key block",
        FA3_LOOP,
        "j = n_block // blk.kv_tiles",
        "j = n_block // blk.kv_tiles // 2",
        "fp8_blocks",
        ("tests/test_fp8_blocks.py",),
    ),
    Mutant(
        "fa3 fp8 blocks: q descale of the wrong row block",
        FA3_KERNEL,
        "row // m_dq.shape[3]",
        "row // m_dq.shape[3] // 2",
        "fp8_blocks",
        ("tests/test_fp8_blocks.py",),
    ),
    Mutant(
        "fa3: the tile counter's next tile one position late (a tile skipped)",
        "fa3/kernels.py",
        "tile = cute.arch.shuffle_sync(taken, 0) + sched.grid_x",
        "tile = cute.arch.shuffle_sync(taken, 0) + sched.grid_x + 1",
        "static_order_bits and D128-causal",
        ("tests/test_fa3_tile_counter.py",),
    ),
    Mutant(
        "fa3: the tile counters not reset for the next launch",
        "fa3/kernels.py",
        "if done == sched.grid_x - 1:",
        "if done == sched.grid_x:",
        "static_order_bits and D128-causal",
        ("tests/test_fa3_tile_counter.py",),
    ),
    Mutant(
        "fa3: Q in registers loads the first warpgroup's rows into every warpgroup",
        "fa3/utils.py",
        "thr_s2r = s2r.get_slice(thread)",
        "thr_s2r = s2r.get_slice(thread % 128)",
        "q_in_registers",
        ("tests/test_fa3_q_in_regs.py",),
    ),
    Mutant(
        "fa3 trace: both warpgroups' stamps in one row",
        "fa3/trace.py",
        "heads_q * batch)) * wgs + cwg",
        "heads_q * batch)) * wgs",
        "trace",
        ("tests/test_fa3_trace.py",),
    ),
]
GPU_MUTANTS = [replace(m, gpu=True) for m in GPU_MUTANTS]


# What CI runs on every change (tests/test_mutants.py): the three headline forward mutants on
# fa2 in bf16 (output x1.01, LSE + 0.01, no running-max rescale), a gradient and the fp8
# descale; about a minute. The whole CPU list takes longer than CI's budget on a 2-core
# machine (pytest and Triton start-up dominate each mutant) and runs with this script.
# A gradient x1.01 is selected on the float32 cases: in bf16 it is within 2.5x the error of
# PyTorch's own bf16 autograd (the yardstick), which is much less accurate than the kernels.
CI_SUBSET = (
    "fa2 fwd: out x1.01",
    "fa2 fwd: LSE + 0.01",
    "fa2 fwd: running-max rescale dropped",
    "fa2 bwd: dv x1.01",
    "torch fp8: descale (b, h) read from (h, b)",
)


def check_patterns(mutants: list[Mutant], root: Path = ROOT) -> list[str]:
    """Problems with the table against the tree at `root`: patterns that do not occur exactly
    once, and mutants of the oracle."""
    problems = []
    for m in mutants:
        if m.path == "common/reference.py":
            problems.append(f"{m.name}: the oracle (common/reference.py) is never mutated")
            continue
        path = root / m.path
        count = path.read_text().count(m.old) if path.exists() else 0
        if count != 1:
            problems.append(f"{m.name}: pattern occurs {count} times in {m.path} (expected 1)")
    return problems


def _copy_tree(dest: Path) -> Path:
    """The repository without .git/.venv/caches, plus dest/_pkg/flashsuite -> the copy's
    package folders (the layout the editable install maps), first on PYTHONPATH."""
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".gpu", ".pytest_cache", "*.egg-info"
    )
    repo = dest / "repo"
    shutil.copytree(ROOT, repo, ignore=ignore, symlinks=True)
    pkg = dest / "_pkg" / "flashsuite"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in PACKAGES:
        (pkg / name).symlink_to(repo / name, target_is_directory=True)
    return repo


def _env(tmp: Path) -> dict[str, str]:
    """The copy first on PYTHONPATH; the caller's other entries (e.g. a site folder holding the
    CuTe DSL on a GPU host) kept after it, the original repository's own entries dropped."""
    env = dict(os.environ)
    kept = [
        e for e in env.get("PYTHONPATH", "").split(os.pathsep)
        if e and Path(e).resolve() != ROOT
    ]  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(tmp / "_pkg"), str(tmp / "repo"), *kept])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("FLASHSUITE_COMPARE_LOG", None)
    return env


def _check_import(tmp: Path, env: dict[str, str]) -> None:
    """The copy's package must be the one imported, or every mutant would 'survive'."""
    code = (
        "import flashsuite.common.testing as a, flashsuite.dispatch.portable as b, sys\n"
        "print(a.__file__); print(b.__file__)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp / "repo", capture_output=True, text=True
    )
    files = res.stdout.split()
    if res.returncode != 0 or not files or not all(f.startswith(str(tmp)) for f in files):
        raise SystemExit(f"the temporary copy is not what gets imported: {files} {res.stderr}")


def _apply(repo: Path, m: Mutant) -> str:
    path = repo / m.path
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise ValueError(f"{m.name}: pattern occurs {count} times in {m.path} (expected 1)")
    path.write_text(text.replace(m.old, m.new))
    return text


def run(mutants: list[Mutant], keep_going: bool = True, jobs: int = 1) -> list[dict]:
    """The table's rows in `mutants`' order. With jobs > 1 the mutants are dealt round-robin
    to that many workers, each with its own copy of the repository (a mutant never sees
    another's edit); keep_going=False then stops each worker at its first non-kill."""
    if jobs > 1 and len(mutants) > 1:
        shares = [mutants[i::jobs] for i in range(min(jobs, len(mutants)))]
        with ThreadPoolExecutor(len(shares)) as pool:
            done = list(pool.map(lambda share: run(share, keep_going), shares))
        by_name = {r["mutant"]: r for rows in done for r in rows}
        return [by_name[m.name] for m in mutants if m.name in by_name]
    rows = []
    with tempfile.TemporaryDirectory(prefix="flashsuite-mutants-") as d:
        tmp = Path(d)
        repo = _copy_tree(tmp)
        env = _env(tmp)
        _check_import(tmp, env)
        for m in mutants:
            t0 = time.time()
            row = {"mutant": m.name, "file": m.path, "status": "", "killed_by": "", "s": 0.0}
            try:
                original = _apply(repo, m)
            except ValueError as exc:
                row.update(status="PATTERN", killed_by=str(exc))
                rows.append(row)
                print(f"{m.name:<50} PATTERN: {exc}", flush=True)
                continue
            try:
                cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
                cmd += ["-rfs", "--no-header", "-k", m.select, *m.files]
                # Only the mutated version's modules are imported (fa3's toolchain is slow to
                # load); the other versions' tests are skipped.
                version = {"FLASHSUITE_TEST_VERSIONS": m.name.split()[0]}
                res = subprocess.run(
                    cmd, env=env | version, cwd=repo, capture_output=True, text=True
                )
            finally:
                (repo / m.path).write_text(original)
            out = res.stdout + res.stderr
            failed = re.findall(r"^FAILED (\S+)", out, flags=re.M)
            errors = re.findall(r"^E\s+(\S+)", out, flags=re.M)  # the traceback's E lines
            if res.returncode == 1 and failed:
                if errors and errors[0].startswith(("AssertionError", "assert", "Failed")):
                    row.update(status="killed", killed_by=failed[0])
                else:  # a crash (e.g. the mutated kernel does not compile) is not a catch
                    why = errors[0] if errors else "no traceback"
                    row.update(status="ERROR", killed_by=f"{failed[0]}: {why}")
            elif res.returncode == 0 and not re.search(r"\b\d+ passed", out):
                # every selected test skipped (e.g. the version unavailable in the copy): the
                # mutant was never exercised, which is neither a kill nor a survival
                skips = re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", out, flags=re.M)
                why = skips[0] if skips else "no reason printed"
                row.update(status="SKIPPED", killed_by=f"-k {m.select!r} ran no test: {why}")
            elif res.returncode == 0:
                row.update(status="SURVIVED", killed_by=f"-k {m.select!r} all passed")
            elif res.returncode == 5:
                row.update(status="NO TESTS", killed_by=f"-k {m.select!r} selects nothing")
            else:
                tail = out.strip().splitlines()[-1:] or [""]
                row.update(status="ERROR", killed_by=f"pytest rc={res.returncode}: {tail[0]}")
            row["s"] = round(time.time() - t0, 1)
            rows.append(row)
            print(
                f"{m.name:<50} {row['status']:<8} {row['s']:>6.1f}s  {row['killed_by']}", flush=True
            )
            if not keep_going and row["status"] != "killed":
                break
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| mutant | file | result | killed by | s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['mutant']} | `{r['file']}` | {r['status']} | `{r['killed_by']}` | {r['s']} |"
        )
    return "\n".join(lines) + "\n"


def select(gpu: bool, only: str | None) -> list[Mutant]:
    chosen = GPU_MUTANTS if gpu else MUTANTS
    if only:
        chosen = [m for m in chosen if only in m.name]
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the fa3 / fp8 mutants (sm90 GPU)")
    ap.add_argument("--only", help="run the mutants whose name contains this text")
    ap.add_argument("--out", type=Path, help="write the table as markdown to this file")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs: expected a count >= 1, got {args.jobs}")
    mutants = select(args.gpu, args.only)
    if not mutants:
        print("no mutant selected", file=sys.stderr)
        return 2
    t0 = time.time()
    rows = run(mutants, jobs=args.jobs)
    table = markdown(rows)
    print(f"\n{table}\n{len(rows)} mutants in {time.time() - t0:.0f} s")
    if args.out:
        args.out.write_text(table)
    statuses = {r["status"] for r in rows}
    if statuses <= {"killed"}:
        return 0
    return 1 if statuses <= {"killed", "SURVIVED"} else 2


if __name__ == "__main__":
    sys.exit(main())
