"""Repository hygiene that CI enforces: README and .ci/run agree, lint is clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci in readme, f".ci/run runs {ci!r}, which README.md does not show"


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(args: list[str]) -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff not installed")
    result = subprocess.run([ruff, *args, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# Product text speaks of the project and its users: no line of it tells how or when the code was
# written (numbered work sessions or rounds), refers to the project's ticket system or to
# thresholds named after its tickets, or cites a file that is not in the repository
# (docs/design.md holds the contract). Each pattern and each test string below is written so
# that its own source line does not match.
NARRATION = {
    "numbered work session": re.compile(r"\b[Ss]ession(?:s|'s)?\s+[0-9]|\b[Ss]ession's\b"),
    # "goes round 0 -> 1" (a token ring) is not a round of work.
    "numbered round of work": re.compile(r"\b[Rr]ounds?\s+[0-9]+\b(?!\s*->)"),
    "file outside the repository": re.compile(
        r"\b(?:DESIGN|TOOLCHAIN|STYLE|TRITON_HOPPER|CUTE_DSL_HOPPER)[.]md\b|[.][.]/shared\b"
    ),
    "ticket reference": re.compile(
        r"\b[Ii]ssue\s*#?\s*[0-9]+|\b[Tt]he\s+issue(?:'s)?\b|\b[Tt]racker\b"
    ),
    "threshold named after a ticket": re.compile(
        r"\b(?:its|the|an?|fa[0-9]'s|forward|backward)\s+bar(?:s)?\b"
    ),
}
PRODUCT_TEXT_DIRS = ("common", "dispatch", "fa1", "fa2", "fa3", "tests", "scripts", "benchmarks")
PRODUCT_TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml"}


def _product_text_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/results/: data
    for folder in PRODUCT_TEXT_DIRS:
        files += sorted(
            path
            for path in (ROOT / folder).rglob("*")
            if path.suffix in PRODUCT_TEXT_SUFFIXES and "__pycache__" not in path.parts
        )
    return files


def narration_findings(files: list[Path]) -> list[tuple[str, int, str, str]]:
    """(path, line number, what, line) for every line of `files` that matches a NARRATION
    pattern; path relative to the repository root where it lies inside it."""
    findings = []
    for path in files:
        rel = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            findings += [
                (rel, number, what, line.strip())
                for what, pattern in NARRATION.items()
                if pattern.search(line)
            ]
    return findings


def test_product_text_has_no_narration() -> None:
    files = _product_text_files()
    assert ROOT / "README.md" in files and len(files) > 20, f"only {len(files)} files scanned"
    findings = [
        f"{path}:{number}: {what}: {line}" for path, number, what, line in narration_findings(files)
    ]
    assert not findings, "product text that narrates its own writing:\n" + "\n".join(findings)


@pytest.mark.parametrize(
    "line",
    [
        "measured in session" + " 3 (commit abc1234)",
        "Round" + " 2 moved the tiles",
        "see DESIGN" + ".md for the contract",
        "bash ../" + "shared/gpu/make-bundle.sh",
        "the fa2 forward" + " bar is met",
        "the long sequences (where the" + " issue ba" + "rs are set)",
        "fixed for issue" + " 18",
        "as the tr" + "acker says",
    ],
)
def test_narration_patterns_catch(line: str, tmp_path: Path) -> None:
    text = tmp_path / "text.md"
    text.write_text(f"clean line\n{line}\n")
    found = narration_findings([text])
    assert found and all(number == 2 and text_line == line for _, number, _, text_line in found)


@pytest.mark.parametrize(
    "line",
    [
        "the producer issues TMA loads; QK(n+1) is issued before PV(n)",
        "the token goes round 0 -> 1 (-> 2) -> 0",
        'bar = "#" * (30 * done // total)',
        "cite docs/design.md for the contract; the session of pytest",
    ],
)
def test_narration_patterns_spare_product_prose(line: str, tmp_path: Path) -> None:
    text = tmp_path / "text.md"
    text.write_text(line + "\n")
    assert narration_findings([text]) == []
