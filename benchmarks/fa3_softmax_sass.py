"""Where ptxas puts the fa3 forward's wgmma waits around the softmax, on the CPU (sm_90a).

    python -m benchmarks.fa3_softmax_sass --head-dim 256 --causal
    python -m benchmarks.fa3_softmax_sass --head-dim 128 --set tile_n=128 --set softmax_apart=1

With intra-WG overlap a consumer warpgroup issues Q·Kᵀ(n) and P·V(n-1), waits for the first
(`WARPGROUP.DEPBAR.LE gsb0, 0x1`), runs the softmax of block n and only then waits for P·V
(`... 0x0`); the softmax overlaps P·V only if ptxas leaves that second wait after it. The PTX
order does not fix this: ptxas moves the wait up (Fa3Config.softmax_apart says when). This
compiles the config (the shipped one for --head-dim / --causal, with each --set FIELD=VALUE
replaced), disassembles it with Triton's nvdisasm and prints, for every 0x1 wait of the
consumer's main loop, the exponentials (MUFU.EX2) and row-max instructions (FMNMX) ptxas placed
between it and the next 0x0 wait, the kernel's counts of the instructions the softmax options
change (`op_counts`), its longest row-max and row-sum dependency chains (`chain_depths`) and
its registers zeroed from RZ (`zeroings`) and the exponentials of each overlapped loop's body
(`loop_exponentials`: TILE_N / 2 + 2 a thread, one per P element and row correction; more
means the compiler computes some twice), as JSON: `{"config": ..., "windows": [{"mufu": m,
"fmnmx": f}, ...], "counts": {...}, "chains": {"fmnmx": n, "fadd": n}, "cs2r_zero": n,
"loop_ex2": [n, ...], "loop_insns": [n, ...], "loop_ops": {...}}` (loop_insns: each
overlapped loop body's SASS instructions; loop_ops: the innermost one's by opcode).
Compiling imports benchmarks.fa3_probe, which sets the CUTE_DSL_* variables before cutlass is
imported: run it in its own process. `--serve` keeps that process for many builds (the tests':
importing torch and the DSL costs about as much as one build).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def overlap_windows(text: str) -> list[dict]:
    """For each `WARPGROUP.DEPBAR.LE gsb0, 0x1` of an `nvdisasm -c` listing, the MUFU.EX2 and
    FMNMX instructions before the next `... 0x0` wait (in listing order, so both sides of a
    branch count towards the window they sit in)."""
    from benchmarks.fa3_bwd_sass import parse_sass

    insns, _ = parse_sass(text)
    windows, open_window = [], None
    for ins in insns:
        if ins.op == "WARPGROUP.DEPBAR.LE":
            level = ins.args.replace(" ", "").split(",")[-1]
            if level == "0x1":
                open_window = {"mufu": 0, "fmnmx": 0}
                windows.append(open_window)
            elif level == "0x0":
                open_window = None
        elif open_window is not None:
            open_window["mufu"] += ins.op.startswith("MUFU.EX2")
            open_window["fmnmx"] += ins.base == "FMNMX"
    return windows


def loop_exponentials(text: str) -> list[int]:
    """MUFU.EX2 in the body of each loop (a conditional backward branch) that holds a
    `WARPGROUP.DEPBAR.LE gsb0, 0x1` wait, i.e. each overlapped main loop, innermost first.
    A body issues TILE_N / 2 + 2 of them a thread unless the compiler recomputes P (docs/
    results.md, "Short sequences": the persistent build's epilogue can bring that on)."""
    return [sum(b.op.startswith("MUFU.EX2") for b in body) for body in loop_bodies(text)]


def loop_bodies(text: str) -> list[list]:
    """The instructions of each overlapped main loop's body (as `loop_exponentials` finds
    them), innermost (shortest) first."""
    from benchmarks.fa3_bwd_sass import _branches, parse_sass

    insns, labels = parse_sass(text)
    loops = []
    for i, t, cond in _branches(insns, labels):
        body = insns[t : i + 1] if cond and t <= i else []
        if any(
            b.op == "WARPGROUP.DEPBAR.LE" and b.args.replace(" ", "").endswith(",0x1") for b in body
        ):
            loops.append(body)
    return sorted(loops, key=len)


def op_counts(text: str) -> dict[str, int]:
    """Instructions of the whole kernel that the softmax's options change: exponentials
    (MUFU.EX2; Fa3Config.ex2_emu moves some to the FMA pipe), warp votes (VOTE; the
    rescale_threshold build votes on O's rescale), shuffles (SHFL: the row max and sum, and
    fp8's quad exchange unless permute_v_keys), FMULs (O's rescale among them), and the moves of
    vector registers into uniform ones (R2UR: wgmma descriptors built per thread rather than per
    warpgroup, Fa3Config.wg_slice)."""
    from benchmarks.fa3_bwd_sass import parse_sass

    insns, _ = parse_sass(text)
    return {
        "mufu_ex2": sum(i.op.startswith("MUFU.EX2") for i in insns),
        "vote": sum(i.base == "VOTE" for i in insns),
        "shfl": sum(i.base == "SHFL" for i in insns),
        "fmul": sum(i.base == "FMUL" for i in insns),
        "r2ur": sum(i.base == "R2UR" for i in insns),
    }


def zeroings(text: str) -> int:
    """The kernel's registers zeroed from RZ (CS2R ... SRZ): acc_O before each tile among them,
    unless Fa3Config.o_zero_init."""
    from benchmarks.fa3_bwd_sass import parse_sass

    insns, _ = parse_sass(text)
    return sum(i.base == "CS2R" and "SRZ" in i.args for i in insns)


def chain_depths(text: str) -> dict[str, int]:
    """The longest dependency chain of FMNMX feeding FMNMX and of FADD feeding FADD in the
    listing (in listing order, through the registers each writes and reads): what a row's max
    and sum cost in latency when one warp per scheduler runs its softmax. In place, a row is
    one chain (tile_n / 4 - 1 deep plus the joins); Fa3Config.row_chains and softmax_apart
    split each into four. A guarded instruction extends a chain like any other."""
    from benchmarks.fa3_bwd_sass import parse_sass

    insns, _ = parse_sass(text)
    depth: dict[str, dict[str, int]] = {"FMNMX": {}, "FADD": {}}
    longest = dict.fromkeys(depth, 0)
    for ins in insns:
        regs = [r.strip() for r in ins.args.split(",")]
        dest, srcs = regs[0], [r.lstrip("-|").rstrip("|") for r in regs[1:]]
        for op, seen in depth.items():
            if ins.base == op:
                seen[dest] = 1 + max((seen.get(r, 0) for r in srcs), default=0)
                longest[op] = max(longest[op], seen[dest])
            else:
                seen.pop(dest, None)  # the register now holds something else
    return {"fmnmx": longest["FMNMX"], "fadd": longest["FADD"]}


RESULT = "@@sass"  # --serve: the prefix of each answer line (the compile may print too)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE (repeat)")
    ap.add_argument("--fp8", action="store_true", help="the e4m3 table's config and build")
    ap.add_argument(
        "--fp8-blocks", action="store_true", help="with --fp8: the per-block descale build"
    )
    ap.add_argument(
        "--serve",
        action="store_true",
        help="read one JSON list of these arguments a line from stdin and answer each with a\n"
        f"line '{RESULT} <json>' (or '{RESULT} {{\"error\": ...}}'): the DSL imported once",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if not args.serve:
        print(json.dumps(build(ap, args)))
        return 0
    for line in sys.stdin:
        try:
            out = build(ap, ap.parse_args(json.loads(line)))
        except SystemExit as exc:  # ap.error: the message went to stderr
            out = {"error": f"arguments refused (exit {exc.code}): {line.strip()}"}
        except Exception as exc:  # reported to the caller; the server goes on
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(RESULT, json.dumps(out), flush=True)
    return 0


def build(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Compile the build `args` names and read its SASS (the JSON fields of the docstring)."""
    if args.fp8_blocks and not args.fp8:
        ap.error("--fp8-blocks: needs --fp8")

    from benchmarks import fa3_probe as probe  # first: sets CUTE_DSL_* before cutlass's import
    from benchmarks.fa3_bwd_sass import disassemble
    from benchmarks.fa3_fwd_ab import parse_variant

    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    import torch

    from flashsuite.fa3.compile import CompileKey, compile_forward
    from flashsuite.fa3.configs import can_implement, get_config

    try:
        _, changes = parse_variant("set:" + ",".join(args.set), table_ok=False)
    except ValueError as exc:
        ap.error(str(exc))
    from flashsuite.fa3.configs import FP8_DTYPE

    dtype = FP8_DTYPE if args.fp8 else torch.bfloat16
    cfg = dataclasses.replace(get_config(args.head_dim, dtype, args.causal), **changes)
    ok, why = can_implement(cfg, args.head_dim, dtype)
    if not ok:
        ap.error(f"--set: the config cannot be built: {why}")
    try:
        import tvm_ffi  # noqa: F401

        tvm = True
    except ImportError:
        tvm = False
    key = CompileKey(
        dtype, args.head_dim, args.causal, False, False, cfg, tvm_ffi=tvm,
        fp8_blocks=args.fp8_blocks,
    )  # fmt: skip
    compiled, log = probe._capture_fd2(lambda: compile_forward(key))
    facts = probe.parse_ptxas(log)
    listing = disassemble(compiled.__cubin__)
    windows = overlap_windows(listing)
    out = {"config": dataclasses.asdict(cfg), "windows": windows, "counts": op_counts(listing)}
    out["chains"] = chain_depths(listing)
    out["cs2r_zero"] = zeroings(listing)
    out["loop_ex2"] = loop_exponentials(listing)
    bodies = loop_bodies(listing)
    out["loop_insns"] = [len(body) for body in bodies]
    if bodies:  # the innermost loop's instructions by base opcode, most frequent first
        ops: dict[str, int] = {}
        for ins in bodies[0]:
            ops[ins.base] = ops.get(ins.base, 0) + 1
        out["loop_ops"] = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
    out.update(spill_stores=facts["spill_stores"], remarks=facts["remarks"])
    return out


if __name__ == "__main__":
    sys.exit(main())
