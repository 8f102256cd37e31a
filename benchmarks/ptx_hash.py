"""Shared parts of the PTX-hash scripts (fa3_ptx_hash, fa3_bwd_ptx_hash, triton_ptx_hash):
hashing PTX with and without its debug information, the command line of the CuTe DSL ones
(`cli`), and comparing two runs' JSON files (a config passes when its
PTX is the same once `.loc`/`.file` lines, and where both runs hashed it the DWARF sections,
are left out; or, where both runs hashed it, when only the kernels' symbol names differ: the
CuTe DSL names a kernel after its class's module path and its arguments)."""

from __future__ import annotations

import argparse
import hashlib
import json
import re

_DEBUG_LINE = re.compile(r"^\s*\.(loc|file)\b.*$\n?", re.MULTILINE)
# DWARF sections (Triton writes .debug_abbrev / .debug_info after the code): they hold the
# file and line of every inlined call, so moving a function to another file changes them.
_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug_.*", re.MULTILINE | re.DOTALL)
_ENTRY = re.compile(r"^\s*(?:\.visible\s+)?\.entry\s+(\w+)", re.MULTILINE)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _unnamed(code: str) -> str:
    """`code` with each kernel's symbol name (its `.entry` name, also the prefix of its
    parameters' names) replaced by kernel0, kernel1, ... in order of definition."""
    for i, name in enumerate(_ENTRY.findall(code)):
        code = code.replace(name, f"kernel{i}")
    return code


def hashes(ptx: str) -> dict[str, str]:
    """SHA-256 of the PTX: as written (`ptx`), with `.loc`/`.file` lines removed
    (`ptx_no_debug`), with the DWARF sections removed too (`code`: instructions and
    declarations only), and that with the kernels' symbol names replaced (`code_unnamed`)."""
    no_lines = _DEBUG_LINE.sub("", ptx)
    code = _DEBUG_SECTION.sub("", no_lines)
    return {
        "ptx": _sha(ptx),
        "ptx_no_debug": _sha(no_lines),
        "code": _sha(code),
        "code_unnamed": _sha(_unnamed(code)),
    }


def _same_code(a: dict, b: dict) -> bool:
    if a["ptx_no_debug"] == b["ptx_no_debug"]:
        return True
    return "code" in a and "code" in b and a["code"] == b["code"]


def _same_unnamed(a: dict, b: dict) -> bool:
    if _same_code(a, b):
        return True
    return "code_unnamed" in a and "code_unnamed" in b and a["code_unnamed"] == b["code_unnamed"]


def save(path: str | None, result: dict) -> None:
    """Write one run's hashes as JSON (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)


def _load(paths: list[str]) -> dict:
    merged: dict = {}
    for p in paths:
        with open(p) as f:
            merged.update(json.load(f))
    return merged


def compare(paths: list[str]) -> int:
    """BEFORE AFTER, each path a comma-separated list of shard files. 0 if every config's PTX
    is identical without debug information, up to the kernels' symbol names, else 1 (the
    differing configs are printed, and those that differ only in symbol names)."""
    before, after = (_load(p.split(",")) for p in paths[:2])
    if set(before) != set(after):
        print("case sets differ:", sorted(set(before) ^ set(after)))
        return 1
    exact = sum(before[k]["ptx"] == after[k]["ptx"] for k in before)
    no_debug = sum(before[k]["ptx_no_debug"] == after[k]["ptx_no_debug"] for k in before)
    code = sum(_same_code(before[k], after[k]) for k in before)
    unnamed = sum(_same_unnamed(before[k], after[k]) for k in before)
    print(
        f"{len(before)} configs: {exact} identical PTX, {no_debug} identical without debug "
        f"lines, {code} identical without any debug information, {unnamed} identical up to "
        "the kernels' symbol names"
    )
    for k in sorted(before):
        if not _same_unnamed(before[k], after[k]):
            print("DIFFERS:", k)
        elif not _same_code(before[k], after[k]):
            print("SYMBOL NAMES ONLY:", k)
    return 0 if unnamed == len(before) else 1


def cli(argv, doc: str, cases, case_id, compile_one, flags: tuple = ()) -> int:
    """The command line of a script that compiles one PTX module per case: `--json PATH`
    (hashes of cases i, i+n, ... for `--shard i/n`) or `--compare BEFORE AFTER`. `cases(args)`
    lists the cases, `case_id(case)` names one, `compile_one(case)` returns its PTX; `flags`
    are (name, help) of extra store-true options `cases` reads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write {case: hashes} here")
    ap.add_argument("--shard", default="0/1", help="i/n: cases i, i+n, i+2n, ...")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="BEFORE AFTER [AFTER ...]")
    for flag, text in flags:
        ap.add_argument(flag, action="store_true", help=text)
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    i, n = (int(x) for x in args.shard.split("/"))
    result = {}
    for case in cases(args)[i::n]:
        result[case_id(case)] = hashes(compile_one(case))
        print(case_id(case), result[case_id(case)]["ptx"][:16], flush=True)
    save(args.json, result)
    return 0
