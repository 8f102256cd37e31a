"""Shared fixtures. Without a GPU, Triton kernels run under the CPU interpreter
(TRITON_INTERPRET=1, set here before any kernel module is imported) with the bf16 `tl.dot`
fix applied; with a GPU everything runs natively and the larger cases join."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashsuite.common.testing import patch_triton_interpreter_bf16  # noqa: E402
from flashsuite.dispatch import registry  # noqa: E402

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    patch_triton_interpreter_bf16()

DEVICE = "cuda" if HAS_CUDA else "cpu"

# Tests that hold GBs of device memory (float64 oracles of 2-4 GB per N x N product, caches of
# 32k-token rows in float32): one worker runs them one after another (scripts/gpu_check.sh runs
# pytest-xdist with --dist loadgroup), so that many workers cannot exhaust the GPU's memory
# together and make unrelated tests fail.
GPU_MEMORY = pytest.mark.xdist_group("gpu_memory")


# pytest-xdist: `-n N` without a --dist mode would schedule with "load", which ignores xdist
# groups. Start from "loadgroup" instead, so that GPU_MEMORY holds however the suite is started:
# the controller schedules by group, and each worker (which parses the original command line,
# not the controller's options) is told to tag its tests with their group.
@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config) -> None:
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput["flashsuite_loadgroup"] = node.config.option.dist == "loadgroup"


def pytest_configure(config) -> None:
    if getattr(config, "workerinput", {}).get("flashsuite_loadgroup"):
        config.option.loadgroup = True


def must_run(name: str) -> bool:
    """fa3 on an sm90 GPU with the CuTe DSL installed: unavailable there is a bug, not a skip."""
    if name != "fa3" or not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0):
        return False
    return importlib.util.find_spec("cutlass") is not None


def runnable_versions() -> list:
    """Every version as a parameter: one that cannot run here is SKIPPED with the reason (a
    broken import shows in the report instead of shrinking the suite), except fa3 on an sm90
    host with the CuTe DSL installed, which then fails (its tests raise VersionUnavailable).
    FLASHSUITE_TEST_VERSIONS=fa2,torch narrows the list (e.g. on a GPU host, to bisect)."""
    wanted = os.environ.get("FLASHSUITE_TEST_VERSIONS")
    params = []
    for name in registry.VERSIONS:
        if wanted and name not in wanted.split(","):  # not even imported
            marks = [pytest.mark.skip(reason=f"{name}: not in FLASHSUITE_TEST_VERSIONS={wanted}")]
            params.append(pytest.param(name, id=name, marks=marks))
            continue
        ok, reason = registry.available(name)
        if ok or must_run(name):
            marks = []
        else:
            marks = [pytest.mark.skip(reason=f"{name} unavailable: {reason}")]
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def runnable_names() -> set[str]:
    """The names of the versions `runnable_versions` does not skip (its params are
    pytest.param objects: compare names with this, never with that list)."""
    return {p.values[0] for p in runnable_versions() if not any(m.name == "skip" for m in p.marks)}


def pytest_report_header(config) -> list[str]:
    lines = [f"flashsuite: device={DEVICE} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"]
    for name in registry.VERSIONS:
        ok, reason = registry.available(name)
        lines.append(f"  {name}: {'available' if ok else 'unavailable'} ({reason})")
    return lines


def _module_fixture_group(item) -> str | None:
    """The test module's path when the test uses a module-scoped fixture defined in that module
    (the compile probes: one build of 20-90 s shared by the module's tests), else None."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    module = item.nodeid.split("::", 1)[0]
    for fixturedefs in defs.values():
        for fixturedef in fixturedefs:
            if fixturedef.scope == "module" and fixturedef.baseid == module:
                return module
    return None


# tryfirst: the xdist_group marks must be in place before pytest-xdist's own hook reads them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        # With pytest-xdist, the tests that share a module-scoped fixture run on one worker, so
        # that each worker does not build it again.
        if item.get_closest_marker("xdist_group") is None:
            group = _module_fixture_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def device() -> str:
    return DEVICE


def run_fa3_probe(out: Path, *args: str, shards: int = 2) -> dict[str, dict]:
    """`python -m benchmarks.fa3_probe ARGS` in `shards` processes at once (the CuTe DSL reads
    CUTE_DSL_* at import, so each compile runs outside this interpreter), results keyed
    "name-D<head_dim>-<dtype>-<causal|full>"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    root = Path(__file__).resolve().parents[1]  # benchmarks/ imports from the repository root

    def run(i: int) -> list[dict]:
        path = out / f"shard{i}.json"
        cmd = [sys.executable, "-m", "benchmarks.fa3_probe", *args]
        cmd += ["--shard", f"{i}/{shards}", "--json", str(path)]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"probe shard {i} failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(path.read_text())

    with ThreadPoolExecutor(shards) as pool:
        results = [r for shard in pool.map(run, range(shards)) for r in shard]
    return {
        f"{r['name']}-D{r['head_dim']}-{r['dtype']}-{'causal' if r['causal'] else 'full'}": r
        for r in results
    }
