"""Launching a Triton kernel again without Triton's per-call Python launcher.

`kernel[grid](*args, **kwargs)` runs Triton's `JITFunction.run` on every call: it binds the
arguments, specialises each one (integer divisibility, pointer alignment), hashes the result
into its cache key, and only then calls the compiled kernel's C launcher. For the tiny calls
that dominate decode steps and small training steps that is most of the host time (about 30 µs
of fa2's tiny forward on the H200, docs/results.md "Host path per call").

`launch` does that work once per distinct specialisation and then calls the `CompiledKernel`
directly (`compiled[grid](*every_argument)`, Triton's own way to launch a compiled binary,
which keeps its launch hooks). The memo key holds everything Triton specialises on: each
tensor argument's dtype and 16-byte alignment, every other argument's value as is (strides,
sizes, scalars, constexprs, num_warps, ...), and the device. A key seen before is the same
binary Triton would pick, so the launch is identical.
Under the Triton interpreter (`TRITON_INTERPRET=1`) every call goes through Triton unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from flashsuite.common.arch import triton_interpreter

# (kernel, specialisation) -> (compiled kernel, the names of the parameters given by keyword,
# in signature order). Bounded: a workload with many distinct shapes starts over rather than
# grow.
_compiled: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
_MAX_ENTRIES = 4096


_PLAIN = (int, float, bool, str, type(None))
_OTHER = object()  # an argument of another kind


def _part(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    return a if isinstance(a, _PLAIN) else _OTHER


def _spec(fn, args: tuple, kwargs: dict) -> tuple | None:
    """What Triton's choice of binary depends on, for this call (see the module docstring);
    None where an argument is of another kind (a tensor descriptor, a tuple): Triton's path."""
    parts = tuple(_part(a) for a in args)
    kw = tuple((k, _part(v)) for k, v in kwargs.items())
    if _OTHER in parts or any(v is _OTHER for _, v in kw):
        return None
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    return (fn, device, parts, kw)


def launch(fn, grid: tuple, args: tuple, kwargs: dict) -> None:
    """`fn[grid](*args, **kwargs)` for a Triton `JITFunction` fn whose positional arguments come
    first in its signature and whose remaining parameters are all given by keyword."""
    if triton_interpreter():
        fn[grid](*args, **kwargs)
        return
    key = _spec(fn, args, kwargs)
    if key is None:
        fn[grid](*args, **kwargs)
        return
    hit = _compiled.get(key)
    if hit is not None:
        compiled, names = hit
        tail = [kwargs[n] for n in names]  # this call's values (tensors among them)
        compiled[(*grid, 1, 1)[:3]](*args, *tail)  # its launcher takes a 3-d grid
        return
    compiled = fn[grid](*args, **kwargs)  # binds, specialises, compiles if new, launches
    names = tuple(fn.arg_names[len(args) :])
    if compiled is None or any(n not in kwargs for n in names):
        return  # a parameter left to its default: keep Triton's path for this call site
    if len(_compiled) >= _MAX_ENTRIES:
        _compiled.clear()
    _compiled[key] = (compiled, names)
