"""The version registry: lazy imports, availability, and the custom op of each version.

A version is a module with the surface of docs/versions.md. It is imported the first time it
is asked about, so `import flashsuite.dispatch` needs torch alone, and a missing Triton or
CuTe DSL only disables the versions that need it (with the import error as the reason).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

from flashsuite.common.arch import deterministic_algorithms as _deterministic
from flashsuite.common.arch import device_arch, env_key, env_table
from flashsuite.common.ops import AttentionOp, BackwardFn
from flashsuite.common.validation import AttnParams, remember

VERSIONS = ("fa3", "fa2", "fa1", "torch")

_MODULES = {
    "fa1": "flashsuite.fa1.interface",
    "fa2": "flashsuite.fa2.interface",
    "fa3": "flashsuite.fa3.interface",
    "torch": "flashsuite.dispatch.portable",
}

# A version without a backward of its own borrows one, on the same saved (q, k, v, out, lse).
# The pairing lives here, not in the versions, which never import each other. A version with a
# `supports_backward(p, arch)` runs its own backward where that says yes and borrows elsewhere.
BACKWARD_PARTNER = {"fa3": "fa2"}


class VersionUnavailable(RuntimeError):
    pass


@functools.cache
def _import(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(_MODULES[name]), ""
    except Exception as exc:  # an ImportError, or a toolchain failing at import time
        return None, f"cannot import {_MODULES[name]}: {type(exc).__name__}: {exc}"


def check_name(name: str) -> None:
    if name not in _MODULES:
        raise ValueError(f"version: expected one of {(*VERSIONS, 'auto')}, got {name!r}")


def module(name: str) -> ModuleType:
    check_name(name)
    mod, reason = _import(name)
    if mod is None:
        raise VersionUnavailable(f"{name}: {reason}")
    return mod


def available(name: str) -> tuple[bool, str]:
    """Can this version run on this machine at all (software present)?"""
    if name not in _MODULES:
        return False, f"unknown version {name!r}"
    mod, reason = _import(name)
    if mod is None:
        return False, reason
    return mod.available()


def available_versions(kernels_only: bool = False) -> list[str]:
    """The versions that can run here, best first; `kernels_only` leaves out "torch"."""
    names = [n for n in VERSIONS if available(n)[0]]
    return [n for n in names if n != "torch"] if kernels_only else names


def own_backward(name: str, p: AttnParams, arch: int | None) -> tuple[bool, str]:
    """Whether `name` differentiates problem `p` with its own backward kernel, and why.

    A partial own backward runs where the version's `supports_backward` says yes and either
    the version ships it on by default (`OWN_BACKWARD_DEFAULT`, chosen by measurement) or
    `FLASHSUITE_<NAME>_BWD=1` (e.g. FLASHSUITE_FA3_BWD=1) asks for it; `=0` turns it off, so
    the partner's backward runs without a code change. Problems for which the version's
    optional `backward_opt_in(params)` gives a reason (fa3: builds not yet run on a GPU; it
    gets the AttnParams here, the VarlenParams in `own_varlen_backward`) take the own backward
    only when asked for.
    """
    mod = module(name)
    if mod.HAS_BACKWARD:
        return True, f"{name}: own backward"
    check = getattr(mod, "supports_backward", None)
    if check is None:
        return False, f"{name}: no backward of its own"
    default = getattr(mod, "OWN_BACKWARD_DEFAULT", True)
    off = "slower than the partner's where measured"
    return _own(name, "own backward", "BWD", default, off, p, check, arch)


def own_varlen_backward(name: str, vp, arch: int | None) -> tuple[bool, str]:
    """Whether `name` differentiates its varlen forward on packed sequences `vp`
    (validation.VarlenParams) with its own varlen backward, and why: as `own_backward`, with
    the version's `supports_varlen_backward`, `OWN_VARLEN_BACKWARD_DEFAULT` and
    `FLASHSUITE_<NAME>_VARLEN_BWD`; `FLASHSUITE_<NAME>_BWD=0` turns it off too (every own
    backward). A version with a `varlen_backward` and no `supports_varlen_backward` has a whole
    one."""
    mod = module(name)
    check = getattr(mod, "supports_varlen_backward", None)
    if check is None:
        whole = hasattr(mod, "varlen_backward")
        return whole, f"{name}: {'own' if whole else 'no'} varlen backward"
    switch = f"FLASHSUITE_{name.upper()}_BWD"
    if os.environ.get(switch, "") == "0":
        return False, f"{name}: own backward turned off ({switch}=0)"
    default = getattr(mod, "OWN_VARLEN_BACKWARD_DEFAULT", True)
    off = "not yet run on a GPU"
    return _own(name, "own varlen backward", "VARLEN_BWD", default, off, vp, check, arch)


def _own(name, what, suffix, default, off, params, check, arch) -> tuple[bool, str]:
    """The switch (FLASHSUITE_<NAME>_<suffix>), the default and the opt-in list of an own
    backward `what` that `check(params, arch)` says can take the problem."""
    switch = f"FLASHSUITE_{name.upper()}_{suffix}"
    setting = os.environ.get(switch, "")
    if setting == "0":
        return False, f"{name}: {what} turned off ({switch}=0)"
    if setting != "1" and not default:
        return False, f"{name}: {what} off by default ({off}; {switch}=1 turns it on)"
    opt_in = getattr(module(name), "backward_opt_in", None)  # problems taken only when asked
    why = opt_in(params) if setting != "1" and opt_in is not None else ""
    if why:
        return False, f"{name}: {why} ({switch}=1 turns it on)"
    return check(params, arch)


def backward_source(name: str, p: AttnParams | None = None, arch: int | None = None) -> str | None:
    """The version whose backward differentiates `name`'s forward on `p` (None: no backward).

    Without `p`, a version whose own backward is partial answers with its partner.
    """
    mod = module(name)
    if mod.HAS_BACKWARD:
        return name
    if p is not None and hasattr(mod, "supports_backward") and own_backward(name, p, arch)[0]:
        return name
    partner = BACKWARD_PARTNER.get(name)
    if partner is not None and available(partner)[0]:
        return partner
    return None


# (version, problem, arch, deterministic algorithms on, FLASHSUITE_<NAME>_BWD) -> the version
# whose backward runs (`backward_source`): what a partial own backward decides on every call,
# from facts that do not change between the calls of one training loop.
_sources: dict[tuple, str | None] = {}


def _choosing_backward(name: str) -> BackwardFn:
    """A backward that runs `name`'s own kernel where `own_backward` says yes, else the
    partner's; decided per call, on the problem being differentiated (memoised per problem,
    architecture, deterministic setting and FLASHSUITE_<NAME>_BWD)."""
    switch = env_key(f"FLASHSUITE_{name.upper()}_BWD")

    def backward(dout, q, k, v, out, lse, p: AttnParams, dlse=None):
        arch = device_arch(p.device)
        mkey = (name, p, arch, _deterministic(), env_table.get(switch))
        if mkey in _sources:
            source = _sources[mkey]
        else:
            source = backward_source(name, p, arch)
            remember(_sources, mkey, source)
        if source is None:
            raise RuntimeError(f"{name}: no backward can take {p.describe()}")
        return module(source).backward(dout, q, k, v, out, lse, p, dlse=dlse)

    return backward


@functools.cache
def op(name: str) -> AttentionOp:
    """The custom-op pair `flashsuite::<name>_fwd/_bwd`, defined on first use (afterwards also
    reachable as `torch.ops.flashsuite.<name>_fwd`)."""
    mod = module(name)
    if hasattr(mod, "supports_backward") and not mod.HAS_BACKWARD:
        return AttentionOp(name, mod.forward, _choosing_backward(name))
    source = backward_source(name)
    backward = module(source).backward if source is not None else None
    return AttentionOp(name, mod.forward, backward)
