"""FA4's CuTe-DSL SM90 forward beside ours, from the SASS: both compiled for sm_90a on the CPU.

    python -m benchmarks.fa4_sass_compare                       # bf16 non-causal, D 64 and 128
    python -m benchmarks.fa4_sass_compare --head-dim 128 --keep /tmp/cmp --listing
    python -m benchmarks.fa4_sass_compare --from /tmp/cmp       # re-read the kept builds
    python -m benchmarks.fa4_sass_compare --json out.json
    python -m benchmarks.fa4_sass_compare --head-dim 128 --causal --set split_loops=1

For each head dim two kernels are built, each in its own process (`--build`, which sets the
CUTE_DSL_* variables through benchmarks.fa3_probe before cutlass is imported): ours with the
shipped config (configs.get_config(D, bf16, causal)), and FA4's
FlashAttentionForwardSm90 (flash-attn-4 4.0.0b36, pure Python) with the configuration its
interface (flash_attn/cute/interface.py) picks on SM90 for bf16 MHA, non-causal unless
`--causal` (then both causal; the steady loop is then the unmasked one): tile and
flags from `_tile_size_fwd_sm90`, num_stages=2, Q_in_regs=False, pack_gqa=False and no LSE
(`flash_attn_func` allocates none unless an input requires grad or return_lse; dispatch/bench
times the forward that way: `--fa4-lse` builds the LSE-writing kernel instead). The inputs
are fake tensors with symbolic shapes and 16-byte-aligned symbolic strides, as in
fa3/compile.py (the DSL refuses CPU torch tensors as kernel arguments). Each cubin is
disassembled with Triton's nvdisasm (fa3_bwd_sass.disassemble).

Printed per head dim, side by side: ptxas' registers and spills, the setmaxnreg values
(DEALLOC: producer, ALLOC: consumers), the storage struct's shared-memory bytes; the
consumer's steady-state loop (the conditional backward branch whose body holds both the
Q·Kᵀ (SS) and P·V (RS) HGMMAs and no -INF select on its always path; of several, the one with
the most HGMMAs, then the shortest) by instruction class per K/V block and warp, counting only
what every unmasked iteration issues ("always": not jumped over by a forward branch of the
loop; the mbarrier retry paths and lane-0 sections are "conditional"); the producer's loop
(the shortest backward branch, conditional or not, whose body holds UTMALDG and no HGMMA);
the consumer loop's order of events (mbarrier waits and arrives, named barriers, wgmma
issue groups and DEPBAR waits, with the maths between them); and the maths each
`WARPGROUP.DEPBAR.LE gsb0, 0x1` wait has before the next 0x0 wait (what overlaps P·V).

FA4 is imported from the installed package if there is one, else from the wheels in .gpu/
(flash_attn_4-4.0.0b36 and quack_kernels-0.6.5, unzipped into $TMPDIR/fa4 and
$TMPDIR/quack on first use; `--wheel-dir` elsewhere). FA4's flash_attn.cute imports einops
for its test helpers only: where einops is not installed a stand-in module is registered.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FA4_WHEEL = "flash_attn_4-4.0.0b36-py3-none-any.whl"
QUACK_WHEEL = "quack_kernels-0.6.5-py3-none-any.whl"
BUILDS = ("fa4", "ours")

# Instruction classes of the comparison, in print order; `opclass` assigns them.
CLASSES = (
    "HGMMA Q·K (SS)",
    "HGMMA P·V (RS)",
    "MUFU.EX2",
    "MUFU other",
    "FMNMX",
    "FADD",
    "FMUL",
    "FFMA",
    "F2F/F2FP",
    "SHFL",
    "BAR named",
    "SYNCS wait",
    "SYNCS arrive",
    "TMA load (UTMALDG)",
    "WARPGROUP.ARRIVE",
    "WARPGROUP.DEPBAR",
    "branch/predicate",
    "int/addr vector",
    "int/addr uniform",
    "R2UR",
    "MOV/UMOV/S2R",
    "other",
)
MATH = ("MUFU.EX2", "FMNMX", "FADD", "FMUL", "FFMA", "F2F/F2FP", "SHFL")
_BRANCH_PRED = frozenset(
    {"BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "BREAK", "NANOSLEEP", "WARPSYNC"}
    | {"ISETP", "FSETP", "UISETP", "PLOP3", "UPLOP3", "VOTE", "VOTEU", "SEL", "USEL", "FSEL"}
    | {"P2R", "R2P", "ELECT"}
)
_INT_VECTOR = frozenset(
    {"IMAD", "IADD3", "LOP3", "SHF", "LEA", "VIADD", "PRMT", "IABS", "IMNMX", "VIMNMX", "SGXT"}
    | {"BMSK", "POPC", "FLO", "IADD", "LOP", "SHL", "SHR", "BREV", "IMUL", "VIADDMNMX"}
)
_MOVES = frozenset({"MOV", "UMOV", "CS2R", "S2R", "S2UR", "ULDC", "LDC", "MOVM"})
_RS = re.compile(r"\bR\d+, R\d+, gdesc")  # HGMMA with its A operand in registers


def is_move(ins, moves: frozenset) -> bool:
    """A register move: an opcode in `moves`, IMAD.MOV, or an IMAD of RZ · RZ + a value."""
    op, base = ins.op, ins.base
    return (
        base in moves
        or op.startswith("IMAD.MOV")
        or (op.startswith("IMAD") and re.match(r"R\d+, RZ, RZ, ", ins.args) is not None)
    )


def opclass(ins) -> str:
    """The class (CLASSES) of one fa3_bwd_sass.Insn."""
    op, base = ins.op, ins.base
    if base == "HGMMA":
        return "HGMMA P·V (RS)" if _RS.search(ins.args) else "HGMMA Q·K (SS)"
    if base == "MUFU":
        return "MUFU.EX2" if op.startswith("MUFU.EX2") else "MUFU other"
    if base in ("FMNMX", "FADD", "FMUL", "FFMA", "SHFL", "R2UR"):
        return base
    if base in ("F2F", "F2FP"):
        return "F2F/F2FP"
    if base == "BAR":
        return "BAR named"
    if base == "UTMALDG":
        return "TMA load (UTMALDG)"
    if base == "SYNCS":
        return "SYNCS arrive" if ".ARRIVE" in op else "SYNCS wait"
    if base == "WARPGROUP":
        return "WARPGROUP.DEPBAR" if "DEPBAR" in op else "WARPGROUP.ARRIVE"
    if base in _BRANCH_PRED:
        return "branch/predicate"
    if is_move(ins, _MOVES):
        return "MOV/UMOV/S2R"
    if base in _INT_VECTOR:
        return "int/addr vector"
    if base.startswith("U") and base not in ("UTMALDG", "UTMASTG", "UBLKCP", "UTMACMDFLUSH"):
        return "int/addr uniform"
    return "other"


# --------------------------------------------------------------------------- building


def fa4_setup(wheel_dir: Path) -> None:
    """Make `flash_attn.cute` importable: the unzipped wheels if present, else the installed
    package; a stand-in einops module where einops is missing. Exits with a message if FA4
    cannot be found."""
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for wheel, dest in ((QUACK_WHEEL, tmp / "quack"), (FA4_WHEEL, tmp / "fa4")):
        whl = wheel_dir / wheel
        if whl.exists() and not dest.exists():
            with zipfile.ZipFile(whl) as z:
                z.extractall(dest)
        if dest.exists():
            sys.path.insert(0, str(dest))
    if importlib.util.find_spec("einops") is None:
        stub = types.ModuleType("einops")  # flash_attn.cute.testing's reference helpers only

        def _absent(*_a, **_k):
            raise ImportError("einops is not installed (stand-in of benchmarks.fa4_sass_compare)")

        stub.rearrange = stub.repeat = _absent
        sys.modules["einops"] = stub
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("quack") is None:
        sys.exit(
            f"fa4_sass_compare: FA4 not found: install flash-attn-4==4.0.0b36 (and quack-kernels), "
            f"or put {FA4_WHEEL} and {QUACK_WHEEL} in {wheel_dir} (--wheel-dir)"
        )


def _fake_inputs(head_dim: int, lse: bool) -> tuple:
    """Fake bf16 q, k, v, out (B, N, H, D) with symbolic sizes and 16-byte-aligned symbolic
    strides, and a fake fp32 LSE (B, H, Nq) or None."""
    import cutlass
    import cutlass.cute as cute

    b, nq, nk, hq, hkv = (cute.sym_int() for _ in range(5))

    def strided(shape: tuple):
        stride = (*(cute.sym_int64(divisibility=8) for _ in range(3)), 1)
        return cute.runtime.make_fake_tensor(
            cutlass.BFloat16, shape, stride=stride, assumed_align=16
        )

    q, k, v = (
        strided((b, nq, hq, head_dim)),
        strided((b, nk, hkv, head_dim)),
        strided((b, nk, hkv, head_dim)),
    )
    o = strided((b, nq, hq, head_dim))
    lse_t = (
        cute.runtime.make_fake_compact_tensor(
            cutlass.Float32, (b, hq, nq), stride_order=(2, 1, 0), assumed_align=4
        )
        if lse
        else None
    )
    return q, k, v, o, lse_t


def capture_storage(kernel) -> list:
    """The shared-storage classes an FA4 kernel builds while it compiles (its
    `_get_shared_storage_cls` wrapped to record them), in a list filled as it compiles."""
    storages: list = []
    make_storage = kernel._get_shared_storage_cls

    def capture():
        cls = make_storage()
        storages.append(cls)
        return cls

    kernel._get_shared_storage_cls = capture
    return storages


def build_fa4(head_dim: int, lse: bool, wheel_dir: Path, causal: bool = False) -> tuple:
    """(compiled, ptxas log, facts) of FA4's SM90 forward as its interface configures it."""
    from benchmarks import fa3_probe as probe  # first: sets CUTE_DSL_* before cutlass's import

    fa4_setup(wheel_dir)
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.interface import _tile_size_fwd_sm90
    from flash_attn.cute.utils import AuxData

    cfg = _tile_size_fwd_sm90(head_dim, head_dim, causal, False)
    kernel = FlashAttentionForwardSm90(
        cutlass.BFloat16,
        head_dim,
        head_dim,
        1,  # qhead_per_kvhead
        is_causal=causal,
        is_local=False,
        pack_gqa=False,
        tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size,
        num_stages=2,  # as interface.py
        num_threads=384,
        Q_in_regs=False,
        intra_wg_overlap=cfg.intra_wg_overlap,
        mma_pv_is_rs=cfg.mma_pv_is_rs,
        mask_mod=None,
        score_mod=None,
        has_aux_tensors=False,
        q_subtile_factor=1,
        paged_kv_non_tma=False,
    )
    storages = capture_storage(kernel)
    q, k, v, o, lse_t = _fake_inputs(head_dim, lse)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    # (mQ, mK, mV, mO, mLSE, softmax_scale, cu_seqlens_q/k, seqused_q/k, page_table,
    #  window left/right, learnable_sink, block-sparse tensors, aux, cu_total_(splits_)m_blocks)
    args = (q, k, v, o, lse_t, cutlass.Float32(head_dim**-0.5), *[None] * 9, AuxData(None, None))
    compiled, log = probe._capture_fd2(
        lambda: cute.compile(kernel, *args, None, None, stream, options="--enable-tvm-ffi")
    )
    facts = {
        "config": {
            "tile_m": cfg.m_block_size,
            "tile_n": cfg.n_block_size,
            "num_stages": 2,
            "mma_pv_is_rs": cfg.mma_pv_is_rs,
            "intra_wg_overlap": cfg.intra_wg_overlap,
            "num_wg_mma": kernel.num_wg_mma,
            "use_scheduler_barrier": kernel.use_scheduler_barrier,
            "rescale_O_before_gemm": kernel.rescale_O_before_gemm,
            "lse": lse,
        },
        "smem_bytes": storages[-1].__sizeof__() if storages else None,
    }
    return compiled, log, facts


def build_ours(head_dim: int, changes: list[str], causal: bool = False) -> tuple:
    """(compiled, ptxas log, facts) of our shipped bf16 forward (causal or not), with each
    FIELD=VALUE of `changes` replaced in its config."""
    import dataclasses

    import torch

    from benchmarks import fa3_probe as probe  # build() imported it before cutlass
    from benchmarks.fa3_fwd_ab import parse_variant
    from flashsuite.fa3 import compile as fa3_compile
    from flashsuite.fa3.configs import get_config

    _, fields = parse_variant("set:" + ",".join(changes), table_ok=False)
    cfg = dataclasses.replace(get_config(head_dim, torch.bfloat16, causal), **fields)
    storages: list = []
    check = fa3_compile.check_storage

    def capture(kernel, estimate, what):
        storages.append(kernel.storage.__sizeof__())
        return check(kernel, estimate, what)

    fa3_compile.check_storage = capture  # in this process only: records the struct's size
    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    key = fa3_compile.CompileKey(torch.bfloat16, head_dim, causal, False, False, cfg, tvm_ffi=tvm)
    compiled, log = probe._capture_fd2(lambda: fa3_compile.compile_forward(key))
    facts = {
        "config": dataclasses.asdict(cfg),
        "smem_bytes": storages[-1] if storages else None,
    }
    return compiled, log, facts


def build(
    which: str,
    head_dim: int,
    out: Path,
    lse: bool,
    wheel_dir: Path,
    changes: list[str],
    causal: bool = False,
) -> None:
    """Compile one kernel and write out/<which>_d<D>.sass, .ptx and .json (ptxas facts)."""
    from benchmarks import fa3_probe as probe  # first: sets CUTE_DSL_* before cutlass's import

    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"  # after fa3_probe, which sets "ptx"
    if which == "fa4":
        compiled, log, facts = build_fa4(head_dim, lse, wheel_dir, causal)
    else:
        compiled, log, facts = build_ours(head_dim, changes, causal)
    from benchmarks.fa3_bwd_sass import disassemble

    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{which}_d{head_dim}{'_causal' if causal else ''}"
    stem.with_suffix(".sass").write_text(disassemble(compiled.__cubin__))
    stem.with_suffix(".ptx").write_text(getattr(compiled, "__ptx__", None) or "")
    facts.update(probe.parse_ptxas(log))
    stem.with_suffix(".json").write_text(json.dumps(facts, indent=1))


# --------------------------------------------------------------------------- analysis


def _backward_branches(insns, labels):
    """(branch index, target index, conditional) of every backward BRA with a label target."""
    from benchmarks.fa3_bwd_sass import _branches

    return [(i, t, c) for i, t, c in _branches(insns, labels) if t <= i]


def consumer_loop(insns, labels) -> tuple[int, int] | None:
    """(head, back-edge index) of the consumer's steady-state loop (module docstring)."""
    from benchmarks.fa3_bwd_sass import conditional_mask

    found = []
    for i, t, cond in _backward_branches(insns, labels):
        if not cond:
            continue
        body = insns[t : i + 1]
        kinds = {opclass(x) for x in body if x.base == "HGMMA"}
        if len(kinds) < 2:
            continue
        skipped = conditional_mask(insns, labels, t, i)
        masked = any(
            x.base == "FSEL" and "-INF" in x.args
            for x, sk in zip(body, skipped, strict=True)
            if not sk
        )
        n = sum(x.base == "HGMMA" for x in body)
        found.append((masked, -n, i - t, t, i))
    if not found:
        return None
    return min(found)[3], min(found)[4]


def producer_loop(insns, labels) -> tuple[int, int] | None:
    """(head, back-edge index) of the shortest loop holding UTMALDG and no HGMMA."""
    found = [
        (i - t, t, i)
        for i, t, _ in _backward_branches(insns, labels)
        if any(x.base == "UTMALDG" for x in insns[t : i + 1])
        and not any(x.base == "HGMMA" for x in insns[t : i + 1])
    ]
    return (min(found)[1], min(found)[2]) if found else None


def _hgmma_loops(insns, labels) -> int:
    """How many conditional backward branches close a body holding both HGMMA kinds (the
    steady-state loop and any peeled masked loops)."""
    return sum(
        cond and len({opclass(x) for x in insns[t : i + 1] if x.base == "HGMMA"}) == 2
        for i, t, cond in _backward_branches(insns, labels)
    )


def loop_classes(insns, labels, loop) -> dict:
    """Class counts of a loop's always path, its conditional total and its span."""
    from benchmarks.fa3_bwd_sass import conditional_mask

    head, tail = loop
    skipped = conditional_mask(insns, labels, head, tail)
    always: Counter = Counter()
    cond = 0
    for ins, sk in zip(insns[head : tail + 1], skipped, strict=True):
        if sk:
            cond += 1
        else:
            always[opclass(ins)] += 1
    return {
        "span": f"{insns[head].addr:#06x}-{insns[tail].addr:#06x}",
        "always": {c: always[c] for c in CLASSES if always[c]},
        "always_total": sum(always.values()),
        "conditional_total": cond,
        "utmaldg": sum(
            x.base == "UTMALDG"
            for x, sk in zip(insns[head : tail + 1], skipped, strict=True)
            if not sk
        ),
    }


def _event(ins) -> str | None:
    """The timeline name of a synchronising instruction, None for the rest."""
    c = opclass(ins)
    if c.startswith("HGMMA"):
        return c.split(" (")[0] + (" [gsb0]" if "gsb0" in ins.args else "")
    if c == "WARPGROUP.DEPBAR":
        return f"DEPBAR.LE {ins.args.split(',')[-1].strip()}"
    if c in ("WARPGROUP.ARRIVE", "SYNCS wait", "SYNCS arrive"):
        return c
    if c == "BAR named":
        return f"{ins.op.split('.')[0]}.{ins.op.split('.')[1]} {ins.args}"
    return None


def timeline(insns, labels, loop) -> list[str]:
    """The loop's always path as events, the maths between consecutive events summed on one
    line (`+ MUFU.EX2 11, FFMA 50, ...`); repeated HGMMAs are folded into `xN`."""
    from benchmarks.fa3_bwd_sass import conditional_mask

    head, tail = loop
    skipped = conditional_mask(insns, labels, head, tail)
    lines: list[str] = []
    math: Counter = Counter()
    last, reps = None, 0

    def flush_event():
        nonlocal last, reps
        if last is not None:
            lines.append(f"{last} x{reps}" if reps > 1 else last)
        last, reps = None, 0

    for ins, sk in zip(insns[head : tail + 1], skipped, strict=True):
        if sk:
            continue
        ev = _event(ins)
        c = opclass(ins)
        if ev is None:
            if c in MATH:
                math[c] += 1
            continue
        if math:
            flush_event()
            lines.append("    + " + ", ".join(f"{k} {math[k]}" for k in MATH if math[k]))
            math.clear()
        base = ev.replace(" [gsb0]", "")
        if last is not None and last.replace(" [gsb0]", "") == base and "gsb0" not in last:
            reps += 1
            last = ev
            continue
        flush_event()
        last, reps = ev, 1
    flush_event()
    if math:
        lines.append("    + " + ", ".join(f"{k} {math[k]}" for k in MATH if math[k]))
    lines.append("back-edge")
    return lines


def depbar_windows(insns, labels, loop) -> list[dict]:
    """For each DEPBAR wait of the loop's always path: its level and the maths classes issued
    from it to the next DEPBAR wait (or the back-edge)."""
    from benchmarks.fa3_bwd_sass import conditional_mask

    head, tail = loop
    skipped = conditional_mask(insns, labels, head, tail)
    wins: list[dict] = []
    for ins, sk in zip(insns[head : tail + 1], skipped, strict=True):
        if sk:
            continue
        c = opclass(ins)
        if c == "WARPGROUP.DEPBAR":
            wins.append({"wait": ins.args.split(",")[-1].strip(), "after": Counter()})
        elif wins and c in MATH:
            wins[-1]["after"][c] += 1
    return [{"wait": w["wait"], **{k: w["after"][k] for k in MATH}} for w in wins]


def spans(insns, labels, loop) -> dict[str, int]:
    """Always-path instruction counts of stretches of the consumer loop: the Q·K and P·V issue
    stretches (first to last HGMMA of the kind, both counted), the ping-pong section (BAR.SYNC
    to BAR.ARV, both counted) and the tail from the last MUFU.EX2 to the back-edge (what
    issues after the exponentials; its FMULs are given apart)."""
    from benchmarks.fa3_bwd_sass import conditional_mask

    head, tail = loop
    skipped = conditional_mask(insns, labels, head, tail)
    path = [x for x, sk in zip(insns[head : tail + 1], skipped, strict=True) if not sk]
    cls = [opclass(x) for x in path]

    def stretch(first, last) -> int:
        idx = [i for i, x in enumerate(path) if first(x, cls[i])]
        end = [i for i, x in enumerate(path) if last(x, cls[i])]
        return end[-1] - idx[0] + 1 if idx and end and end[-1] >= idx[0] else 0

    def kind(name):
        return lambda _x, c: c == name

    bar_sync = lambda x, _c: x.op.startswith("BAR.SYNC")
    bar_arv = lambda x, _c: x.op.startswith("BAR.ARV")
    last_ex2 = max((i for i, c in enumerate(cls) if c == "MUFU.EX2"), default=len(path) - 1)
    return {
        "Q·K issue stretch": stretch(kind("HGMMA Q·K (SS)"), kind("HGMMA Q·K (SS)")),
        "P·V issue stretch": stretch(kind("HGMMA P·V (RS)"), kind("HGMMA P·V (RS)")),
        "BAR.SYNC..BAR.ARV": stretch(bar_sync, bar_arv),
        "after last MUFU.EX2": len(path) - 1 - last_ex2,
        "  of which FMUL": sum(c == "FMUL" for c in cls[last_ex2 + 1 :]),
    }


def setmaxnreg(text: str) -> dict[str, list[int]]:
    """USETMAXREG values of the kernel: DEALLOC (producer) and ALLOC (consumers)."""
    out: dict[str, list[int]] = {"dealloc": [], "alloc": []}
    for kind, val in re.findall(r"USETMAXREG\.(\w+)\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", text):
        out["dealloc" if kind == "DEALLOC" else "alloc"].append(int(val, 16))
    return out


def analyse(text: str, facts: dict) -> dict:
    """Everything printed for one build."""
    from benchmarks.fa3_bwd_sass import parse_sass

    insns, labels = parse_sass(text)
    mma, prod = consumer_loop(insns, labels), producer_loop(insns, labels)
    return {
        "config": facts.get("config"),
        "registers": facts.get("registers"),
        "spills": f"{facts.get('spill_stores')}/{facts.get('spill_loads')}",
        "setmaxnreg": setmaxnreg(text),
        "smem_bytes": facts.get("smem_bytes"),
        "kernel_insns": len(insns),
        "hgmma_loops": _hgmma_loops(insns, labels),
        "named_bar_in_kernel": sum(x.base == "BAR" for x in insns),
        "consumer": loop_classes(insns, labels, mma) if mma else None,
        "producer": loop_classes(insns, labels, prod) if prod else None,
        "spans": spans(insns, labels, mma) if mma else {},
        "timeline": timeline(insns, labels, mma) if mma else [],
        "depbar_windows": depbar_windows(insns, labels, mma) if mma else [],
        "listing": _listing(insns, labels, mma) if mma else "",
    }


def _listing(insns, labels, loop) -> str:
    from benchmarks.fa3_bwd_sass import conditional_mask

    head, tail = loop
    skipped = conditional_mask(insns, labels, head, tail)
    return "\n".join(
        f"{x.addr:06x} {'c' if sk else ' '} {opclass(x):18s} {x.pred:6s} {x.op} {x.args}"
        for x, sk in zip(insns[head : tail + 1], skipped, strict=True)
    )


# --------------------------------------------------------------------------- report


def report(d: int, fa4: dict, ours: dict, causal: bool = False) -> str:
    """The side-by-side table of one head dim."""
    w = 14
    kind = "causal" if causal else "non-causal"
    lines = [f"=== bf16 {kind}, head_dim {d}: FA4 4.0.0b36 vs ours ===", ""]

    def row(name, a, b, diff=False):
        extra = ""
        if diff and isinstance(a, int) and isinstance(b, int):
            extra = f"{b - a:>+{w}d}"
        lines.append(f"{name:34s}{a!s:>{w}s}{b!s:>{w}s}{extra}")

    lines.append(f"{'':34s}{'FA4':>{w}s}{'ours':>{w}s}{'ours-FA4':>{w}s}")
    cf, co = fa4["config"] or {}, ours["config"] or {}
    row(
        "tile_m x tile_n",
        f"{cf.get('tile_m')}x{cf.get('tile_n')}",
        f"{co.get('tile_m')}x{co.get('tile_n')}",
    )
    row("K/V stages", cf.get("num_stages"), co.get("stages"))
    row("consumer warpgroups", cf.get("num_wg_mma"), co.get("num_consumer_wgs"))
    row("ptxas registers (launch)", fa4["registers"], ours["registers"])
    row("spill stores/loads (B)", fa4["spills"], ours["spills"])
    row("setmaxnreg producer", fa4["setmaxnreg"]["dealloc"], ours["setmaxnreg"]["dealloc"])
    row("setmaxnreg consumer", fa4["setmaxnreg"]["alloc"], ours["setmaxnreg"]["alloc"])
    row("smem (storage struct, B)", fa4["smem_bytes"], ours["smem_bytes"], diff=True)
    row("SASS instructions (kernel)", fa4["kernel_insns"], ours["kernel_insns"], diff=True)
    row("loops holding Q·K and P·V HGMMAs", fa4["hgmma_loops"], ours["hgmma_loops"])
    for role in ("consumer", "producer"):
        a, b = fa4[role], ours[role]
        lines += ["", f"{role} loop, per K/V block and warp (always path)"]
        if a is None or b is None:
            lines.append(f"  (loop not found: FA4 {a is not None}, ours {b is not None})")
            continue
        row("  span", a["span"], b["span"])
        for c in CLASSES:
            if a["always"].get(c) or b["always"].get(c):
                row("  " + c, a["always"].get(c, 0), b["always"].get(c, 0), diff=True)
        row("  total (always)", a["always_total"], b["always_total"], diff=True)
        row("  conditional (skipped)", a["conditional_total"], b["conditional_total"], diff=True)
    lines += ["", "consumer loop stretches (always-path instructions per warp)"]
    for k in fa4["spans"]:
        row("  " + k, fa4["spans"][k], ours["spans"].get(k), diff=True)
    lines += ["", "DEPBAR windows: maths from each wait to the next (consumer loop)"]
    for name, r in (("FA4", fa4), ("ours", ours)):
        for win in r["depbar_windows"]:
            body = ", ".join(f"{k} {win[k]}" for k in MATH if win[k])
            lines.append(f"  {name:5s} after LE {win['wait']}: {body or '-'}")
    for name, r in (("FA4", fa4), ("ours", ours)):
        lines += ["", f"{name} consumer loop, in issue order:"]
        lines += ["  " + t for t in r["timeline"]]
    return "\n".join(lines)


def work_folder(from_dir: str | None, keep: str | None, prefix: str) -> tuple:
    """(folder, TemporaryDirectory or None): the builds' folder, --from's or --keep's, else a
    temporary one the caller cleans up."""
    if from_dir or keep:
        return Path(from_dir or keep), None
    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    return Path(tmp.name), tmp


def require_fa4(tool: str, wheel_dir: str) -> None:
    """Exit with a clear message when FA4 can be found neither as its wheel in `wheel_dir`, nor
    unzipped under $TMPDIR/fa4, nor installed."""
    unzipped = Path(os.environ.get("TMPDIR", "/tmp")) / "fa4" / "flash_attn"
    found = (Path(wheel_dir) / FA4_WHEEL).exists() or unzipped.exists()
    if not found and importlib.util.find_spec("flash_attn") is None:
        sys.exit(
            f"{tool}: FA4 not found: {Path(wheel_dir) / FA4_WHEEL} is absent and flash_attn is "
            "not installed (pip install flash-attn-4==4.0.0b36 quack-kernels==0.6.5, or "
            "--wheel-dir DIR holding both wheels)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, action="append", help="64 and 128 by default")
    ap.add_argument("--keep", help="write the builds' .sass/.ptx/.json here")
    ap.add_argument("--from", dest="from_dir", help="analyse the builds kept in this folder")
    ap.add_argument(
        "--set", action="append", default=[], help="ours: FIELD=VALUE of Fa3Config (repeat)"
    )
    ap.add_argument("--fa4-lse", action="store_true", help="FA4 writes the LSE (training fwd)")
    ap.add_argument("--causal", action="store_true", help="both causal (each its causal config)")
    ap.add_argument("--wheel-dir", default=str(REPO / ".gpu"), help="where the FA4 wheels are")
    ap.add_argument("--listing", action="store_true", help="also print both consumer loops")
    ap.add_argument("--json", help="write the analysis here")
    ap.add_argument("--build", choices=BUILDS, help=argparse.SUPPRESS)  # one compile (child)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dims = args.head_dim or [64, 128]

    if args.build:
        build(args.build, dims[0], Path(args.out), args.fa4_lse, Path(args.wheel_dir), args.set,
              args.causal)  # fmt: skip
        return 0

    folder, tmp = work_folder(args.from_dir, args.keep, "fa4_sass_")
    if not args.from_dir:
        for d in dims:
            for which in BUILDS:
                cmd = [sys.executable, "-m", "benchmarks.fa4_sass_compare", "--build", which]
                cmd += ["--head-dim", str(d), "--out", str(folder), "--wheel-dir", args.wheel_dir]
                cmd += ["--fa4-lse"] if args.fa4_lse else []
                cmd += ["--causal"] if args.causal else []
                cmd += [f"--set={c}" for c in args.set]
                subprocess.run(cmd, check=True, cwd=REPO)
    results = {}
    for d in dims:
        res = {}
        for which in BUILDS:
            stem = folder / f"{which}_d{d}{'_causal' if args.causal else ''}"
            facts = json.loads(stem.with_suffix(".json").read_text())
            res[which] = analyse(stem.with_suffix(".sass").read_text(), facts)
        results[d] = res
        print(report(d, res["fa4"], res["ours"], args.causal))
        if args.listing:
            for which in BUILDS:
                print(f"\n--- {which} D{d}: consumer loop ('c': conditional)")
                print(res[which]["listing"])
        print()
    if args.json:
        for res in results.values():
            for r in res.values():
                r.pop("listing", None)
        Path(args.json).write_text(json.dumps(results, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
