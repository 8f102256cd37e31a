"""GPU architecture detection, overridable so dispatch can be tested on a CPU-only machine.

The architecture is an int `major * 10 + minor` (sm90 -> 90, sm80 -> 80) or `None` for a device
with no CUDA GPU behind it. Two ways to pretend to be another machine:

- the environment variable `FLASHSUITE_ARCH` (`sm90`, `90`, `sm_80`, or `cpu`/`none`), read on
  every call so tests can monkeypatch it;
- the context manager `override_arch(90)`, which wins over the environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

_UNSET = object()
_override: object = _UNSET

# os.environ.get costs about a microsecond per missing name (an encode and a KeyError); the
# dict os.environ writes through to (CPython on POSIX: bytes keys and values) answers in a few
# ns. `env_table` and `env_key` read it on the launch paths; elsewhere os.environ is the same.
_ENV_BYTES = os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict)
env_table: dict = os.environ._data if _ENV_BYTES else os.environ  # type: ignore[attr-defined]


def env_key(name: str) -> bytes | str:
    """`name` as `env_table` keys it."""
    return name.encode() if _ENV_BYTES else name


# torch.are_deterministic_algorithms_enabled without its Python frame (a third of its cost):
# the memoised plans and choices that depend on the switch read it on every call.
deterministic_algorithms = getattr(
    torch._C, "_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled
)

_ARCH_KEY = env_key("FLASHSUITE_ARCH")
_INTERPRET_KEY = env_key("TRITON_INTERPRET")
_INTERPRET_OFF = (None, *(env_key(v) for v in ("", "0")))


def parse_arch(text: str) -> int | None:
    """'sm90', 'sm_90a', '90', '9.0' -> 90; 'cpu' or 'none' -> None."""
    t = text.strip().lower()
    if t in ("cpu", "none", ""):
        return None
    t = t.removeprefix("sm").removeprefix("_").removesuffix("a")
    if "." in t:
        major, minor = t.split(".", 1)
        return int(major) * 10 + int(minor)
    if not t.isdigit():
        raise ValueError(
            f"FLASHSUITE_ARCH: expected something like 'sm90', '80' or 'cpu', got {text!r}"
        )
    return int(t)


@contextlib.contextmanager
def override_arch(arch: int | None) -> Iterator[None]:
    """Within the block, `device_arch` returns `arch` for every device."""
    global _override
    previous, _override = _override, arch
    try:
        yield
    finally:
        _override = previous


# CUDA device index -> its architecture: a device's capability never changes, and asking
# torch for it (get_device_properties) costs microseconds on every launch that plans by arch.
_real_archs: dict[int, int] = {}


def real_arch(device: torch.device | str | int | None = None) -> int | None:
    """The architecture of the physical device, ignoring overrides (None for CPU)."""
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
        index = device.index  # the launch paths' case: a tensor's device
    else:
        if isinstance(device, int):
            dev = torch.device("cuda", device)
        else:
            dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type != "cuda":
            return None
        if not torch.cuda.is_available():
            return None
        index = dev.index if dev is not None else None
        if index is None:
            index = torch.cuda.current_device()
    arch = _real_archs.get(index)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(index)
        _real_archs[index] = arch = major * 10 + minor
    return arch


def device_arch(device: torch.device | str | None = None) -> int | None:
    """The architecture dispatch should plan for: override, then env, then the real device."""
    if _override is not _UNSET:
        return _override  # type: ignore[return-value]
    if env_table.get(_ARCH_KEY) is not None:
        return parse_arch(os.environ["FLASHSUITE_ARCH"])
    return real_arch(device)


def cuda_stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where CUDA is not
    initialised): torch.cuda's check without its Python wrapper, for per-call host paths."""
    return torch.cuda.is_initialized() and torch._C._cuda_isCurrentStreamCapturing()


def override_state() -> object:
    """The active `override_arch` value (a private sentinel when none): part of the key of
    anything memoised on the planned arch."""
    return _override


def is_overridden() -> bool:
    return _override is not _UNSET or env_table.get(_ARCH_KEY) is not None


def triton_interpreter() -> bool:
    """True when Triton kernels run on the CPU through `TRITON_INTERPRET=1`."""
    return env_table.get(_INTERPRET_KEY) not in _INTERPRET_OFF


def triton_available(version: str) -> tuple[bool, str]:
    """The `available()` of a Triton version: Triton importable, and a CUDA GPU or the
    interpreter to run on (or an arch override: planning for another machine)."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import time
        return False, f"{version}: cannot import triton: {type(exc).__name__}: {exc}"
    if triton_interpreter():
        return True, f"{version}: Triton interpreter (TRITON_INTERPRET=1)"
    if torch.cuda.is_available():
        return True, f"{version}: Triton on CUDA"
    if is_overridden():
        return True, f"{version}: Triton (planning for an overridden arch; no GPU here to run on)"
    return False, f"{version}: needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)"


def arch_name(arch: int | None) -> str:
    return "cpu" if arch is None else f"sm{arch}"
