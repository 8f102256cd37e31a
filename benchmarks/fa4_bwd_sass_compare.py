"""FA4's CuTe-DSL SM90 backward beside ours, from the SASS: both compiled for sm_90a on the CPU.

    python -m benchmarks.fa4_bwd_sass_compare                     # bf16 D 128 non-causal
    python -m benchmarks.fa4_bwd_sass_compare --keep /tmp/bwdcmp --listing mma
    python -m benchmarks.fa4_bwd_sass_compare --from /tmp/bwdcmp  # re-read the kept builds
    python -m benchmarks.fa4_bwd_sass_compare --variant pipe80_wgs_ng_tma   # another of ours
    python -m benchmarks.fa4_bwd_sass_compare --no-prepost --json out.json

Builds, each compiled in its own process (`--build NAME`, which imports benchmarks.fa3_probe
first so the CUTE_DSL_* variables are set before cutlass is imported):

- "fa4": FlashAttentionBackwardSm90 (flash-attn-4 4.0.0b36, flash_attn/cute/flash_bwd_sm90.py)
  configured as its interface's `_flash_attn_bwd` configures it on SM90 for bf16, MHA, dense,
  non-deterministic: every tile / stage / swapAB / atom-layout field from
  `interface._tile_size_bwd_sm90(D, D, causal, False)`, num_threads = (num_wg + 1) * 128,
  V_in_regs False, no score / mask mods. The inputs are fake cute tensors (symbolic sizes,
  16-byte-aligned symbolic strides; the DSL refuses CPU torch tensors as kernel arguments):
  q, k, v, dO, dK, dV (B, N, H, D) bf16, LSE·log2 e and dPsum (B, H, Nq_rounded) fp32, the
  flat dQ accumulator (B, H, Nq_rounded · D) fp32.
- "ours": the shipped config (`bwd_configs.bwd_config_for(D, bf16, causal)`), or `--variant`
  NAME of benchmarks/fa3_bwd_variants.py, through `bwd_host.compile_backward`.
- "fa4_pre" / "fa4_post" and "ours_pre" / "ours_post" (unless --no-prepost): the pre- and
  postprocess kernels of both (FA4's `_compile_bwd_preprocess` / `_compile_bwd_postprocess`
  with the keys its interface uses at this shape; ours `bwd_prepost.compile_preprocess` /
  `compile_postprocess` with the shipped keys).

Each cubin is disassembled with Triton's nvdisasm (benchmarks.fa3_bwd_sass.disassemble) and the
largest function parsed (fa3_bwd_sass.parse_sass). Three loops are found as fa3_bwd_sass finds
them (a conditional backward branch; of those holding the marker, the one holding the most, then
the shortest): the MMA warpgroups' row-block loop (HGMMA), the producer's (UTMALDG) and the dQ
writer's (UBLKRED). An instruction of a loop is "conditional" when a forward branch inside the
loop jumps over it (mbarrier retries, lane-0 sections, an edge-block mask) and "always"
otherwise; the tables count the always path, per warp and row block.

Printed: the kernels' facts side by side (tile, stages, threads, ptxas registers and spills,
the highest register in the SASS, setmaxnreg values, the shared-storage struct's bytes), each
loop by finer instruction class (HGMMA by GEMM / shape / A source, MUFU.EX2, FFMA, FMUL, FADD,
FSEL, FSETP, F2FP, SHFL, LDS.64, STSM, STS.128, BAR.SYNC, BAR.ARV, SYNCS waits and arrives,
WARPGROUP.ARRIVE / DEPBAR, MEMBAR, FENCE, bulk copies and reduces, integer, moves, branches),
the MMA loop's issue order (GEMM groups, waits, barriers, fences and the maths between them),
the classes that differ most, and the pre/postprocess kernels' registers and instruction
counts. `--listing mma|producer|dq_writer` also prints both loops.

FA4 is imported from an installed flash_attn if there is one, else from the wheels in .gpu/
(flash_attn_4-4.0.0b36 and quack_kernels-0.6.5, unzipped into $TMPDIR/fa4 and $TMPDIR/quack on
first use; `--wheel-dir` elsewhere). flash_attn.cute imports einops for test helpers only: where
einops is not installed a stand-in module is registered. Lab code: never imported by flashsuite.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from benchmarks.fa4_sass_compare import (
    capture_storage,
    fa4_setup,
    is_move,
    require_fa4,
    setmaxnreg,
    work_folder,
)

REPO = Path(__file__).resolve().parents[1]
FA4_WHEEL = "flash_attn_4-4.0.0b36-py3-none-any.whl"
QUACK_WHEEL = "quack_kernels-0.6.5-py3-none-any.whl"
MAIN = ("fa4", "ours")
PREPOST = ("fa4_pre", "ours_pre", "fa4_post", "ours_post")
ROLES = {"mma": "HGMMA", "producer": "UTMALDG", "dq_writer": "UBLKRED"}

# Instruction classes, in print order (`opclass`); HGMMA rows are added per GEMM at run time.
CLASSES = (
    "MUFU.EX2",
    "MUFU other",
    "FFMA",
    "FMUL",
    "FADD",
    "FMNMX",
    "FSEL",
    "FSETP",
    "F2FP (pack)",
    "F2F/I2F/F2I",
    "SHFL",
    "LDS",
    "LDSM",
    "STS",
    "STSM",
    "LDG/STG/RED/ATOM",
    "UTMALDG",
    "UBLKCP",
    "UBLKRED",
    "UTMASTG",
    "UTMA other",
    "SYNCS wait",
    "SYNCS arrive",
    "BAR.SYNC",
    "BAR.ARV",
    "MEMBAR",
    "FENCE",
    "DEPBAR (bulk)",
    "WARPGROUP.ARRIVE",
    "WARPGROUP.DEPBAR",
    "R2UR",
    "int uniform",
    "int vector",
    "ISETP/UISETP/PLOP3",
    "SEL/USEL",
    "MOV/UMOV/S2R/LDC",
    "BRA/BSSY/BSYNC",
    "ELECT/VOTE",
    "other",
)
# What the MMA loop's issue-order lines sum between events.
MATH = (
    "MUFU.EX2",
    "FFMA",
    "FMUL",
    "FADD",
    "FSEL",
    "FSETP",
    "F2FP (pack)",
    "SHFL",
    "LDS",
    "STSM",
    "STS",
)
_INT_VECTOR = frozenset(
    {"IMAD", "IADD3", "LOP3", "SHF", "LEA", "VIADD", "PRMT", "IABS", "IMNMX", "VIMNMX", "SGXT"}
    | {"BMSK", "POPC", "FLO", "IADD", "LOP", "SHL", "SHR", "BREV", "IMUL", "VIADDMNMX", "IDP"}
)
_MOVES = frozenset({"MOV", "UMOV", "CS2R", "S2R", "S2UR", "ULDC", "LDC", "MOVM", "NOP"})
_HGMMA = re.compile(r"HGMMA\.(\d+)\s*x(\d+)x(\d+)")


def opclass(ins) -> str:
    """The class (CLASSES, or "HGMMA") of one fa3_bwd_sass.Insn."""
    op, base = ins.op, ins.base
    if base == "HGMMA":
        return "HGMMA"
    if base == "MUFU":
        return "MUFU.EX2" if op.startswith("MUFU.EX2") else "MUFU other"
    if base in ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "SHFL", "R2UR", "LDSM", "STSM"):
        return base
    if base == "F2FP":
        return "F2FP (pack)"
    if base in ("F2F", "I2F", "F2I", "I2FP", "F2IP", "FRND"):
        return "F2F/I2F/F2I"
    if base in ("LDS", "STS"):
        return base
    if base in ("LDG", "STG", "RED", "REDG", "ATOM", "ATOMG", "ATOMS", "LD", "ST"):
        return "LDG/STG/RED/ATOM"
    if base in ("UTMALDG", "UBLKCP", "UBLKRED", "UTMASTG"):
        return base
    if base.startswith("UTMA"):
        return "UTMA other"
    if base == "SYNCS":
        return "SYNCS arrive" if ".ARRIVE" in op else "SYNCS wait"
    if base == "BAR":
        return "BAR.ARV" if ".ARV" in op else "BAR.SYNC"
    if base in ("MEMBAR", "FENCE"):
        return base
    if base == "DEPBAR":
        return "DEPBAR (bulk)"
    if base == "WARPGROUP":
        return "WARPGROUP.DEPBAR" if "DEPBAR" in op else "WARPGROUP.ARRIVE"
    if base in ("ISETP", "UISETP", "PLOP3", "UPLOP3", "P2R", "R2P"):
        return "ISETP/UISETP/PLOP3"
    if base in ("SEL", "USEL"):
        return "SEL/USEL"
    if base in ("BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "BREAK", "WARPSYNC"):
        return "BRA/BSSY/BSYNC"
    if base in ("ELECT", "VOTE", "VOTEU"):
        return "ELECT/VOTE"
    if is_move(ins, _MOVES):
        return "MOV/UMOV/S2R/LDC"
    if base in _INT_VECTOR:
        return "int vector"
    if base.startswith("U"):
        return "int uniform"
    return "other"


# --------------------------------------------------------------------------- building


def _fa4_config(head_dim: int, causal: bool):
    from flash_attn.cute.interface import _tile_size_bwd_sm90

    return _tile_size_bwd_sm90(head_dim, head_dim, causal, False)


def build_fa4(head_dim: int, causal: bool) -> tuple:
    """(compiled, ptxas log, facts) of FA4's SM90 backward kernel as its interface sets it up."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.utils import AuxData

    from benchmarks import fa3_probe as probe

    cfg = _fa4_config(head_dim, causal)
    num_threads = (cfg.num_wg + 1) * 128
    kernel = FlashAttentionBackwardSm90(
        cutlass.BFloat16,
        head_dim,
        head_dim,
        1,  # qhead_per_kvhead
        causal,
        is_local=False,
        deterministic=False,
        tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size,
        Q_stage=cfg.num_stages_Q,
        dO_stage=cfg.num_stages_dO,
        PdS_stage=cfg.num_stages_PdS,
        SdP_swapAB=cfg.SdP_swapAB,
        dKV_swapAB=cfg.dKV_swapAB,
        dQ_swapAB=cfg.dQ_swapAB,
        AtomLayoutMSdP=cfg.AtomLayoutMSdP,
        AtomLayoutNdKV=cfg.AtomLayoutNdKV,
        AtomLayoutMdQ=cfg.AtomLayoutMdQ,
        num_threads=num_threads,
        V_in_regs=False,
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        has_aux_tensors=False,
        q_subtile_factor=1,
        dQ_single_wg=cfg.dQ_single_wg,
    )
    storages = capture_storage(kernel)
    b, nq, nk, h, nq_pad, nq_acc = (cute.sym_int() for _ in range(6))

    def bnhd(n):
        stride = (*(cute.sym_int64(divisibility=8) for _ in range(3)), 1)
        return cute.runtime.make_fake_tensor(
            cutlass.BFloat16, (b, n, h, head_dim), stride=stride, assumed_align=16
        )

    def f32(n):
        stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1)
        return cute.runtime.make_fake_tensor(
            cutlass.Float32, (b, h, n), stride=stride, assumed_align=16
        )

    q, k, v, do, dk, dv = bnhd(nq), bnhd(nk), bnhd(nk), bnhd(nq), bnhd(nk), bnhd(nk)
    lse_log2, dpsum, dq_accum = f32(nq_pad), f32(nq_pad), f32(nq_acc)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    # as interface._flash_attn_bwd: ..., softmax_scale, cu_seqlens_q/k, seqused_q/k, window
    # left/right, dQ/dK/dV semaphores, aux, block-sparse tensors, cu_total_m_blocks_k, stream
    args = (q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv, cutlass.Float32(head_dim**-0.5))
    args += (*[None] * 9, AuxData(None, None), None, None, stream)
    compiled, log = probe._capture_fd2(
        lambda: cute.compile(kernel, *args, options="--enable-tvm-ffi")
    )
    facts = {
        "config": {
            "tile_m": cfg.m_block_size,
            "tile_n": cfg.n_block_size,
            "Q_stages (Q + LSE ring)": cfg.num_stages_Q,
            "dO_stages (dO + dPsum ring)": cfg.num_stages_dO,
            "PdS_stages": cfg.num_stages_PdS,
            "SdP_swapAB": cfg.SdP_swapAB,
            "dKV_swapAB": cfg.dKV_swapAB,
            "dQ_swapAB": cfg.dQ_swapAB,
            "AtomLayoutMSdP/NdKV/MdQ": (
                cfg.AtomLayoutMSdP,
                cfg.AtomLayoutNdKV,
                cfg.AtomLayoutMdQ,
            ),
            "num_wg_mma": cfg.num_wg,
            "dQ_single_wg": cfg.dQ_single_wg,
            "mma_dkv_is_rs": kernel.mma_dkv_is_rs,
            "shuffle_LSE": kernel.shuffle_LSE,
            "launch": "use_pdl=True (loader waits with griddepcontrol.wait before LSE)",
        },
        "threads": num_threads,
        "tile": f"{cfg.m_block_size}x{cfg.n_block_size}",
        "stages": f"Q {cfg.num_stages_Q} (+LSE), dO {cfg.num_stages_dO} (+dPsum), "
        f"PdS {cfg.num_stages_PdS}",
        "smem_bytes": storages[-1].__sizeof__() if storages else None,
    }
    return compiled, log, facts


def build_ours(head_dim: int, causal: bool, variant_name: str | None, changes: list[str]) -> tuple:
    """(compiled, ptxas log, facts) of our backward: the shipped config or a named variant, each
    FIELD=VALUE of `changes` (Python literals) replaced in it. bwd_can_implement is not asked
    (compile_backward does not ask it either): a change may build what dispatch refuses."""
    import ast
    import dataclasses

    import torch

    from benchmarks import fa3_probe as probe
    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.fa3 import bwd_host
    from flashsuite.fa3.bwd_configs import bwd_config_for

    cfg = (
        variant(variant_name) if variant_name else bwd_config_for(head_dim, torch.bfloat16, causal)
    )
    fields = {}
    for c in changes:
        k, _, v = c.partition("=")
        try:
            fields[k.strip()] = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            fields[k.strip()] = v.strip()
    cfg = dataclasses.replace(cfg, **fields)
    storages: list = []
    check = bwd_host.check_storage

    def capture(kernel, estimate, what):
        storages.append(kernel.storage.__sizeof__())
        return check(kernel, estimate, what)

    bwd_host.check_storage = capture  # this process only: records the struct's size
    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    key = bwd_host.BwdCompileKey(torch.bfloat16, head_dim, causal, cfg, tvm_ffi=tvm)
    compiled, log = probe._capture_fd2(lambda: bwd_host.compile_backward(key))
    do_stages = cfg.do_stages or cfg.stages
    ring = "one ring (Q, dO, LSE, D)" if not cfg.do_stages else f"dO {do_stages}"
    facts = {
        "config": {
            "variant": (variant_name or "shipped") + "".join(f" {c}" for c in changes),
            **dataclasses.asdict(cfg),
        },
        "threads": 128 * (cfg.num_mma_wgs + 1),
        "tile": f"{cfg.tile_m}x{cfg.tile_n}",
        "stages": f"Q/dO {cfg.stages}: {ring}, dS {cfg.ds_stages}",
        "smem_bytes": storages[-1] if storages else None,
    }
    return compiled, log, facts


def build_prepost(which: str, head_dim: int, causal: bool, variant_name: str | None) -> tuple:
    """(compiled, ptxas log, facts) of a pre/postprocess kernel of FA4 or ours."""
    import torch

    from benchmarks import fa3_probe as probe

    if which.startswith("fa4"):
        import cutlass
        from flash_attn.cute import interface as fi

        cfg = _fa4_config(head_dim, causal)
        if which == "fa4_pre":
            # dtype, hdim, hdim_v, m_block, cu_seqlens_q, seqused_q, dlse, dq_accum, scale_p,
            # lse_log2, use_padded_offsets, nheads_major, pack_gqa, qhead_per_kvhead,
            # nheads_kv, cu_total_m_blocks, hdim_multiple_of, o_lo
            key = (cutlass.BFloat16, head_dim, head_dim, cfg.m_block_size, False, False, False)
            key += (True, False, True, True, False, False, 1, 1, False, 32, False)
            build = lambda: fi._compile_bwd_preprocess(*key)
            what = "preprocess: dPsum, LSE·log2 e, zero dQaccum"
        else:
            threads = 128 if cfg.dQ_single_wg else cfg.num_wg * 128
            # dtype, hdim, block_size, num_threads, atom_layout, swap_ab, cu_seqlens_q,
            # seqused_q, 2cta, cluster_size, arch, cu_total_m_blocks, sink dtype, hdim mult.
            key = (cutlass.BFloat16, head_dim, cfg.m_block_size, threads, cfg.AtomLayoutMdQ)
            key += (cfg.dQ_swapAB, False, False, False, 1, 90, False, None, 32, None)
            build = lambda: fi._compile_bwd_postprocess(*key)
            what = f"postprocess: dQaccum · scale -> bf16, {threads} threads"
    else:
        from benchmarks.fa3_bwd_variants import variant
        from flashsuite.fa3 import bwd_prepost as bp
        from flashsuite.fa3.bwd_configs import bwd_config_for

        cfg = (
            variant(variant_name)
            if variant_name
            else bwd_config_for(head_dim, torch.bfloat16, causal)
        )
        try:
            import tvm_ffi  # noqa: F401

            tvm = True
        except ImportError:
            tvm = False
        if which == "ours_pre":
            pkey = bp.PreprocessKey(torch.bfloat16, head_dim, head_dim, pdl=cfg.pdl, tvm_ffi=tvm)
            build = lambda: bp.compile_preprocess(pkey)
            what = "preprocess: D = rowsum(dO·O), LSE·log2 e, zero the tiled dQ accumulator"
        else:
            swz = bp.dq_swizzle(cfg.tile_m, head_dim, cfg.num_mma_wgs, cfg.dq_split)
            pkey = bp.PostprocessKey(
                torch.bfloat16, head_dim, cfg.tile_m, cfg.scale_out, swz, pdl=cfg.pdl, tvm_ffi=tvm
            )
            build = lambda: bp.compile_postprocess(pkey)
            what = "postprocess: dq_from_tiles (tiled fp32 -> bf16)"
    compiled, log = probe._capture_fd2(build)
    return compiled, log, {"what": what}


def build(
    name: str, head_dim: int, causal: bool, out: Path, wheel_dir: Path, var, changes: list[str]
) -> None:
    """Compile one kernel; write out/NAME.sass and out/NAME.json (facts and ptxas -v)."""
    from benchmarks import fa3_probe as probe  # first: sets CUTE_DSL_* before cutlass's import

    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"  # after fa3_probe, which sets "ptx"
    if name.startswith("fa4"):
        fa4_setup(wheel_dir)
    if name == "fa4":
        compiled, log, facts = build_fa4(head_dim, causal)
    elif name == "ours":
        compiled, log, facts = build_ours(head_dim, causal, var, changes)
    else:
        compiled, log, facts = build_prepost(name, head_dim, causal, var)
    from benchmarks.fa3_bwd_sass import disassemble

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.sass").write_text(disassemble(compiled.__cubin__))
    facts.update(probe.parse_ptxas(log))
    (out / f"{name}.json").write_text(json.dumps(facts, indent=1, default=str))


# --------------------------------------------------------------------------- analysis


def _path(insns, labels, loop):
    """(instruction, conditional) pairs of a loop."""
    from benchmarks.fa3_bwd_sass import conditional_mask

    head, tail = loop
    return list(
        zip(insns[head : tail + 1], conditional_mask(insns, labels, head, tail), strict=True)
    )


def gemm_groups(path) -> list[dict]:
    """The HGMMA groups of a loop's always path (consecutive HGMMAs up to one with gsb0), each
    named by its place: SS without transposes are S then dP (keys on M when SdP_swapAB), RS
    are dV then dK, SS with a transposed operand is dQ (dQ^T when dQ_swapAB)."""
    groups: list[dict] = []
    cur: dict | None = None
    for ins, cond in path:
        if cond or ins.base != "HGMMA":
            continue
        # the parser splits "HGMMA.64x80x16.F32.BF16 R192, ..." after "HGMMA.64"
        full = ins.op + ins.args
        m = _HGMMA.search(full)
        operands = full.split(None, 1)[1] if len(full.split(None, 1)) > 1 else ""
        rs = re.match(r"R\d+, R\d+, gdesc", operands) is not None
        tn = ".tnspA" in full, ".tnspB" in full
        if cur is None:
            shape = f"m{m.group(1)}n{m.group(2)}k{m.group(3)}" if m else "?"
            kind = "RS" if rs else "SS"
            trans = ("A" if tn[0] else "") + ("B" if tn[1] else "")
            acc = operands.split(",")[0].strip()
            cur = {"shape": shape, "src": kind, "tnsp": trans, "acc": acc, "n": 0, "start": ins}
        cur["n"] += 1
        if "gsb0" in ins.args:
            groups.append(cur)
            cur = None
    if cur is not None:
        groups.append(cur)
    ss, rs_names = iter(["S", "dP"]), iter(["dV", "dK"])
    for g in groups:
        if g["src"] == "RS":
            g["name"] = next(rs_names, "RS?")
        elif g["tnsp"]:
            g["name"] = "dQ"
        else:
            g["name"] = next(ss, "SS?")
        g["label"] = f"{g['name']}: {g['src']} {g['shape']}" + (
            f".tnsp{g['tnsp']}" if g["tnsp"] else ""
        )
    return groups


def loop_table(path) -> dict:
    """Class counts of a loop's always path (HGMMA split per GEMM group), the conditional
    path's total and its classes."""
    always: Counter = Counter()
    cond: Counter = Counter()
    for ins, c in path:
        if ins.base == "HGMMA":
            continue
        (cond if c else always)[opclass(ins)] += 1
    for g in gemm_groups(path):
        always[f"HGMMA {g['label']}"] += g["n"]
    always_total = sum(always.values())
    return {
        "always": dict(always),
        "always_total": always_total,
        "conditional": dict(cond),
        "conditional_total": sum(cond.values()),
        "span": f"{path[0][0].addr:#06x}-{path[-1][0].addr:#06x}" if path else "",
    }


def _event(ins, gemm_at: dict) -> str | None:
    """The name in issue order of a synchronising instruction (None for the rest)."""
    if id(ins) in gemm_at:
        g = gemm_at[id(ins)]
        return f"issue {g['label']} x{g['n']} (acc {g['acc']})"
    c = opclass(ins)
    if c == "HGMMA":
        return ""  # the rest of a group
    if c == "WARPGROUP.DEPBAR":
        return f"WARPGROUP.DEPBAR.LE {ins.args.split(',')[-1].strip()}"
    if c == "WARPGROUP.ARRIVE":
        return "WARPGROUP.ARRIVE"
    if c in ("SYNCS wait", "SYNCS arrive"):
        bar = re.search(r"\[([^\]]+)\]", ins.args)
        who = f" ({ins.pred})" if ins.pred else ""
        return f"{c} [{bar.group(1) if bar else '?'}]{who}"
    if c in ("BAR.SYNC", "BAR.ARV"):
        return f"{c} {ins.args.strip()}"
    if c in ("MEMBAR", "FENCE"):
        return ins.op
    if c in ("UBLKRED", "UBLKCP", "UTMALDG", "UTMASTG", "DEPBAR (bulk)"):
        return f"{ins.op} {ins.args.strip()}"
    return None


def issue_order(path) -> list[str]:
    """The always path as events, with the maths between consecutive events on one line."""
    groups = gemm_groups(path)
    gemm_at = {id(g["start"]): g for g in groups}
    lines: list[str] = []
    math: Counter = Counter()
    other = 0

    def flush():
        nonlocal other
        if math or other:
            body = ", ".join(f"{k} {math[k]}" for k in MATH if math[k])
            lines.append(f"    + {body}{', ' if body else ''}{other} other")
            math.clear()
            other = 0

    for ins, cond in path:
        if cond:
            continue
        ev = _event(ins, gemm_at)
        if ev is None:
            c = opclass(ins)
            if c in MATH:
                math[c] += 1
            else:
                other += 1
            continue
        if ev == "":
            continue
        flush()
        lines.append(ev)
    flush()
    lines.append("back-edge")
    return lines


def windows(path) -> dict[str, dict]:
    """Always-path instructions (HGMMAs excluded) of the MMA loop's stretches, by class: the
    loop top (from the last wait to the back-edge, then from the loop head to S's issue: the
    tensor pipe has nothing of this warpgroup queued), S issued -> dP issued, dP issued -> S
    retired, S retired -> dP retired (the exponentials, dP in flight), dP retired -> dV issued
    (dS: nothing of this warpgroup queued), dV issued -> dQ issued (fences, the P/dS barrier),
    and dQ issued -> the last wait."""
    live = [x for x, c in path if not c]
    first = {}
    for g in gemm_groups(path):
        first.setdefault(g["name"], live.index(g["start"]))
    waits = [i for i, x in enumerate(live) if opclass(x) == "WARPGROUP.DEPBAR"]
    need = ("S", "dP", "dV", "dQ")
    if not all(k in first for k in need) or not waits:
        return {}
    after_dp = [w for w in waits if w > first["dP"]]
    if len(after_dp) < 2:
        return {}
    w_s, w_dp = after_dp[0], after_dp[1]
    spans = {
        "loop top (last wait -> S issue)": [*range(waits[-1] + 1, len(live)), *range(first["S"])],
        "S issue -> dP issue": range(first["S"], first["dP"]),
        "dP issue -> S retired": range(first["dP"], w_s),
        "S retired -> dP retired (exp)": range(w_s, w_dp),
        "dP retired -> dV issue (dS)": range(w_dp, first["dV"]),
        "dV issue -> dQ issue": range(first["dV"], first["dQ"]),
        "dQ issue -> last wait": range(first["dQ"], waits[-1] + 1),
    }
    out = {}
    for name, idx in spans.items():
        cls = Counter(opclass(live[i]) for i in idx if live[i].base != "HGMMA")
        out[name] = {"total": sum(cls.values()), **{k: cls[k] for k in MATH if cls[k]}}
    return out


def analyse(text: str, facts: dict, listing: str | None) -> dict:
    """Everything printed for one main-kernel build."""
    from benchmarks.fa3_bwd_sass import find_loop, parse_sass

    insns, labels = parse_sass(text)
    res = {
        "facts": facts,
        "max_reg": max((int(r) for r in re.findall(r"\bR(\d+)\b", text)), default=None),
        "setmaxnreg": setmaxnreg(text),
        "kernel_insns": len(insns),
        "kernel_hgmma": sum(x.base == "HGMMA" for x in insns),
        "loops": {},
        "order": [],
        "listing": "",
    }
    for role, marker in ROLES.items():
        loop = find_loop(insns, labels, marker)
        if loop is None:
            res["loops"][role] = None
            continue
        path = _path(insns, labels, loop[:2])
        res["loops"][role] = loop_table(path)
        if role == "mma":
            res["order"] = issue_order(path)
            res["windows"] = windows(path)
            res["gemms"] = [
                {k: g[k] for k in ("name", "src", "shape", "tnsp", "acc", "n")}
                for g in gemm_groups(path)
            ]
        if role == listing:
            res["listing"] = "\n".join(
                f"{x.addr:06x} {'c' if c else ' '} {opclass(x):20s} {x.pred:6s} {x.op} {x.args}"
                for x, c in path
            )
    return res


def analyse_prepost(text: str, facts: dict) -> dict:
    """Registers and the whole kernel's instruction classes of a pre/postprocess kernel."""
    from benchmarks.fa3_bwd_sass import parse_sass

    insns, _ = parse_sass(text)
    return {
        "what": facts.get("what"),
        "registers": facts.get("registers"),
        "spills": f"{facts.get('spill_stores')}/{facts.get('spill_loads')}",
        "insns": len(insns),
        "classes": dict(Counter(opclass(x) for x in insns)),
        "ops": dict(
            Counter(
                x.op
                for x in insns
                if x.base in ("LDG", "STG", "LDS", "STS", "SHFL", "RED", "REDG", "ATOMG", "LDGSTS")
                or x.base in ("UBLKCP", "UTMALDG", "UTMASTG", "UBLKRED", "LDSM", "STSM")
            )
        ),
    }


# --------------------------------------------------------------------------- report


def _row(name: str, a, b, w: int = 16, diff: bool = False) -> str:
    extra = f"{b - a:>+{w}d}" if diff and isinstance(a, int) and isinstance(b, int) else ""
    return f"{name:44s}{a!s:>{w}s}{b!s:>{w}s}{extra}"


def report(fa4: dict, ours: dict, head_dim: int, causal: bool) -> str:
    """The side-by-side tables."""
    mode = "causal" if causal else "non-causal"
    var = ours["facts"]["config"].get("variant")
    lines = [f"=== bf16 D {head_dim} {mode}: FA4 4.0.0b36 SM90 backward vs ours ({var}) ===", ""]
    lines.append(f"{'':44s}{'FA4':>16s}{'ours':>16s}{'ours-FA4':>16s}")
    fa, fo = fa4["facts"], ours["facts"]
    lines.append(_row("tile (rows x keys)", fa["tile"], fo["tile"]))
    lines.append(_row("threads per CTA", fa["threads"], fo["threads"]))
    lines.append(_row("ptxas registers (launch)", fa.get("registers"), fo.get("registers")))
    lines.append(_row("highest register in SASS", fa4["max_reg"], ours["max_reg"]))
    lines.append(
        _row(
            "spill stores/loads (B)",
            f"{fa.get('spill_stores')}/{fa.get('spill_loads')}",
            f"{fo.get('spill_stores')}/{fo.get('spill_loads')}",
        )
    )
    for k, name in (("dealloc", "setmaxnreg producer WG"), ("alloc", "setmaxnreg MMA WGs")):
        lines.append(_row(name, fa4["setmaxnreg"][k], ours["setmaxnreg"][k]))
    lines.append(_row("shared storage (B)", fa["smem_bytes"], fo["smem_bytes"], diff=True))
    lines.append(
        _row("SASS instructions (kernel)", fa4["kernel_insns"], ours["kernel_insns"], 16, True)
    )
    lines.append(f"  FA4 stages:  {fa['stages']}")
    lines.append(f"  ours stages: {fo['stages']}")
    for role in ROLES:
        a, b = fa4["loops"].get(role), ours["loops"].get(role)
        lines += ["", f"{role} loop, per warp and row block (always path)"]
        if a is None or b is None:
            lines.append(f"  (loop not found: FA4 {a is not None}, ours {b is not None})")
            continue
        lines.append(_row("  span", a["span"], b["span"]))
        order = ("S", "dP", "dV", "dQ", "dK")
        hg = sorted(
            {k for k in (*a["always"], *b["always"]) if k.startswith("HGMMA")},
            key=lambda k: (next((i for i, n in enumerate(order) if f" {n}:" in k), 9), k),
        )
        for c in (*hg, *CLASSES):
            if a["always"].get(c) or b["always"].get(c):
                lines.append(
                    _row("  " + c, a["always"].get(c, 0), b["always"].get(c, 0), diff=True)
                )
        lines.append(_row("  total (always)", a["always_total"], b["always_total"], diff=True))
        lines.append(
            _row(
                "  conditional (skipped)", a["conditional_total"], b["conditional_total"], 16, True
            )
        )
        for who, r in (("FA4", a), ("ours", b)):
            if r["conditional"]:
                body = ", ".join(f"{k} {v}" for k, v in sorted(r["conditional"].items()))
                lines.append(f"    {who} conditional: {body}")
    a, b = fa4["loops"].get("mma"), ours["loops"].get("mma")
    if a and b:
        lines += ["", "MMA loop: largest differences (ours - FA4, always path)"]
        keys = {*a["always"], *b["always"]}
        deltas = sorted(
            ((b["always"].get(k, 0) - a["always"].get(k, 0), k) for k in keys),
            key=lambda t: (-abs(t[0]), t[1]),
        )
        for d, k in deltas:
            if d:
                lines.append(f"  {d:+5d}  {k}")
    wa, wb = fa4.get("windows") or {}, ours.get("windows") or {}
    if wa and wb:
        lines += ["", "MMA loop stretches: instructions per warp (always path, no HGMMA)"]
        for k in wa:
            lines.append(_row("  " + k, wa[k]["total"], wb.get(k, {}).get("total"), diff=True))
        for k in wa:
            for who, w in (("FA4", wa[k]), ("ours", wb.get(k, {}))):
                body = ", ".join(f"{c} {w[c]}" for c in MATH if w.get(c))
                lines.append(f"    {who:4s} {k}: {body or '-'}")
    for name, r in (("FA4", fa4), ("ours", ours)):
        lines += ["", f"{name} MMA loop in issue order (always path):"]
        lines += ["  " + t for t in r["order"]]
    return "\n".join(lines)


def report_prepost(res: dict) -> str:
    lines = ["", "pre/postprocess kernels (whole kernel)"]
    lines.append(f"{'':44s}{'registers':>12s}{'spills':>10s}{'SASS':>8s}  memory ops")
    for name in PREPOST:
        r = res.get(name)
        if r is None:
            continue
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items()))
        lines.append(
            f"{name + ': ' + (r['what'] or ''):44.44s}{r['registers']!s:>12s}{r['spills']:>10s}"
            f"{r['insns']:>8d}  {ops}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variant", help="ours: a named variant (fa3_bwd_variants) for the shipped")
    ap.add_argument(
        "--set", action="append", default=[], help="ours: FIELD=VALUE of BwdConfig (repeat)"
    )
    ap.add_argument("--keep", help="write the builds' .sass/.json here")
    ap.add_argument("--from", dest="from_dir", help="analyse the builds kept in this folder")
    ap.add_argument("--no-prepost", action="store_true", help="skip the pre/postprocess kernels")
    ap.add_argument("--listing", choices=sorted(ROLES), help="also print this loop of both")
    ap.add_argument("--wheel-dir", default=str(REPO / ".gpu"), help="where the FA4 wheels are")
    ap.add_argument("--json", help="write the analysis here")
    ap.add_argument("--build", choices=MAIN + PREPOST, help=argparse.SUPPRESS)  # child
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.build:
        build(
            args.build,
            args.head_dim,
            args.causal,
            Path(args.out),
            Path(args.wheel_dir),
            args.variant,
            args.set,
        )
        return 0

    names = MAIN if args.no_prepost else MAIN + PREPOST
    folder, tmp = work_folder(args.from_dir, args.keep, "fa4_bwd_sass_")
    if not args.from_dir:
        require_fa4("fa4_bwd_sass_compare", args.wheel_dir)
        for name in names:
            cmd = [sys.executable, "-m", "benchmarks.fa4_bwd_sass_compare", "--build", name]
            cmd += ["--head-dim", str(args.head_dim), "--out", str(folder)]
            cmd += ["--wheel-dir", args.wheel_dir] + (["--causal"] if args.causal else [])
            cmd += ["--variant", args.variant] if args.variant else []
            cmd += [f"--set={c}" for c in args.set]
            subprocess.run(cmd, check=True, cwd=REPO)
    res: dict = {}
    for name in names:
        sass, js = folder / f"{name}.sass", folder / f"{name}.json"
        if not sass.exists():
            continue
        facts = json.loads(js.read_text())
        text = sass.read_text()
        res[name] = (
            analyse(text, facts, args.listing) if name in MAIN else analyse_prepost(text, facts)
        )
    if "fa4" not in res or "ours" not in res:
        sys.exit(f"fa4_bwd_sass_compare: no fa4/ours builds in {folder}")
    print(report(res["fa4"], res["ours"], args.head_dim, args.causal))
    print(report_prepost(res))
    if args.listing:
        for name in MAIN:
            print(f"\n--- {name}: {args.listing} loop ('c': conditional)")
            print(res[name]["listing"])
    if args.json:
        for r in res.values():
            r.pop("listing", None)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
