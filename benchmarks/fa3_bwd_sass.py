"""SASS of the fa3 backward's loops: instructions per row block by class, on the CPU (sm_90a).

    python -m benchmarks.fa3_bwd_sass                          # shipped D 128 and D 64, non-causal
    python -m benchmarks.fa3_bwd_sass --variant pipe_stm --variant pipe_wgs --head-dim 128
    python -m benchmarks.fa3_bwd_sass --variant pipe_stm --causal --listing mma
    python -m benchmarks.fa3_bwd_sass --sass kernel.sass       # an existing `nvdisasm -c` listing
    python -m benchmarks.fa3_bwd_sass --json out.json --keep DIR

Each build is compiled for sm_90a (no GPU), its cubin disassembled with Triton's nvdisasm, and
three loops are found in the SASS: the MMA warpgroups' row-block loop (the one holding the
HGMMAs), the producer's (UTMALDG) and the dQ writer's (UBLKRED). A loop is a conditional
backward branch and the code from its target to it; of the loops holding the marker, the one
holding the most markers (then the shortest) is taken. The out-of-line mbarrier retry stubs
end in an unconditional branch back into the loop, so they are not taken for loops.

Inside a loop an instruction is "conditional" when a forward branch of the loop jumps over it
(the per-element mask of an edge block, the retry of an mbarrier wait, a lane-0 section), and
"always" otherwise: the "always" counts are what every warp of the role issues per row block
of an unmasked iteration. They are split into classes (`CLASSES`) and printed side by side,
with the arithmetic minimum of the MMA loop (`mma_minimum`) next to them. Compiling imports
benchmarks.fa3_probe, which sets the CUTE_DSL_* variables before cutlass is imported: run
builds in their own process; the parser alone (`loop_counts`) has no such side effect.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Instruction classes, by opcode (the mnemonic up to its first '.'); the first match wins and
# anything unlisted is "other". Moves are told apart from arithmetic by `_opclass`.
CLASSES: tuple[tuple[str, frozenset[str]], ...] = (
    ("HGMMA", frozenset({"HGMMA"})),
    ("MUFU", frozenset({"MUFU"})),
    ("FP32 FFMA/FMUL/FADD/FMNMX", frozenset({"FFMA", "FMUL", "FADD", "FMNMX", "FSWZADD"})),
    ("F2FP pack", frozenset({"F2FP"})),
    ("conversion", frozenset({"F2F", "I2F", "F2I", "I2FP", "F2IP", "FRND"})),
    ("LDS/LDSM/STS/STSM", frozenset({"LDS", "LDSM", "STS", "STSM", "ATOMS"})),
    ("LDG/STG/RED", frozenset({"LDG", "STG", "RED", "REDG", "ATOM", "ATOMG", "LD", "ST"})),
    (
        "TMA / bulk",
        frozenset(
            {"UTMALDG", "UTMASTG", "UBLKRED", "UBLKCP", "UTMAPF", "UTMACCTL", "UTMACMDFLUSH"}
        ),
    ),
    ("SYNCS mbarrier", frozenset({"SYNCS"})),
    ("BAR named", frozenset({"BAR"})),
    ("MEMBAR/FENCE/DEPBAR", frozenset({"MEMBAR", "FENCE", "DEPBAR", "CCTL"})),
    ("WARPGROUP/WARPSYNC", frozenset({"WARPGROUP", "WARPSYNC"})),
    ("R2UR", frozenset({"R2UR"})),
    (
        "int uniform (U*)",
        frozenset({"UIADD3", "UIMAD", "ULEA", "ULOP3", "USHF", "UPRMT", "UFLO", "UPOPC", "UBMSK"}),
    ),
    (
        "int vector",
        frozenset(
            {"IMAD", "IADD3", "LOP3", "SHF", "LEA", "VIADD", "PRMT", "IABS", "IMNMX", "VIMNMX"}
            | {"SGXT", "BMSK", "POPC", "FLO", "IADD", "LOP", "SHL", "SHR", "BREV"}
        ),
    ),
    (
        "ISETP/FSETP/SEL/FSEL",
        frozenset({"ISETP", "FSETP", "SEL", "FSEL", "PLOP3", "UISETP", "USEL", "P2R", "R2P"})
        | {"VOTE", "VOTEU", "UPLOP3"},
    ),
    ("BRA/BSSY/BSYNC", frozenset({"BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "BREAK"})),
    ("MOV", frozenset({"MOV", "UMOV", "CS2R", "S2R", "S2UR", "ULDC", "LDC", "SHFL", "MOVM"})),
)
CLASS_NAMES = (*(n for n, _ in CLASSES), "other")
# What each role's loop is found by.
ROLE_MARKERS = {"mma": "HGMMA", "producer": "UTMALDG", "dq_writer": "UBLKRED"}

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass(frozen=True)
class Insn:
    """One SASS instruction: its address, guard predicate ("" if none), mnemonic and operands."""

    addr: int
    pred: str
    op: str
    args: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


def parse_sass(text: str) -> tuple[list[Insn], dict[str, int]]:
    """The instructions of the largest function in an `nvdisasm -c` listing and its labels
    (label -> index of the instruction that follows it)."""
    funcs: list[tuple[list[Insn], dict[str, int]]] = [([], {})]
    for line in text.splitlines():
        if line.lstrip().startswith(".section") and ".text." in line:
            funcs.append(([], {}))
            continue
        insns, labels = funcs[-1]
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.match(line)
        if m:
            pred = (m.group(2) or "").strip()
            insns.append(Insn(int(m.group(1), 16), pred, m.group(3), m.group(4)))
    return max(funcs, key=lambda f: len(f[0]))


def _branches(insns: list[Insn], labels: dict[str, int]):
    """(index, target index, conditional) of every BRA with a label target."""
    for i, ins in enumerate(insns):
        if ins.base == "BRA":
            m = _TARGET.search(ins.args)
            if m and m.group(1) in labels:
                yield i, labels[m.group(1)], bool(ins.pred)


def find_loop(
    insns: list[Insn], labels: dict[str, int], marker: str
) -> tuple[int, int, int] | None:
    """(head, back-edge index, loops holding the marker) of the loop that holds the most
    `marker` instructions (then the shortest), among conditional backward branches; None if
    no loop holds one."""
    found = []
    for i, t, cond in _branches(insns, labels):
        if cond and t <= i:
            n = sum(ins.base == marker for ins in insns[t : i + 1])
            if n:
                found.append((-n, i - t, t, i))
    if not found:
        return None
    _, _, head, tail = min(found)
    return head, tail, len(found)


def conditional_mask(insns: list[Insn], labels: dict[str, int], head: int, tail: int):
    """Per instruction of insns[head:tail + 1], whether a forward branch inside the loop jumps
    over it (so an iteration may not issue it)."""
    skipped = [False] * (tail - head + 1)
    for i, t, _ in _branches(insns, labels):
        if head <= i < t <= tail + 1:
            for k in range(i + 1, t):
                skipped[k - head] = True
    return skipped


def _opclass(ins: Insn) -> str:
    """The class of one instruction (CLASSES); IMAD.MOV and `IMAD.U32 Rx, RZ, RZ, y` are moves."""
    if ins.op.startswith("IMAD.MOV") or (
        ins.op.startswith("IMAD") and re.match(r"R\d+, RZ, RZ, ", ins.args)
    ):
        return "MOV"
    for name, ops in CLASSES:
        if ins.base in ops:
            return name
    return "other"


def loop_counts(text: str, marker: str) -> dict | None:
    """Class counts of the loop holding `marker` in SASS `text`: "always" (every iteration),
    "conditional" (jumped over by a forward branch of the loop), the opcode histogram of the
    always path, the loop's span and how many loops held the marker."""
    insns, labels = parse_sass(text)
    loop = find_loop(insns, labels, marker)
    if loop is None:
        return None
    head, tail, n_loops = loop
    skipped = conditional_mask(insns, labels, head, tail)
    always: Counter = Counter()
    cond: Counter = Counter()
    ops: Counter = Counter()
    for ins, sk in zip(insns[head : tail + 1], skipped, strict=True):
        (cond if sk else always)[_opclass(ins)] += 1
        if not sk:
            ops[ins.op] += 1
    # What each wgmma wait has ahead of it in issue order: the exponentials and wgmmas issued
    # since the previous wait (the order ptxas chose, which the PTX's order does not fix).
    waits, mufu, hgmma = [], 0, 0
    for ins, sk in zip(insns[head : tail + 1], skipped, strict=True):
        if sk:
            continue
        if ins.op.startswith("WARPGROUP.DEPBAR"):
            waits.append({"wait": ins.args.strip(), "mufu": mufu, "hgmma": hgmma})
            mufu, hgmma = 0, 0
        mufu += ins.base == "MUFU"
        hgmma += ins.base == "HGMMA"
    # Shared-memory loads issued before the row block's first wgmma (lse_regs' LSE rows).
    lds_first = 0
    for ins, sk in zip(insns[head : tail + 1], skipped, strict=True):
        if ins.base == "HGMMA":
            break
        lds_first += not sk and ins.base == "LDS"
    return {
        "head_addr": insns[head].addr,
        "tail_addr": insns[tail].addr,
        "loops_with_marker": n_loops,
        "waits": waits,
        "lds_before_first_hgmma": lds_first,
        "always": {k: always[k] for k in CLASS_NAMES if always[k]},
        "always_total": sum(always.values()),
        "conditional": {k: cond[k] for k in CLASS_NAMES if cond[k]},
        "conditional_total": sum(cond.values()),
        "opcodes": dict(ops.most_common()),
    }


def loop_listing(text: str, marker: str) -> str:
    """The loop holding `marker`, one instruction a line: 'c' marks conditional ones, then the
    class."""
    insns, labels = parse_sass(text)
    loop = find_loop(insns, labels, marker)
    if loop is None:
        return f"(no loop holds {marker})"
    head, tail, _ = loop
    skipped = conditional_mask(insns, labels, head, tail)
    return "\n".join(
        f"{ins.addr:06x} {'c' if sk else ' '} {_opclass(ins):26s} {ins.pred:6s} {ins.op} {ins.args}"
        for ins, sk in zip(insns[head : tail + 1], skipped, strict=True)
    )


def mma_minimum(cfg, head_dim: int) -> dict[str, int]:
    """Per MMA warp and row block ("sdp_t" layout, bf16/fp16): the instructions the maths
    needs. E = TILE_N / WGS x TILE_M / 128 scores per thread: exp2 E, the scale-and-LSE FFMA
    E, dS = P (dP - D) 2 E, packing P^T and dS^T E (two per F2FP), dS^T to sdS E / 8 stmatrix
    x4, the LSE and D of the thread's TILE_M / 4 rows by TILE_M / 8 LDS.64 each, dQ's fragment
    to sdQ by 16-byte stores; the wgmmas at k16 (m64 atoms: dQ split over the warpgroups)."""
    wgs = cfg.num_mma_wgs
    e = cfg.tile_n // wgs * cfg.tile_m // 128
    k_sdp = head_dim // 16  # S^T and dP^T: one m64nTILE_Mk16 per 16 of D
    k_dkv = cfg.tile_m // 16  # dV and dK: one m64nDk16 per 16 query rows
    # dQ's m64 atoms per warpgroup ("d": TILE_M / 64 of D / WGS columns; "m": its own 64 rows;
    # "dt": its 64 of D), each over the TILE_N keys
    m_atoms = {"d": cfg.tile_m // 64, "m": cfg.tile_m // 64 // wgs, "dt": 1}[cfg.dq_split]
    return {
        "HGMMA": 2 * k_sdp + 2 * k_dkv + m_atoms * cfg.tile_n // 16,
        "MUFU": e,
        "FP32 FFMA/FMUL/FADD/FMNMX": 3 * e,
        "F2FP pack": e,
        "LDS/LDSM/STS/STSM": e // 8 + 2 * (cfg.tile_m // 8) + cfg.tile_m * head_dim // wgs // 512,
    }


def compile_cubin(name: str | None, head_dim: int, causal: bool) -> tuple[bytes, dict, object]:
    """Compile a named variant (or the shipped config when `name` is None) in bf16 and return
    (cubin, ptxas facts, config)."""
    from benchmarks import fa3_probe as probe  # first: sets CUTE_DSL_* before cutlass's import

    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    import torch

    from benchmarks.fa3_bwd_variants import variant
    from flashsuite.fa3.bwd_configs import bwd_config_for
    from flashsuite.fa3.bwd_host import BwdCompileKey, compile_backward

    cfg = variant(name) if name else bwd_config_for(head_dim, torch.bfloat16, causal)
    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    key = BwdCompileKey(torch.bfloat16, head_dim, causal, cfg, tvm_ffi=tvm)
    compiled, log = probe._capture_fd2(lambda: compile_backward(key))
    return compiled.__cubin__, probe.parse_ptxas(log), cfg


def disassemble(cubin: bytes) -> str:
    """`nvdisasm -c` of a cubin, by the disassembler Triton's wheel ships."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [tool, "-c", f.name], capture_output=True, text=True, check=True
        ).stdout


def analyse(text: str) -> dict:
    """Every role's loop counts (None where the SASS has no such loop)."""
    return {role: loop_counts(text, marker) for role, marker in ROLE_MARKERS.items()}


def table(results: list[dict], role: str) -> str:
    """One column per build: the "always" counts of `role`'s loop by class, its total and its
    conditional total (and the MMA loop's minimum where a config is known)."""
    cols = []
    for r in results:
        loop = r["loops"].get(role)
        if loop is None:
            continue
        cols.append((r["label"], loop["always"], loop["always_total"], loop["conditional_total"]))
        if role == "mma" and r.get("minimum"):
            m = r["minimum"]
            cols.append((f"{r['label']} min", m, sum(m.values()), 0))
    if not cols:
        return f"({role}: no loop)"
    width = max(12, *(len(c[0]) for c in cols))
    head = f"{role + ' loop, per warp and row block':32s}" + "".join(
        f"{c[0]:>{width + 2}s}" for c in cols
    )
    lines = [head]
    for name in CLASS_NAMES:
        if any(c[1].get(name) for c in cols):
            lines.append(
                f"{name:32s}" + "".join(f"{c[1].get(name, 0):>{width + 2}d}" for c in cols)
            )
    lines.append(f"{'total (always)':32s}" + "".join(f"{c[2]:>{width + 2}d}" for c in cols))
    lines.append(f"{'conditional':32s}" + "".join(f"{c[3]:>{width + 2}d}" for c in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="a named variant (repeat)")
    ap.add_argument("--head-dim", type=int, action="append", help="head dims of the variants")
    ap.add_argument("--causal", action="store_true", help="causal builds")
    ap.add_argument("--sass", action="append", default=[], help="an nvdisasm -c listing (repeat)")
    ap.add_argument("--listing", choices=sorted(ROLE_MARKERS), help="print this role's loop")
    ap.add_argument("--keep", help="write each build's .sass here")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    builds: list[tuple[str, str | None, int]] = []
    if args.variant:
        for name in args.variant:
            for d in args.head_dim or [128]:
                builds.append((f"{name} D{d}", name, d))
    elif not args.sass:
        builds = [("shipped D128", None, 128), ("shipped D64", None, 64)]
    results = []
    for label, name, d in builds:
        cubin, ptxas, cfg = compile_cubin(name, d, args.causal)
        text = disassemble(cubin)
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            (Path(args.keep) / f"{label.replace(' ', '_')}.sass").write_text(text)
        results.append(
            {
                "label": label,
                "head_dim": d,
                "causal": args.causal,
                "config": cfg.__dict__,
                "spill_stores": ptxas["spill_stores"],
                "spill_loads": ptxas["spill_loads"],
                "max_reg": max((int(r) for r in re.findall(r"\bR(\d+)\b", text)), default=None),
                "minimum": mma_minimum(cfg, d) if cfg.layout == "sdp_t" else None,
                "loops": analyse(text),
                "sass": text if args.listing else None,
            }
        )
    for path in args.sass:
        text = Path(path).read_text()
        results.append({"label": Path(path).stem, "loops": analyse(text), "sass": text})
    for r in results:
        if "max_reg" in r:
            print(f"{r['label']}: R{r['max_reg']}, spills {r['spill_stores']}/{r['spill_loads']} B")
    for role in ROLE_MARKERS:
        print()
        print(table(results, role))
    for r in results:
        mma = r["loops"].get("mma")
        if mma:
            ahead = ", ".join(
                f"[{w['wait']}] {w['mufu']} MUFU {w['hgmma']} HGMMA" for w in mma["waits"]
            )
            print(f"{r['label']}: MMA loop waits, with what was issued since the last: {ahead}")
    if args.listing:
        for r in results:
            print(f"\n--- {r['label']}: {args.listing} loop")
            print(loop_listing(r["sass"], ROLE_MARKERS[args.listing]))
    if args.json:
        for r in results:
            r.pop("sass", None)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
