"""Shared parts of the PTX-hash scripts (fa3_ptx_hash, triton_ptx_hash): hashing PTX with and
without its debug information, and comparing two runs' JSON files (a config passes when its
PTX is the same once `.loc`/`.file` lines, and where both runs hashed it the DWARF sections,
are left out)."""

from __future__ import annotations

import hashlib
import json
import re

_DEBUG_LINE = re.compile(r"^\s*\.(loc|file)\b.*$\n?", re.MULTILINE)
# DWARF sections (Triton writes .debug_abbrev / .debug_info after the code): they hold the
# file and line of every inlined call, so moving a function to another file changes them.
_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug_.*", re.MULTILINE | re.DOTALL)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def hashes(ptx: str) -> dict[str, str]:
    """SHA-256 of the PTX: as written (`ptx`), with `.loc`/`.file` lines removed
    (`ptx_no_debug`), and with the DWARF sections removed too (`code`: instructions and
    declarations only)."""
    no_lines = _DEBUG_LINE.sub("", ptx)
    return {
        "ptx": _sha(ptx),
        "ptx_no_debug": _sha(no_lines),
        "code": _sha(_DEBUG_SECTION.sub("", no_lines)),
    }


def _same_code(a: dict, b: dict) -> bool:
    if a["ptx_no_debug"] == b["ptx_no_debug"]:
        return True
    return "code" in a and "code" in b and a["code"] == b["code"]


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
    is identical without debug lines, else 1 (the differing configs are printed)."""
    before, after = (_load(p.split(",")) for p in paths[:2])
    if set(before) != set(after):
        print("case sets differ:", sorted(set(before) ^ set(after)))
        return 1
    exact = sum(before[k]["ptx"] == after[k]["ptx"] for k in before)
    no_debug = sum(before[k]["ptx_no_debug"] == after[k]["ptx_no_debug"] for k in before)
    code = sum(_same_code(before[k], after[k]) for k in before)
    print(
        f"{len(before)} configs: {exact} identical PTX, {no_debug} identical without debug "
        f"lines, {code} identical without any debug information"
    )
    for k in sorted(before):
        if not _same_code(before[k], after[k]):
            print("DIFFERS:", k)
    return 0 if code == len(before) else 1
