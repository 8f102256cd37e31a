"""FA4's CuTe-DSL SM90 forward beside ours, from the SASS: the per-tile fixed costs outside the
K/V loop (prologue and epilogue of the consumer and producer warps), both built for sm_90a on
the CPU.

    python -m benchmarks.fa4_fwd_sass_compare                      # bf16 D 128 non-causal
    python -m benchmarks.fa4_fwd_sass_compare --head-dim 64 --keep /tmp/fwdcmp
    python -m benchmarks.fa4_fwd_sass_compare --from /tmp/fwdcmp --head-dim 64 --listing epilogue
    python -m benchmarks.fa4_fwd_sass_compare --causal --listing prologue
    python -m benchmarks.fa4_fwd_sass_compare --fa4-lse --set k_ahead=0 --json out.json

Builds, each compiled in its own process (`--build NAME`, which imports benchmarks.fa3_probe
first so the CUTE_DSL_* variables are set before cutlass is imported), through the builders of
benchmarks.fa4_sass_compare:

- "fa4": FlashAttentionForwardSm90 (flash-attn-4 4.0.0b36, flash_attn/cute/flash_fwd_sm90.py)
  configured as its interface's forward configures it on SM90 for bf16, MHA, dense, no score
  mod / mask mod / paging / varlen: tile and mma_pv_is_rs / intra_wg_overlap from
  `interface._tile_size_fwd_sm90(D, D, causal, False)`, num_stages 2, Q_in_regs False,
  pack_gqa False, (num_wg_mma + 1) x 128 threads (the kernel derives them from the tile). No LSE
  unless `--fa4-lse`: `flash_attn_func` allocates none unless an input requires grad or
  return_lse (the inference forward that dispatch/bench times). Inputs are fake cute tensors
  (symbolic sizes, 16-byte-aligned symbolic strides).
- "ours": the shipped config (`configs.get_config(D, bf16, causal)`, each `--set FIELD=VALUE`
  replaced in it) through `compile.compile_forward`; it always writes the LSE.

Each cubin is disassembled with Triton's nvdisasm (fa3_bwd_sass.disassemble) and the largest
function parsed (fa3_bwd_sass.parse_sass). The consumer's K/V loop is found as fa3_bwd_sass finds
loops, among the conditional backward branches whose body holds both the Q·Kᵀ (SS) and P·V (RS)
HGMMAs: innermost ones only (a persistent tile loop around it is skipped), those without a -INF
select on their always path first (causal: the unmasked loop), then the most HGMMAs, then the
shortest. The producer's is the shortest loop holding UTMALDG and no HGMMA.

Outside the loops, on the control-flow graph of basic blocks (an unpredicated BRA has its
target only, a predicated one its target and the next instruction, EXIT and the retry stubs'
branches back included), with the loop's own blocks removed:

- prologue: the blocks from the kernel's start that reach the loop head; "always" are those
  that dominate it (every warp of the role issues them once per tile: the kernel start, the
  role split, Q and first-K waits, the peeled Q·Kᵀ and its softmax), "conditional" the rest
  (warp 0's barrier init, lane-elected TMA issue, mbarrier retry stubs, short-tile paths).
- epilogue: the blocks from the loop's exit (the instruction after its back-edge) that reach an
  EXIT; "always" are those that post-dominate the exit (on every path to an EXIT: the last P·V,
  the normalisation, the O / LSE stores every warp makes), "conditional" the rest (the storing
  warp's TMA store, LSE lanes, retry stubs).

In a persistent kernel (ours causal: the v2 scheduler) a tile loop encloses the K/V loop: its
code counts in the prologue where it dominates the loop head and in the epilogue where it
post-dominates the loop exit, and a tile's other loops (split_loops' masked loop) and its store
fall in neither or in the conditional counts; the report flags such builds.

Printed, FA4 beside ours: the facts (tile, stages, threads, ptxas registers and spills,
setmaxnreg values, the shared-storage struct's bytes); the consumer loop by class per K/V block
and warp (always path); per region (consumer prologue / epilogue, producer prologue /
epilogue) the always path by class and the conditional total by class, the HGMMAs before and
after the consumer loop (the Q·Kᵀ / P·V blocks peeled), the mbarrier waits and named barriers
on the always path before the first HGMMA; the differences in plain words, with the per-tile
instruction difference in K/V blocks' worth of the consumer loop. `--listing prologue|epilogue`
also prints those regions of both kernels ('c': conditional; '*': HGMMA, mbarrier, named
barrier, fence, TMA and global-memory lines).

FA4 is imported from an installed flash_attn if there is one, else from the wheels in .gpu/
(flash_attn_4-4.0.0b36 and quack_kernels-0.6.5, unzipped into $TMPDIR/fa4 and $TMPDIR/quack on
first use; `--wheel-dir` elsewhere; fa4_sass_compare.fa4_setup). Lab code: never imported by
flashsuite.
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
    _backward_branches,
    is_move,
    producer_loop,
    require_fa4,
    setmaxnreg,
    work_folder,
)

REPO = Path(__file__).resolve().parents[1]
FA4_WHEEL = "flash_attn_4-4.0.0b36-py3-none-any.whl"
BUILDS = ("fa4", "ours")
REGIONS = (
    ("consumer", "prologue"),
    ("consumer", "epilogue"),
    ("producer", "prologue"),
    ("producer", "epilogue"),
)

# Instruction classes, in print order (`opclass`).
CLASSES = (
    "HGMMA Q·K (SS)",
    "HGMMA P·V (RS)",
    "WARPGROUP.ARRIVE",
    "WARPGROUP.DEPBAR",
    "UTMALDG",
    "UTMASTG/UBLKCP",
    "UTMACCTL/CMDFLUSH",
    "DEPBAR (bulk wait)",
    "STSM/STS",
    "LDS/LDSM",
    "STG/ST",
    "LDG/LD",
    "SYNCS init (EXCH)",
    "SYNCS wait",
    "SYNCS arrive",
    "BAR.SYNC",
    "BAR.ARV",
    "MEMBAR/FENCE",
    "USETMAXREG",
    "ELECT",
    "MUFU.EX2",
    "MUFU other",
    "FFMA/FMUL/FADD",
    "FMNMX",
    "FSEL/FSETP",
    "F2FP/F2F",
    "SHFL",
    "CS2R (zeroing)",
    "int/addr arithmetic",
    "ISETP/SEL/PLOP3",
    "LDC/ULDC (params)",
    "S2R/S2UR",
    "MOV/UMOV/R2UR",
    "BRA/EXIT/BSSY",
    "NANOSLEEP",
    "other",
)
# Lines marked '*' in the listings.
MARKED = frozenset(
    {"HGMMA", "SYNCS", "BAR", "MEMBAR", "FENCE", "UTMALDG", "UTMASTG", "UBLKCP", "DEPBAR"}
    | {"STG", "ST", "LDG", "WARPGROUP", "USETMAXREG", "EXIT"}
)
_INT = frozenset(
    {"IMAD", "IADD3", "LOP3", "SHF", "LEA", "VIADD", "PRMT", "IABS", "IMNMX", "VIMNMX", "SGXT"}
    | {"BMSK", "POPC", "FLO", "IADD", "LOP", "SHL", "SHR", "BREV", "IMUL", "VIADDMNMX", "IDP"}
    | {"UIADD3", "UIMAD", "ULEA", "ULOP3", "USHF", "UPRMT", "UFLO", "UPOPC", "UBMSK", "USGXT"}
    | {"UIMNMX", "UBREV", "ULOP", "UIABS", "I2FP", "F2IP", "I2F", "F2I"}
)
_PRED = frozenset(
    {"ISETP", "UISETP", "SEL", "USEL", "PLOP3", "UPLOP3", "P2R", "R2P", "VOTE", "VOTEU"}
)
_BRANCH = frozenset({"BRA", "EXIT", "BSSY", "BSYNC", "CALL", "RET", "BREAK", "WARPSYNC", "BRX"})
_MOVES = frozenset({"MOV", "UMOV", "R2UR", "MOVM", "NOP"})
_RS = re.compile(r"\bR\d+, R\d+, gdesc")  # HGMMA with its A operand in registers (P·V)
_BAR = re.compile(r"\[([^\]]+)\]")


def opclass(ins) -> str:
    """The class (CLASSES) of one fa3_bwd_sass.Insn."""
    op, base = ins.op, ins.base
    if base == "HGMMA":
        return "HGMMA P·V (RS)" if _RS.search(ins.args) else "HGMMA Q·K (SS)"
    if base == "WARPGROUP":
        return "WARPGROUP.DEPBAR" if "DEPBAR" in op else "WARPGROUP.ARRIVE"
    if base == "UTMALDG":
        return "UTMALDG"
    if base in ("UTMASTG", "UBLKCP", "UBLKRED", "UTMAREDG"):
        return "UTMASTG/UBLKCP"
    if base in ("UTMACCTL", "UTMAPF", "UTMACMDFLUSH"):
        return "UTMACCTL/CMDFLUSH"
    if base == "DEPBAR":
        return "DEPBAR (bulk wait)"
    if base in ("STSM", "STS"):
        return "STSM/STS"
    if base in ("LDS", "LDSM"):
        return "LDS/LDSM"
    if base in ("STG", "ST", "RED", "REDG", "ATOM", "ATOMG"):
        return "STG/ST"
    if base in ("LDG", "LD"):
        return "LDG/LD"
    if base == "SYNCS":
        if ".EXCH" in op:
            return "SYNCS init (EXCH)"
        return "SYNCS arrive" if ".ARRIVE" in op else "SYNCS wait"
    if base == "BAR":
        return "BAR.ARV" if ".ARV" in op else "BAR.SYNC"
    if base in ("MEMBAR", "FENCE", "CCTL"):
        return "MEMBAR/FENCE"
    if base == "USETMAXREG":
        return "USETMAXREG"
    if base == "ELECT":
        return "ELECT"
    if base == "MUFU":
        return "MUFU.EX2" if op.startswith("MUFU.EX2") else "MUFU other"
    if base in ("FFMA", "FMUL", "FADD", "FSWZADD"):
        return "FFMA/FMUL/FADD"
    if base == "FMNMX":
        return "FMNMX"
    if base in ("FSEL", "FSETP"):
        return "FSEL/FSETP"
    if base in ("F2FP", "F2F", "FRND"):
        return "F2FP/F2F"
    if base == "SHFL":
        return "SHFL"
    if base == "CS2R":
        return "CS2R (zeroing)" if "SRZ" in ins.args else "S2R/S2UR"
    if base in ("LDC", "ULDC"):
        return "LDC/ULDC (params)"
    if base in ("S2R", "S2UR"):
        return "S2R/S2UR"
    if base in _BRANCH:
        return "BRA/EXIT/BSSY"
    if base == "NANOSLEEP":
        return "NANOSLEEP"
    if base in _PRED:
        return "ISETP/SEL/PLOP3"
    if is_move(ins, _MOVES):
        return "MOV/UMOV/R2UR"
    if base in _INT:
        return "int/addr arithmetic"
    return "other"


# --------------------------------------------------------------------------- building


def build(
    name: str,
    head_dim: int,
    causal: bool,
    out: Path,
    wheel_dir: Path,
    fa4_lse: bool,
    changes: list[str],
) -> None:
    """Compile one kernel; write out/<stem>.sass and .json (facts and ptxas -v)."""
    from benchmarks import fa3_probe as probe  # first: sets CUTE_DSL_* before cutlass's import

    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"  # after fa3_probe, which sets "ptx"
    from benchmarks import fa4_sass_compare as fsc

    if name == "fa4":
        compiled, log, facts = fsc.build_fa4(head_dim, fa4_lse, wheel_dir, causal)
        c = facts["config"]
        facts.update(
            tile=f"{c['tile_m']}x{c['tile_n']}",
            stages=c["num_stages"],
            consumer_wgs=c["num_wg_mma"],
            threads=128 * (c["num_wg_mma"] + 1),
            lse=fa4_lse,
            flags=f"pv_rs={c['mma_pv_is_rs']} overlap={c['intra_wg_overlap']} "
            f"sched_bar={c['use_scheduler_barrier']} sO on sQ, SingleTileScheduler"
            + (" LPT" if causal else ""),
        )
    else:
        compiled, log, facts = fsc.build_ours(head_dim, changes, causal)
        c = facts["config"]
        on = [k for k in ("intra_wg_overlap", "o_alias_q", "persistent", "pingpong") if c.get(k)]
        on += [k for k in ("softmax_apart", "k_ahead", "wg_slice", "split_loops") if c.get(k)]
        facts.update(
            tile=f"{c['tile_m']}x{c['tile_n']}",
            stages=c["stages"],
            consumer_wgs=c["num_consumer_wgs"],
            threads=128 * (c["num_consumer_wgs"] + 1),
            lse=True,
            flags=" ".join(on) + "".join(f" {x}" for x in changes),
        )
    from benchmarks.fa3_bwd_sass import disassemble

    out.mkdir(parents=True, exist_ok=True)
    stem = out / _stem(name, head_dim, causal, fa4_lse)
    stem.with_suffix(".sass").write_text(disassemble(compiled.__cubin__))
    facts.update(probe.parse_ptxas(log))
    stem.with_suffix(".json").write_text(json.dumps(facts, indent=1, default=str))


def _stem(name: str, head_dim: int, causal: bool, fa4_lse: bool) -> str:
    lse = "_lse" if fa4_lse and name == "fa4" else ""
    return f"fwd_{name}_d{head_dim}{'_causal' if causal else ''}{lse}"


# --------------------------------------------------------------------------- control flow


class Cfg:
    """Basic blocks of a parsed function: `start[b]`, `end[b]` (exclusive) instruction indices,
    `succ[b]` successor blocks, `exits` the blocks that may end the thread (an EXIT)."""

    def __init__(self, insns, labels):
        from benchmarks.fa3_bwd_sass import _TARGET

        n = len(insns)
        leaders = {0, *(i for i in labels.values() if i < n)}
        for i, x in enumerate(insns):
            if x.base in ("BRA", "EXIT", "RET", "BRX") and i + 1 < n:
                leaders.add(i + 1)
        self.start = sorted(leaders)
        self.end = [*self.start[1:], n]
        self.block_of = [0] * n
        for b, (s, e) in enumerate(zip(self.start, self.end, strict=True)):
            for i in range(s, e):
                self.block_of[i] = b
        nb = len(self.start)
        self.succ: list[list[int]] = [[] for _ in range(nb)]
        self.exits: set[int] = set()
        for b in range(nb):
            last = insns[self.end[b] - 1]
            always = last.pred in ("", "PT")
            nxt = [b + 1] if b + 1 < nb else []
            if last.base == "BRA":
                m = _TARGET.search(last.args)
                tgt = [self.block_of[labels[m.group(1)]]] if m and m.group(1) in labels else []
                self.succ[b] = tgt if always and tgt else tgt + nxt
            elif last.base in ("EXIT", "RET"):
                self.exits.add(b)
                self.succ[b] = [] if always else nxt
            else:
                self.succ[b] = nxt
            # a predicated EXIT inside a block (none are: EXIT ends a block) would also exit
        self.pred: list[list[int]] = [[] for _ in range(nb)]
        for b, ss in enumerate(self.succ):
            for s in ss:
                self.pred[s].append(b)

    def reach(self, roots, edges, banned) -> set[int]:
        seen = {r for r in roots if r not in banned}
        todo = list(seen)
        while todo:
            b = todo.pop()
            for s in edges[b]:
                if s not in seen and s not in banned:
                    seen.add(s)
                    todo.append(s)
        return seen

    @staticmethod
    def dominators(root: int, preds, nodes: set[int]) -> dict[int, set[int]]:
        """Dominator sets over `nodes` from `root`, `preds(b)` the blocks an edge comes to b
        from (for post-dominators: the successors, and a virtual root for the EXITs)."""
        dom = {b: set(nodes) for b in nodes}
        dom[root] = {root}
        changed = True
        order = sorted(nodes)
        while changed:
            changed = False
            for b in order:
                if b == root:
                    continue
                ps = [p for p in preds(b) if p in nodes]
                new = set.intersection(*(dom[p] for p in ps)) if ps else set()
                new = new | {b}
                if new != dom[b]:
                    dom[b] = new
                    changed = True
        return dom


def regions(insns, labels, loop: tuple[int, int]) -> dict[str, dict]:
    """The prologue and epilogue of a loop (module docstring): per region, the always and the
    conditional instruction indices."""
    g = Cfg(insns, labels)
    head, tail = loop
    body = {b for b in range(len(g.start)) if head <= g.start[b] <= tail}
    hb = g.block_of[head]
    # prologue: from the entry, not through the loop, to a block with an edge into the head
    fwd = g.reach([0], g.succ, body)
    into = {b for b in fwd if hb in g.succ[b]}
    back = g.reach(list(into), g.pred, body)
    pro = fwd & back
    out: dict[str, dict] = {}
    dom = g.dominators(0, lambda b: g.pred[b], pro) if pro else {}
    # the blocks dominating every edge into the head: those dominating all its predecessors
    ent = [p for p in g.pred[hb] if p in pro]
    always_p = set.intersection(*(dom[p] for p in ent)) if ent else set()
    # epilogue: from the loop's exit, not through the loop, to an EXIT. The exit is the
    # instruction after a conditional back-edge; a loop closed by an unconditional one leaves
    # by its branches out of the body (or ends in an EXIT inside it: no epilogue)
    if insns[tail].pred not in ("", "PT"):
        roots = [g.block_of[tail + 1]] if tail + 1 < len(insns) else []
    else:
        roots = sorted({s for b in body for s in g.succ[b] if s not in body})
    epi: set[int] = set()
    always_e: set[int] = set()
    if roots:
        fwd_e = g.reach(roots, g.succ, body)
        to_exit = g.reach([b for b in fwd_e if b in g.exits], g.pred, body)
        epi = (fwd_e & to_exit) - (pro - always_p)
        virt = -1  # the one exit every EXIT block leads to
        ex = {b for b in epi if b in g.exits}

        def rpred(b):  # in the reversed graph: the successors, and `virt` for an EXIT block
            if b == virt:
                return []
            return [s for s in g.succ[b] if s in epi] + ([virt] if b in ex else [])

        pdom = g.dominators(virt, rpred, epi | {virt})
        starts = [pdom[r] for r in roots if r in epi]
        always_e = set.intersection(*starts) - {virt} if starts else set()

    def idx(blocks):
        return sorted(i for b in blocks for i in range(g.start[b], g.end[b]))

    out["prologue"] = {"always": idx(always_p), "conditional": idx(pro - always_p)}
    out["epilogue"] = {"always": idx(always_e), "conditional": idx(epi - always_e)}
    return out


# --------------------------------------------------------------------------- loops


def _loops(insns, labels):
    """(head, back-edge index, conditional) of every backward branch (fa4_sass_compare's)."""
    return [(t, i, c) for i, t, c in _backward_branches(insns, labels)]


def consumer_loop(insns, labels) -> tuple[int, int] | None:
    """(head, back-edge index) of the consumer's K/V loop (module docstring)."""
    from benchmarks.fa3_bwd_sass import conditional_mask

    cands = []
    for t, i, cond in _loops(insns, labels):
        kinds = {opclass(x) for x in insns[t : i + 1] if x.base == "HGMMA"}
        if cond and len(kinds) == 2:
            cands.append((t, i))
    inner = [(t, i) for t, i in cands if not any(t <= a and b <= i and (a, b) != (t, i)
                                                 for a, b in cands)]  # fmt: skip
    found = []
    for t, i in inner:
        skipped = conditional_mask(insns, labels, t, i)
        masked = any(
            x.base == "FSEL" and "-INF" in x.args
            for x, sk in zip(insns[t : i + 1], skipped, strict=True)
            if not sk
        )
        n = sum(x.base == "HGMMA" for x in insns[t : i + 1])
        found.append((masked, -n, i - t, t, i))
    return (min(found)[3], min(found)[4]) if found else None


# --------------------------------------------------------------------------- analysis


def _mark(ins) -> str:
    return "*" if ins.base in MARKED else " "


def _sync_name(ins) -> str:
    bar = _BAR.search(ins.args)
    c = opclass(ins)
    if c.startswith("SYNCS"):
        return f"{c.split()[-1]} [{bar.group(1) if bar else '?'}]"
    return f"{ins.op.split('.')[0]}.{ins.op.split('.')[1]} {ins.args.strip()}"


def region_summary(insns, reg: dict, kind: str) -> dict:
    """Class counts of one region's always and conditional paths, and its sync facts."""
    alw = [insns[i] for i in reg["always"]]
    cond = [insns[i] for i in reg["conditional"]]
    ca, cc = Counter(opclass(x) for x in alw), Counter(opclass(x) for x in cond)
    res = {
        "always": {k: ca[k] for k in CLASSES if ca[k]},
        "always_total": len(alw),
        "conditional": {k: cc[k] for k in CLASSES if cc[k]},
        "conditional_total": len(cond),
        "span": (
            f"{min(x.addr for x in alw + cond):#06x}-{max(x.addr for x in alw + cond):#06x}"
            if alw or cond
            else ""
        ),
    }
    first = next((k for k, x in enumerate(alw) if x.base == "HGMMA"), len(alw))
    before = alw[:first] if kind == "prologue" else alw
    res["syncs_before_first_hgmma"] = [
        _sync_name(x)
        for x in before
        if (x.base == "SYNCS" and ".EXCH" not in x.op and ("TRYWAIT" in x.op or "ARRIVE" in x.op))
        or x.base == "BAR"
    ]
    res["insns_before_first_hgmma"] = first
    res["stretches"] = stretches(insns, reg, kind)
    return res


def _count(path) -> dict:
    c = Counter(opclass(x) for x in path)
    slow = ("LDC/ULDC (params)", "S2R/S2UR", "MUFU other", "BAR.SYNC")
    return {"n": len(path), **{k: c[k] for k in slow if c[k]}}


def stretches(insns, reg: dict, kind: str) -> dict[str, dict]:
    """Instruction counts of the stretches that lie on a tile's critical path (with the
    parameter loads, special-register reads, MUFU and BAR.SYNC among them). Prologue (always
    path): from the role's setmaxnreg to its first mbarrier wait, from the last wait before
    the first HGMMA to it, and from the setmaxnreg to the first UTMALDG (the producer's first
    load issue). Epilogue (address order, both paths: what the storing warp issues, LSE lanes
    included): from the last WARPGROUP.DEPBAR (P·V retired) to the first UTMASTG."""
    out: dict[str, dict] = {}
    if kind == "prologue":
        alw = [insns[i] for i in reg["always"]]
        split = next((k for k, x in enumerate(alw) if x.base == "USETMAXREG"), None)
        if split is None:
            return out
        rest = alw[split + 1 :]
        hg = next((k for k, x in enumerate(rest) if x.base == "HGMMA"), None)
        tma = next((k for k, x in enumerate(rest) if x.base == "UTMALDG"), None)
        waits = [k for k, x in enumerate(rest) if x.base == "SYNCS" and "TRYWAIT" in x.op]
        if hg is not None:
            pre = [k for k in waits if k < hg]
            if pre:
                out["setmaxnreg -> first mbarrier wait"] = _count(rest[: pre[0]])
                out["last wait -> first HGMMA"] = _count(rest[pre[-1] + 1 : hg])
        if tma is not None:
            out["setmaxnreg -> first UTMALDG"] = _count(rest[:tma])
    else:
        rows = sorted(reg["always"] + reg["conditional"])
        dep = [i for i in rows if insns[i].op.startswith("WARPGROUP.DEPBAR")]
        st = [i for i in rows if insns[i].base == "UTMASTG"]
        if dep and st and st[0] > dep[-1]:
            out["P·V retired -> first UTMASTG"] = _count(
                [insns[i] for i in rows if dep[-1] < i < st[0]]
            )
    return out


def _listing(insns, reg: dict) -> str:
    cond = set(reg["conditional"])
    rows = sorted(reg["always"] + reg["conditional"])
    return "\n".join(
        f"{insns[i].addr:06x} {'c' if i in cond else ' '}{_mark(insns[i])} "
        f"{opclass(insns[i]):24s} {insns[i].pred:6s} {insns[i].op} {insns[i].args}"
        for i in rows
    )


def loop_table(insns, labels, loop) -> dict:
    """Always-path class counts of a loop, its conditional total and its span."""
    from benchmarks.fa3_bwd_sass import conditional_mask

    head, tail = loop
    skipped = conditional_mask(insns, labels, head, tail)
    always = Counter(
        opclass(x) for x, sk in zip(insns[head : tail + 1], skipped, strict=True) if not sk
    )
    return {
        "span": f"{insns[head].addr:#06x}-{insns[tail].addr:#06x}",
        "always": {k: always[k] for k in CLASSES if always[k]},
        "always_total": sum(always.values()),
        "conditional_total": sum(skipped),
    }


def analyse(text: str, facts: dict, listing: str | None) -> dict:
    """Everything printed for one build."""
    from benchmarks.fa3_bwd_sass import parse_sass

    insns, labels = parse_sass(text)
    res = {
        "facts": facts,
        "max_reg": max((int(r) for r in re.findall(r"\bR(\d+)\b", text)), default=None),
        "setmaxnreg": setmaxnreg(text),
        "kernel_insns": len(insns),
        "kernel_classes": dict(Counter(opclass(x) for x in insns)),
        "loops": {},
        "regions": {},
        "listing": {},
    }
    for role, find in (("consumer", consumer_loop), ("producer", producer_loop)):
        loop = find(insns, labels)
        if loop is not None:
            res[f"{role}_enclosed"] = any(
                cond
                and t < loop[0]
                and i > loop[1]
                and any(x.base == marker for x in insns[t : i + 1])
                for t, i, cond in _loops(insns, labels)
                for marker in (("HGMMA",) if role == "consumer" else ("UTMALDG",))
            )
        res["loops"][role] = loop_table(insns, labels, loop) if loop else None
        if loop is None:
            continue
        for kind, reg in regions(insns, labels, loop).items():
            res["regions"][f"{role} {kind}"] = region_summary(insns, reg, kind)
            if kind == listing:
                res["listing"][f"{role} {kind}"] = _listing(insns, reg)
    return res


# --------------------------------------------------------------------------- report


W = 14


def _row(name: str, a, b, diff: bool = False) -> str:
    extra = f"{b - a:>+{W}d}" if diff and isinstance(a, int) and isinstance(b, int) else ""
    return f"{name:36s}{a!s:>{W}s}{b!s:>{W}s}{extra}"


def _hg(r: dict, kind: str) -> int:
    return r["always"].get(f"HGMMA {kind}", 0) + r["conditional"].get(f"HGMMA {kind}", 0)


def report(fa4: dict, ours: dict, head_dim: int, causal: bool) -> str:
    """The side-by-side tables."""
    mode = "causal" if causal else "non-causal"
    fa, fo = fa4["facts"], ours["facts"]
    lse = "with LSE" if fa.get("lse") else "no LSE"
    lines = [f"=== bf16 D {head_dim} {mode}: FA4 4.0.0b36 SM90 forward ({lse}) vs ours ===", ""]
    lines.append(f"{'':36s}{'FA4':>{W}s}{'ours':>{W}s}{'ours-FA4':>{W}s}")
    lines.append(_row("tile (rows x keys)", fa["tile"], fo["tile"]))
    lines.append(_row("K/V stages", fa["stages"], fo["stages"]))
    lines.append(_row("consumer warpgroups", fa["consumer_wgs"], fo["consumer_wgs"]))
    lines.append(_row("threads per CTA", fa["threads"], fo["threads"]))
    lines.append(_row("ptxas registers (launch)", fa.get("registers"), fo.get("registers")))
    lines.append(_row("highest register in SASS", fa4["max_reg"], ours["max_reg"]))
    sp = [f"{f.get('spill_stores')}/{f.get('spill_loads')}" for f in (fa, fo)]
    lines.append(_row("spill stores/loads (B)", *sp))
    for k, name in (("dealloc", "setmaxnreg producer"), ("alloc", "setmaxnreg consumers")):
        lines.append(_row(name, fa4["setmaxnreg"][k], ours["setmaxnreg"][k]))
    lines.append(_row("shared storage (B)", fa["smem_bytes"], fo["smem_bytes"], diff=True))
    lines.append(_row("LSE written", fa.get("lse"), fo.get("lse")))
    lines.append(_row("SASS instructions (kernel)", fa4["kernel_insns"], ours["kernel_insns"],
                      diff=True))  # fmt: skip
    lines.append(f"  FA4 flags:  {fa['flags']}")
    lines.append(f"  ours flags: {fo['flags']}")
    for role in ("consumer", "producer"):
        a, b = fa4["loops"].get(role), ours["loops"].get(role)
        lines += ["", f"{role} K/V loop, per block and warp (always path)"]
        if a is None or b is None:
            lines.append(f"  (loop not found: FA4 {a is not None}, ours {b is not None})")
            continue
        lines.append(_row("  span", a["span"], b["span"]))
        for c in CLASSES:
            if a["always"].get(c) or b["always"].get(c):
                lines.append(_row("  " + c, a["always"].get(c, 0), b["always"].get(c, 0),
                                  diff=True))  # fmt: skip
        lines.append(_row("  total (always)", a["always_total"], b["always_total"], diff=True))
        lines.append(_row("  conditional (skipped)", a["conditional_total"],
                          b["conditional_total"], diff=True))  # fmt: skip
    for whose, r in (("FA4's", fa4), ("our", ours)):
        for role in ("consumer", "producer"):
            if r.get(f"{role}_enclosed"):
                lines += [
                    "",
                    f"NOTE: {whose} {role} K/V loop lies inside a tile loop (persistent): its "
                    "prologue / epilogue below are approximate (module docstring)",
                ]
    for role, kind in REGIONS:
        key = f"{role} {kind}"
        a, b = fa4["regions"].get(key), ours["regions"].get(key)
        lines += ["", f"{key}: once per tile and warp of the role"]
        if a is None or b is None:
            lines.append(f"  (not found: FA4 {a is not None}, ours {b is not None})")
            continue
        lines.append(
            f"{'':36s}{'FA4 always':>{W}s}{'ours always':>{W}s}{'ours-FA4':>{W}s}"
            f"{'FA4 cond':>{W}s}{'ours cond':>{W}s}"
        )
        lines.append(f"{'  span':36s}{a['span']:>{2 * W}s}  {b['span']}")
        for c in CLASSES:
            va, vb = a["always"].get(c, 0), b["always"].get(c, 0)
            ca, cb = a["conditional"].get(c, 0), b["conditional"].get(c, 0)
            if va or vb or ca or cb:
                lines.append(
                    f"{'  ' + c:36s}{va:>{W}d}{vb:>{W}d}{vb - va:>+{W}d}{ca:>{W}d}{cb:>{W}d}"
                )
        ta, tb = a["always_total"], b["always_total"]
        lines.append(
            f"{'  total':36s}{ta:>{W}d}{tb:>{W}d}{tb - ta:>+{W}d}"
            f"{a['conditional_total']:>{W}d}{b['conditional_total']:>{W}d}"
        )
        if role == "consumer":
            what = "before the first HGMMA" if kind == "prologue" else "(always path)"
            for who, r in (("FA4", a), ("ours", b)):
                body = ", ".join(r["syncs_before_first_hgmma"]) or "-"
                lines.append(f"    {who:4s} mbarrier / named barrier ops {what}: {body}")
            if kind == "prologue":
                lines.append(
                    f"    instructions before the first HGMMA (always): FA4 "
                    f"{a['insns_before_first_hgmma']}, ours {b['insns_before_first_hgmma']}"
                )
        for name in dict.fromkeys([*a["stretches"], *b["stretches"]]):  # first seen, in order
            for who, r in (("FA4", a), ("ours", b)):
                st = r["stretches"].get(name)
                body = ", ".join(f"{k} {v}" for k, v in st.items() if k != "n") if st else ""
                n = st["n"] if st else "-"
                lines.append(
                    f"    {who:4s} {name}: {n} instructions{' (' + body + ')' if body else ''}"
                )
    lines += ["", "differences in plain words"]
    lines += ["  " + t for t in summary(fa4, ours)]
    return "\n".join(lines)


def summary(fa4: dict, ours: dict) -> list[str]:
    """Sentences on what differs outside the loop, from the counts."""
    out: list[str] = []
    rs = {n: r["regions"] for n, r in (("FA4", fa4), ("ours", ours))}
    loops = {n: r["loops"]["consumer"] for n, r in (("FA4", fa4), ("ours", ours))}
    cp = {n: rs[n].get("consumer prologue") for n in rs}
    ce = {n: rs[n].get("consumer epilogue") for n in rs}
    if not all(cp.values()) or not all(ce.values()) or not all(loops.values()):
        return ["(a region or loop was not found)"]
    for n in rs:
        kq = loops[n]["always"].get("HGMMA Q·K (SS)", 0) or 1
        kp = loops[n]["always"].get("HGMMA P·V (RS)", 0) or 1
        qk = _hg(cp[n], "Q·K (SS)")
        pv_pro, pv_epi = _hg(cp[n], "P·V (RS)"), _hg(ce[n], "P·V (RS)")
        qk_epi = _hg(ce[n], "Q·K (SS)")
        out.append(
            f"{n}: {qk} Q·K HGMMAs before the loop ({qk / kq:g} block(s) peeled), {pv_pro} P·V "
            f"before it; after it {pv_epi} P·V HGMMAs ({pv_epi / kp:g} block(s)) and {qk_epi} Q·K"
        )
    for n in rs:
        e = ce[n]
        allc = Counter(e["always"]) + Counter(e["conditional"])
        store = "TMA (UTMASTG)" if allc["UTMASTG/UBLKCP"] else "registers (STG)"
        out.append(
            f"{n}: O leaves by {store} from {allc['STSM/STS']} STSM/STS per thread; "
            f"{allc['STG/ST']} STG (LSE) per thread on some path; epilogue named barriers "
            f"always: {e['always'].get('BAR.SYNC', 0)} BAR.SYNC, {e['always'].get('BAR.ARV', 0)}"
            f" BAR.ARV; MEMBAR/FENCE {allc['MEMBAR/FENCE']}"
        )
    for n in rs:
        p = cp[n]
        allc = Counter(p["always"]) + Counter(p["conditional"])
        waits = [s for s in p["syncs_before_first_hgmma"] if s.startswith("wait")]
        out.append(
            f"{n}: kernel start: {allc['SYNCS init (EXCH)']} mbarrier inits, "
            f"{allc['MEMBAR/FENCE']} fences (on warp 0's init path), "
            f"{allc['UTMACCTL/CMDFLUSH']} descriptor prefetches; "
            f"{len(waits)} mbarrier wait(s) before the first HGMMA ({', '.join(waits)}); "
            f"{p['always'].get('CS2R (zeroing)', 0)} CS2R zeroing and "
            f"{p['always'].get('LDC/ULDC (params)', 0)} LDC/ULDC on the always path"
        )
    tot = {n: cp[n]["always_total"] + ce[n]["always_total"] for n in rs}  # consumer, once per tile
    d = tot["ours"] - tot["FA4"]
    per = loops["FA4"]["always_total"]
    out.append(
        f"consumer always path outside the loop: FA4 {tot['FA4']}, ours {tot['ours']} "
        f"instructions per warp and tile ({d:+d}: {d / per:+.2f} K/V blocks' worth of FA4's "
        f"loop, {per} per block); loop per block: FA4 {per}, ours "
        f"{loops['ours']['always_total']}"
    )
    pp = {n: rs[n].get("producer prologue") for n in rs}
    pe = {n: rs[n].get("producer epilogue") for n in rs}
    if all(pp.values()) and all(pe.values()):
        out.append(
            "producer outside its loop (always): FA4 "
            f"{pp['FA4']['always_total']} + {pe['FA4']['always_total']}, ours "
            f"{pp['ours']['always_total']} + {pe['ours']['always_total']} (prologue + epilogue);"
            f" UTMALDG in the prologue (any path): FA4 "
            f"{_n(pp['FA4'], 'UTMALDG')}, ours {_n(pp['ours'], 'UTMALDG')}; in the epilogue: "
            f"FA4 {_n(pe['FA4'], 'UTMALDG')}, ours {_n(pe['ours'], 'UTMALDG')}"
        )
    return out


def _n(r: dict, c: str) -> int:
    return r["always"].get(c, 0) + r["conditional"].get(c, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--fa4-lse", action="store_true", help="FA4 writes the LSE (training fwd)")
    ap.add_argument(
        "--set", action="append", default=[], help="ours: FIELD=VALUE of Fa3Config (repeat)"
    )
    ap.add_argument("--keep", help="write the builds' .sass/.json here")
    ap.add_argument("--from", dest="from_dir", help="analyse the builds kept in this folder")
    ap.add_argument("--listing", choices=("prologue", "epilogue"), help="also print these regions")
    ap.add_argument("--wheel-dir", default=str(REPO / ".gpu"), help="where the FA4 wheels are")
    ap.add_argument("--json", help="write the analysis here")
    ap.add_argument("--build", choices=BUILDS, help=argparse.SUPPRESS)  # child
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.build:
        build(args.build, args.head_dim, args.causal, Path(args.out), Path(args.wheel_dir),
              args.fa4_lse, args.set)  # fmt: skip
        return 0

    folder, tmp = work_folder(args.from_dir, args.keep, "fa4_fwd_sass_")
    if not args.from_dir:
        require_fa4("fa4_fwd_sass_compare", args.wheel_dir)
        for name in BUILDS:
            cmd = [sys.executable, "-m", "benchmarks.fa4_fwd_sass_compare", "--build", name]
            cmd += ["--head-dim", str(args.head_dim), "--out", str(folder)]
            cmd += ["--wheel-dir", args.wheel_dir] + (["--causal"] if args.causal else [])
            cmd += ["--fa4-lse"] if args.fa4_lse else []
            cmd += [f"--set={c}" for c in args.set]
            subprocess.run(cmd, check=True, cwd=REPO)
    res: dict = {}
    for name in BUILDS:
        stem = folder / _stem(name, args.head_dim, args.causal, args.fa4_lse)
        if not stem.with_suffix(".sass").exists():
            sys.exit(f"fa4_fwd_sass_compare: {stem}.sass not found")
        facts = json.loads(stem.with_suffix(".json").read_text())
        res[name] = analyse(stem.with_suffix(".sass").read_text(), facts, args.listing)
    print(report(res["fa4"], res["ours"], args.head_dim, args.causal))
    if args.listing:
        for role in ("consumer", "producer"):
            for name in BUILDS:
                key = f"{role} {args.listing}"
                print(f"\n--- {name}: {key} ('c': conditional, '*': sync / TMA / HGMMA / gmem)")
                print(res[name]["listing"].get(key, "(not found)"))
    if args.json:
        for r in res.values():
            r.pop("listing", None)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
