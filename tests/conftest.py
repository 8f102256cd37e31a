"""Shared fixtures. Without a GPU, Triton kernels run under the CPU interpreter
(TRITON_INTERPRET=1, set here before any kernel module is imported) with the bf16 `tl.dot`
fix applied; with a GPU everything runs natively and the larger cases join."""

from __future__ import annotations

import os

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


def runnable_versions() -> list[str]:
    """Versions whose software is present; each test then asks `supports` for its case.
    FLASHSUITE_TEST_VERSIONS=fa2,torch narrows the list (e.g. on a GPU host, to bisect)."""
    wanted = os.environ.get("FLASHSUITE_TEST_VERSIONS")
    names = registry.available_versions()
    return [name for name in names if name in wanted.split(",")] if wanted else names


def pytest_report_header(config) -> list[str]:
    lines = [f"flashsuite: device={DEVICE} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"]
    for name in registry.VERSIONS:
        ok, reason = registry.available(name)
        lines.append(f"  {name}: {'available' if ok else 'unavailable'} ({reason})")
    return lines


def pytest_collection_modifyitems(config, items) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    return DEVICE
