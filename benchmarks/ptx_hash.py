"""Shared parts of the PTX-hash scripts (fa3_ptx_hash, triton_ptx_hash): hashing PTX with and
without its debug lines, and comparing two runs' JSON files."""

from __future__ import annotations

import hashlib
import json
import re

_DEBUG_LINE = re.compile(r"^\s*\.(loc|file)\b.*$\n?", re.MULTILINE)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def hashes(ptx: str) -> dict[str, str]:
    """{ptx, ptx_no_debug}: SHA-256 of the PTX as written and with `.loc`/`.file` removed."""
    return {"ptx": _sha(ptx), "ptx_no_debug": _sha(_DEBUG_LINE.sub("", ptx))}


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
    print(f"{len(before)} configs: {exact} identical PTX, {no_debug} identical without debug lines")
    for k in sorted(before):
        if before[k]["ptx_no_debug"] != after[k]["ptx_no_debug"]:
            print("DIFFERS:", k)
    return 0 if no_debug == len(before) else 1
