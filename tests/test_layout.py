"""The package layout docs/design.md describes, held by reading the source, not by convention.

- Import arrows: a version (fa1, fa2, fa3) imports only flashsuite.common and third-party
  packages; common imports no version and not the dispatcher; the dispatcher imports versions
  only inside functions (lazily, so `import flashsuite.dispatch` needs torch alone); nothing in
  the packages imports the lab code in benchmarks/.
- No package file is over 800 lines; the built wheel holds the five packages and no lab module.
- Every version's configs.py answers `config_for(params, ...)` with a frozen dataclass.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("fa1", "fa2", "fa3")
PACKAGES = ("common", "dispatch", *VERSIONS)
LAB_NAMES = ("tune", "probe", "ablate", "fp8_check", "overhead")
MAX_LINES = 800


def _modules() -> list[tuple[str, Path]]:
    return [(pkg, path) for pkg in PACKAGES for path in sorted((ROOT / pkg).glob("*.py"))]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute module name, at module level) for every import statement in `path`.

    Relative imports are resolved against the file's flashsuite package. `from X import a`
    yields X and X.a (a may be a submodule), so `from flashsuite import fa2` counts as fa2.
    """
    pkg = f"flashsuite.{path.parent.name}"
    tree = ast.parse(path.read_text(), filename=str(path))
    nested = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            nested.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    for node in ast.walk(tree):
        top = id(node) not in nested
        if isinstance(node, ast.Import):
            out += [(alias.name, top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.append((mod, top))
            out += [(f"{mod}.{alias.name}", top) for alias in node.names]
    return out


def _owner(module: str) -> str | None:
    """Which part of the repository a module name belongs to ('fa2', 'benchmarks', ...)."""
    parts = module.split(".")
    if parts[0] == "benchmarks":
        return "benchmarks"
    if parts[0] == "flashsuite" and len(parts) > 1 and parts[1] in PACKAGES:
        return parts[1]
    return None


@pytest.mark.parametrize("pkg,path", _modules(), ids=[f"{p}/{f.name}" for p, f in _modules()])
def test_import_arrows(pkg: str, path: Path) -> None:
    bad = []
    for module, top in _imports(path):
        owner = _owner(module)
        if owner is None or owner == pkg:
            continue
        if owner == "benchmarks":
            bad.append(f"{module}: the packages never import the lab code in benchmarks/")
        elif pkg in VERSIONS and owner != "common":
            bad.append(f"{module}: a version imports only flashsuite.common")
        elif pkg == "common":
            bad.append(f"{module}: common imports no version and not the dispatcher")
        elif pkg == "dispatch" and owner in VERSIONS and top:
            bad.append(f"{module}: the dispatcher imports versions inside functions only")
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_import_arrow_check_sees_violations(tmp_path: Path) -> None:
    """The parser above finds the imports it must reject (a check that cannot fail is none)."""
    fake = tmp_path / "fa2" / "x.py"
    fake.parent.mkdir()
    fake.write_text(
        "import flashsuite.fa3.kernels\n"
        "from flashsuite.dispatch import bench\n"
        "from .. import fa1\n"
        "def f():\n    from benchmarks import fa2_tune\n"
    )
    found = {(m, top) for m, top in _imports(fake)}
    assert ("flashsuite.fa3.kernels", True) in found
    assert ("flashsuite.dispatch.bench", True) in found
    assert ("flashsuite.fa1", True) in found
    assert ("benchmarks.fa2_tune", False) in found


def test_no_package_file_over_the_line_limit() -> None:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for _, p in _modules()}
    assert lengths, "no package file found"
    bad = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not bad, f"package files over {MAX_LINES} lines: {bad}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_has_the_same_config_interface(version: str) -> None:
    """configs.py of every version: a table of frozen dataclasses and `config_for(params, ...)`,
    the lookup its interface uses (fa1 and fa2 also take the arch: they run on several)."""
    import dataclasses
    import importlib

    import torch

    from flashsuite.common.validation import check_inputs

    configs = importlib.import_module(f"flashsuite.{version}.configs")
    q = torch.zeros(1, 256, 2, 64, dtype=torch.bfloat16)  # (B, N, H, D)
    v = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)  # (B, N, H, Dv): the larger one
    p = check_inputs(q, q, v, causal=True)
    if version == "fa3":
        cfg = configs.config_for(p)
        # The table's entry with config_for's dense choice: the tile counter of short causal
        # problems (configs._TILE_COUNTER), causal D = 64's short tiles (configs._SHORT_CAUSAL).
        table = configs.get_config(64, torch.bfloat16, True, 256)
        short = configs._SHORT_CAUSAL[64]
        assert cfg == dataclasses.replace(table, tile_counter=True, l2_section_mib=16, **short)
    else:
        cfg = configs.config_for(p, 90)
        bwd = configs.bwd_config_for(p, 90)
        if version == "fa1":
            assert cfg == configs.fwd_config(128, torch.bfloat16, 90, True)
            assert bwd == configs.bwd_config(128, torch.bfloat16, 90)
        else:
            assert cfg == configs.fwd_config(128, torch.bfloat16, True, 90)
            assert bwd == configs.bwd_config(128, torch.bfloat16, True, 90)
        assert dataclasses.is_dataclass(bwd) and bwd.__dataclass_params__.frozen
    assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen


def _build_wheel(src: Path, out: Path) -> Path:
    """`pip wheel SRC --no-deps` offline, with the installed setuptools (no build isolation)."""
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
    res = subprocess.run(
        [*cmd, "-q", "-w", str(out)], cwd=src, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    wheels = list(out.glob("flashsuite-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_the_packages_and_no_lab_code(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    # pip builds in the source tree (build/, *.egg-info): build from a copy of the checkout.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build")
    shutil.copytree(ROOT, src, ignore=skip)
    wheel = _build_wheel(src, tmp_path / "wheel")
    names = zipfile.ZipFile(wheel).namelist()
    py = [n for n in names if n.endswith(".py")]
    assert {n.split("/")[1] for n in py if n.startswith("flashsuite/")} == set(PACKAGES), py
    lab = [
        n
        for n in py
        if n.startswith("benchmarks/")
        or not n.startswith("flashsuite/")
        or any(Path(n).stem == s or Path(n).stem.endswith(f"_{s}") for s in LAB_NAMES)
    ]
    assert not lab, f"lab modules in the wheel: {lab}"
