"""The mutation check (scripts/mutants.py): every pattern still matches the source exactly
once, and a fast subset of the mutants is killed by the suite (the whole CPU list runs with
`python scripts/mutants.py`; docs/testing.md has the table)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import HAS_CUDA

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "mutants.py"


@functools.cache
def _mutants():
    spec = importlib.util.spec_from_file_location("flashsuite_mutants", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_pattern_occurs_exactly_once() -> None:
    m = _mutants()
    problems = m.check_patterns(m.MUTANTS + m.GPU_MUTANTS)
    assert not problems, "\n".join(problems)
    names = [x.name for x in m.MUTANTS + m.GPU_MUTANTS]
    assert len(set(names)) == len(names), "mutant names must be unique"
    assert set(m.CI_SUBSET) <= set(names)


@pytest.mark.skipif(HAS_CUDA, reason="the CPU mutants run under the Triton interpreter")
def test_ci_subset_of_mutants_is_killed() -> None:
    """The CI subset, two at a time (each worker its own copy), plus one fa3 mutant, which on a
    CPU host selects only skipped tests: that must read SKIPPED (never exercised), not
    SURVIVED or killed."""
    m = _mutants()
    chosen = [x for x in m.MUTANTS if x.name in m.CI_SUBSET]
    fa3 = m.GPU_MUTANTS[0]
    rows = m.run([*chosen, fa3], jobs=2)
    assert [r["mutant"] for r in rows] == [x.name for x in [*chosen, fa3]]
    *rows, fa3_row = rows
    survivors = [f"{r['mutant']}: {r['status']} {r['killed_by']}" for r in rows]
    survivors = [s for s, r in zip(survivors, rows, strict=True) if r["status"] != "killed"]
    assert not survivors, "\n".join(survivors)
    assert fa3_row["status"] == "SKIPPED", fa3_row


def test_copy_keeps_the_callers_other_import_paths(tmp_path, monkeypatch) -> None:
    """A GPU host's PYTHONPATH carries the CuTe DSL's site folder: the mutants' copy keeps it
    (dropping it made fa3 unavailable, so every fa3 mutant ran only skipped tests), but never
    the original repository, which would shadow the mutated copy."""
    m = _mutants()
    site = str(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", f"{m.ROOT}:{site}")
    path = m._env(tmp_path)["PYTHONPATH"].split(":")
    assert path[:2] == [str(tmp_path / "_pkg"), str(tmp_path / "repo")]
    assert site in path and str(m.ROOT) not in path
