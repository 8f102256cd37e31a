"""Launching a Triton kernel again without Triton's per-call Python launcher.

`kernel[grid](*args, **kwargs)` runs Triton's `JITFunction.run` on every call: it binds the
arguments, specialises each one (integer divisibility, pointer alignment), hashes the result
into its cache key, and only then calls the compiled kernel's C launcher. For tiny calls that
is a large share of the host time (40 % of fa2's tiny forward under cProfile on the H200's
host; docs/results.md "Host path per call on the H200").

`launch` does that work once per distinct specialisation and then calls the `CompiledKernel`'s
C launcher directly with every argument in signature order, on torch's current stream (with
Triton 3.6, whose launcher signature this is; other versions, and any call while a Triton
launch hook is installed, go through `compiled[grid](...)`, Triton's own launch of a compiled
binary, which runs the hooks). The memo key holds everything Triton specialises on: each
tensor argument's dtype and 16-byte alignment, every other argument's value as is (strides,
sizes, scalars, constexprs, num_warps, ...), and the current device (where Triton launches).
A key seen before is the same binary Triton would pick, so the launch is identical.
Under the Triton interpreter (`TRITON_INTERPRET=1`) every call goes through Triton unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from flashsuite.common.arch import triton_interpreter

# (kernel, specialisation) -> (compiled kernel, the names of the parameters given by keyword,
# in signature order, and their values where a plan fixes them). Bounded: a workload with many
# distinct shapes starts over rather than grow.
_compiled: dict[tuple, tuple[Any, tuple[str, ...], tuple | None]] = {}
_MAX_ENTRIES = 4096
_PLAIN = frozenset((int, float, bool, str, type(None)))
_Tensor = torch.Tensor


def _spec(fn, args: tuple, kwargs: dict, plan) -> tuple | None:
    """What Triton's choice of binary depends on, for this call (see the module docstring), or
    None where the first positional argument is not a tensor (Triton's path). One
    comprehension: this runs on every launch. Whether the other arguments are plain values
    is checked once, before a key is stored (`_plain`). With `plan`, the keyword arguments
    are the plan's and the plan object stands for them."""
    first = args[0] if args else None
    if not isinstance(first, _Tensor):
        return None
    vals = [
        (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, _Tensor) else a
        for a in (args if plan is not None else (*args, *kwargs.values()))
    ]
    return (fn, launch_device(first), plan if plan is not None else tuple(kwargs), *vals)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for a host int (0 for 0): the same value without Triton 3.6's
    ConstexprFunction call, about 4.5 µs a call on a slow host, which the launch code of
    every decode step and backward paid two to four times."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def launch_device(first: torch.Tensor) -> int:
    """The device a launch whose first argument is `first` runs on, as the memo keys it:
    Triton launches on the current device (its driver's), whatever the tensors' device; -1 on
    a CPU tensor."""
    device = first.get_device()
    return torch.cuda.current_device() if device >= 0 else device


def _plain(key: tuple) -> bool:
    """Every argument of the key a tensor's (dtype, aligned) pair or a plain value: a tensor
    descriptor or a tuple of tensors is specialised on more than this key holds."""
    return all(
        v.__class__ in _PLAIN
        or (v.__class__ is tuple and len(v) == 2 and v[0].__class__ is torch.dtype)
        for v in key[3:]
    )


def _direct_launcher():
    """Triton 3.6's `knobs.runtime` (its launch hooks), or None where this Triton is another
    version, whose launcher may take other arguments."""
    import triton

    if not triton.__version__.startswith("3.6."):
        return None
    from triton import knobs

    return knobs.runtime


_runtime = None
_runtime_known = False


def _stream(device: int) -> int:
    """torch's current CUDA stream on `device`, as the launcher takes it (Triton's own getter)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _hooks_idle(runtime) -> bool:
    """No launch hook installed (a profiler such as proton installs them)."""
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def launch(fn, grid: tuple, args: tuple, kwargs: dict, plan=None) -> tuple | None:
    """`fn[grid](*args, **kwargs)` for a Triton `JITFunction` fn whose positional arguments come
    first in its signature and whose remaining parameters are all given by keyword.

    `plan`: an object that the caller passes with these same keyword arguments every time (a
    launch plan's own token, e.g. `object()` made with the plan): the key then holds the
    object instead of the keyword values, which are not read again on a hit. The memo keeps
    the object alive, so another plan's token can never compare equal to it.

    Returns the memo entry the call launched through or stored (for `run_entry`), None where
    it went through Triton's launcher without one."""
    if triton_interpreter():
        fn[grid](*args, **kwargs)
        return None
    key = _spec(fn, args, kwargs, plan)
    try:
        hit = None if key is None else _compiled.get(key)
    except TypeError:  # an unhashable argument (a tensor descriptor)
        key = hit = None
    if key is None:
        fn[grid](*args, **kwargs)
        return None
    if hit is not None:
        run_entry(hit, grid, key[1], args, kwargs)
        return hit
    compiled = fn[grid](*args, **kwargs)  # binds, specialises, compiles if new, launches
    names = tuple(fn.arg_names[len(args) :])
    if compiled is None or any(n not in kwargs for n in names) or not _plain(key):
        return  # a parameter left to its default, or another kind of argument: Triton's path
    tail = None
    if plan is not None:
        if not all(v.__class__ in _PLAIN for v in kwargs.values()):
            return
        tail = tuple(kwargs[n] for n in names)
    if len(_compiled) >= _MAX_ENTRIES:
        _compiled.clear()
    entry = _compiled[key] = (compiled, names, tail)
    return entry


def run_entry(entry: tuple, grid: tuple, device: int, args: tuple, kwargs=None) -> None:
    """Launch memo entry `entry` (from `launch`) on `device` (`launch_device`) with these
    positional arguments: the caller vouches that the call's key is the entry's (`launch`'s
    hit path; a caller that repeats one call, e.g. fa2's bound forward, checks what of the
    key can change). `kwargs`: this call's keyword values, for an entry stored without a
    plan."""
    global _runtime, _runtime_known
    compiled, names, tail = entry
    if tail is None:
        tail = [kwargs[n] for n in names]  # this call's values (tensors among them)
    g = (*grid, 1, 1)
    if not _runtime_known:
        _runtime, _runtime_known = _direct_launcher(), True
    rt = _runtime
    if rt is not None and (
        (rt.launch_enter_hook is None and rt.launch_exit_hook is None) or _hooks_idle(rt)
    ):
        compiled.run(
            g[0], g[1], g[2], _stream(device), compiled.function, compiled.packed_metadata,
            None, None, None, *args, *tail,
        )  # fmt: skip
    else:
        compiled[g[:3]](*args, *tail)
