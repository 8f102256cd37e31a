"""On-disk cache of compiled fa3 binaries: a new process loads a kernel instead of compiling it.

Generic over what `compile.cached` gives it: a frozen key dataclass (its repr is its value) and
the function that compiles a key into a TVM-FFI binary of the CuTe DSL.

Where: `$FLASHSUITE_CACHE_DIR/fa3`, by default `${XDG_CACHE_HOME:-~/.cache}/flashsuite/fa3`;
`FLASHSUITE_CACHE_DIR=off` (or 0) turns it off. Inside, one folder per toolchain fingerprint
(`fingerprint()`: versions and install folders of the CuTe DSL and TVM-FFI, torch and its CUDA,
the machine, and a hash of this package's source files) and one file per key, named by a hash
of the key's class and repr. A new toolchain or an edited kernel file gives a new folder; the
old ones are never read again and can be deleted.

What is stored: the binary that the DSL's `export_to_c` writes (host launcher and cubin in one
object file), linked into a shared library by the C compiler driver on PATH (`$CC`, cc, gcc or
clang) with the DSL runtime and TVM-FFI as its dependencies, so that loading it is a dlopen: no
DSL import, a few milliseconds. Without a compiler driver (or with FLASHSUITE_CACHE_LINK=0) the
object file itself is stored and the DSL's JIT linker loads it, which imports the DSL (about
half a second). Either way the binary is a `tvm_ffi.Function` that takes every kernel parameter
positionally (the compiled object's defaults do not survive the export).

Safety:
- An entry is written to a temporary file in its folder and renamed over its name
  (`os.replace`): a reader sees a whole entry or none.
- Processes that miss the same key take turns (an exclusive `flock` on `<entry>.lock`): one
  compiles and stores, the others then load its entry. A process that cannot get the lock
  within LOCK_TIMEOUT_S seconds compiles for itself.
- A reader checks the magic line, every header field (format, key, fingerprint, symbol) and the
  payload's length and sha256, then loads a private copy of the bytes it checked (a memfd), not
  the file, which another process may be replacing. A mismatch or a load error is a miss: the
  key is compiled again and its entry replaced.
- After storing, the process loads its entry back and uses that, so cold and warm processes run
  the same object; an entry that does not load back is removed and the compiled binary is used.
- A folder that cannot be written (read-only, full disk) gives a warning; the kernel is compiled
  and used as without the cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT = 1  # the entry layout below; a change makes a new fingerprint folder
MAGIC = b"flashsuite-fa3-binary\n"
MAX_HEADER = 1 << 16  # bytes of the JSON header line, at most
LOCK_TIMEOUT_S = 120.0  # longer than any one compile
_OFF = ("off", "0", "false", "no", "none")
_PACKAGE = Path(__file__).resolve().parent
# The DSL's packages (their versions go into the fingerprint); libs-cu12 or -cu13 is installed.
_DSL_DISTRIBUTIONS = (
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13",
)

# memfds of the shared libraries loaded from the cache, kept open for the process's lifetime:
# dlopen knows a library by its path, /proc/self/fd/N, and must never see that path reused.
_open_fds: list[int] = []
_load_seq = itertools.count()
_warned: set[str] = set()


def cache_root() -> Path | None:
    """The fa3 cache folder, or None when FLASHSUITE_CACHE_DIR turns the cache off."""
    setting = os.environ.get("FLASHSUITE_CACHE_DIR", "").strip()
    if setting.lower() in _OFF:
        return None
    if setting:
        return Path(setting).expanduser() / "fa3"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    try:  # the XDG rule: a relative XDG_CACHE_HOME is ignored
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except RuntimeError:  # no home folder to be found
        _warn_once("no home folder and no XDG_CACHE_HOME: compiled kernels are not cached on disk")
        return None
    return base / "flashsuite" / "fa3"


def source_hash(folder: Path = _PACKAGE) -> str:
    """sha256 of the package's .py files (names and contents), the kernels' source version."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        data = path.read_bytes()
        h.update(f"{path.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _install(module: str) -> str:
    """Where `module` is installed, with its entry file's size and mtime (found, not imported):
    two environments, or a reinstall without a version change, never share entries."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return "-"
    origin = os.path.realpath(spec.origin)
    st = os.stat(origin)
    return f"{os.path.dirname(origin)} {st.st_size} {st.st_mtime_ns}"


@cache
def fingerprint() -> dict[str, str]:
    """Everything besides the key that a stored binary depends on (computed once per process)."""
    return {
        "format": str(FORMAT),
        **{name: _version(name) for name in _DSL_DISTRIBUTIONS},
        "cutlass-install": _install("cutlass"),
        "apache-tvm-ffi": _version("apache-tvm-ffi"),
        "tvm_ffi-install": _install("tvm_ffi"),
        "torch": torch.__version__,
        "torch-cuda": str(torch.version.cuda),
        "machine": platform.machine(),
        "source": source_hash(),
    }


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_text(key: Any) -> str | None:
    """The key as stored: its class's full name and repr; None when the repr is not a value (an
    object address in it), so the key cannot name an entry."""
    text = f"{type(key).__module__}.{type(key).__qualname__}: {key!r}"
    return None if " at 0x" in text else text


def entry_path(key: Any) -> Path | None:
    """The entry file for `key`, or None (cache off, or a key without a value repr)."""
    root, text = cache_root(), key_text(key)
    if root is None or text is None:
        return None
    try:
        folder = root / _sha256(json.dumps(fingerprint(), sort_keys=True).encode())[:16]
    except Exception as e:  # an install that cannot be described is not cached, never fatal
        _warn_once(f"no toolchain fingerprint ({type(e).__name__}: {e}): not caching on disk")
        return None
    return folder / f"{_sha256(text.encode())[:32]}.bin"


def _symbol(path: Path) -> str:
    """The exported function's name: unique per entry within its folder, a C identifier."""
    return f"flashsuite_fa3_{path.stem[:16]}"


def _header(key: Any, path: Path) -> dict[str, Any]:
    """The header fields a reader requires to match exactly."""
    return {
        "format": FORMAT,
        "key": key_text(key),
        "fingerprint": fingerprint(),
        "symbol": _symbol(path),
    }


def _parse(data: bytes, expected: dict[str, Any]) -> tuple[str, bytes]:
    """(kind, payload) of an entry's bytes, or ValueError saying what does not check out."""
    if not data.startswith(MAGIC):
        raise ValueError("no magic line (not an entry, or empty)")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER)
    if end < 0:
        raise ValueError("header line cut off")
    try:
        header = json.loads(data[len(MAGIC) : end])
    except ValueError as e:
        raise ValueError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    for field, want in expected.items():
        if header.get(field) != want:
            raise ValueError(f"header field {field!r} is {header.get(field)!r}, expected {want!r}")
    payload = data[end + 1 :]
    if header.get("size") != len(payload):
        raise ValueError(f"payload is {len(payload)} bytes, header says {header.get('size')}")
    if header.get("sha256") != _sha256(payload):
        raise ValueError("payload sha256 does not match the header")
    kind = header.get("kind")
    if kind not in ("so", "o"):
        raise ValueError(f"unknown payload kind {kind!r}")
    return kind, payload


def stored_header(path: Path) -> dict[str, Any]:
    """The JSON header of the entry file `path`, unchecked (for reports and tests)."""
    data = path.read_bytes()
    return json.loads(data[len(MAGIC) : data.index(b"\n", len(MAGIC))])


@contextmanager
def _private_copy(payload: bytes, folder: Path, suffix: str, keep: bool) -> Iterator[str]:
    """A path to a copy of `payload` that no other process can change: a memfd (kept open when
    `keep`, for dlopen), or else a uniquely named file in `folder`, removed afterwards."""
    fd = None
    if hasattr(os, "memfd_create"):
        with suppress(OSError):
            fd = os.memfd_create("flashsuite-fa3", os.MFD_CLOEXEC)
    if fd is not None:
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(payload)
            yield f"/proc/self/fd/{fd}"
        finally:
            if keep:
                _open_fds.append(fd)
            else:
                os.close(fd)
        return
    name = folder / f".load-{os.getpid()}-{next(_load_seq)}-{os.urandom(4).hex()}{suffix}"
    try:
        name.write_bytes(payload)
        yield str(name)
    finally:
        with suppress(OSError):
            name.unlink()


def _load_payload(kind: str, payload: bytes, symbol: str, folder: Path) -> Any:
    """The `tvm_ffi.Function` in a checked payload."""
    if kind == "so":
        import tvm_ffi

        with _private_copy(payload, folder, ".so", keep=True) as path:
            lib = ctypes.CDLL(path)  # RTLD_NOW: a missing symbol fails here, not at a launch
        address = ctypes.cast(getattr(lib, f"__tvm_ffi_{symbol}"), ctypes.c_void_p).value
        return tvm_ffi.Function.__from_extern_c__(address, keep_alive_object=lib)
    import cutlass.cute as cute

    with _private_copy(payload, folder, ".o", keep=False) as path:
        module = cute.runtime.load_module(path, enable_tvm_ffi=True)  # reads the bytes
    return module[symbol]


def load(key: Any, quiet: bool = False) -> Any | None:
    """The stored binary for `key`, or None: no entry, the cache off, or an entry that does not
    check out or load (a warning, or a debug line when `quiet`; the caller compiles and
    replaces it)."""
    report = log.debug if quiet else log.warning
    path = entry_path(key)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        report("fa3 cache: cannot read %s (%s); compiling", path, e)
        return None
    expected = _header(key, path)
    try:
        kind, payload = _parse(data, expected)
    except ValueError as e:
        report("fa3 cache: rejected %s: %s; compiling", path, e)
        return None
    try:
        return _load_payload(kind, payload, expected["symbol"], path.parent)
    except Exception as e:  # a library that does not load is a miss, never a crash
        report("fa3 cache: %s does not load (%s: %s); compiling", path, type(e).__name__, e)
        return None


def linker() -> list[str] | None:
    """The C compiler driver that links entries into shared libraries, or None (object files)."""
    if os.environ.get("FLASHSUITE_CACHE_LINK", "").strip().lower() in _OFF:
        return None
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _link(obj: str, out: str) -> bool:
    """Link the object file `obj` into the shared library `out`, needing the DSL runtime and
    TVM-FFI from the folders they are installed in; False (logged) when it cannot."""
    cmd = linker()
    if cmd is None:
        return False
    import cutlass.cute as cute

    libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
    folders = dict.fromkeys(os.path.dirname(os.path.realpath(p)) for p in libs)
    cmd = [*cmd, "-shared", "-o", out, obj, *libs, *(f"-Wl,-rpath,{d}" for d in folders)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        _warn_once(f"cannot run {cmd[0]} to link cached kernels ({e}); storing object files")
        return False
    if proc.returncode != 0:
        _warn_once(
            f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-1000:]}; "
            "storing object files"
        )
        return False
    return True


def _exportable(compiled: Any) -> bool:
    """Only TVM-FFI builds are stored (the loader hands back a tvm_ffi.Function)."""
    try:
        from cutlass.cutlass_dsl.tvm_ffi_provider import TVMFFIJitCompiledFunctionBase
    except ImportError:
        return False
    return isinstance(compiled, TVMFFIJitCompiledFunctionBase)


def _write_atomic(path: Path, data: bytes) -> None:
    """`data` as `path`, through a temporary file in the same folder and one rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        os.fchmod(fd, 0o644)  # as a plain file (mkstemp's 0600 would hide it from a group)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def store(key: Any, compiled: Any) -> Any:
    """Store `compiled` as `key`'s entry and return the binary loaded back from it; `compiled`
    itself where it cannot be stored (logged) or the cache is off."""
    path = entry_path(key)
    if path is None or not _exportable(compiled):
        return compiled
    header = _header(key, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
            obj, so = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
            compiled.export_to_c(obj, header["symbol"])
            kind = "so" if _link(obj, so) else "o"
            payload = Path(so if kind == "so" else obj).read_bytes()
        header.update(kind=kind, size=len(payload), sha256=_sha256(payload))
        text = json.dumps(header, sort_keys=True).encode()
        _write_atomic(path, MAGIC + text + b"\n" + payload)
    except Exception as e:
        _warn_once(f"cannot store compiled kernels in {path.parent} ({type(e).__name__}: {e})")
        return compiled
    fn = load(key)
    if fn is None:
        log.warning("fa3 cache: the entry just stored does not load back; removed %s", path)
        with suppress(OSError):
            path.unlink()
        return compiled
    return fn


@contextmanager
def _turn(lock: Path) -> Iterator[bool]:
    """Hold the exclusive flock on `lock` (True), or go on without it (False) after
    LOCK_TIMEOUT_S or where file locks do not work."""
    try:
        import fcntl

        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield False
        return
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("fa3 cache: %s held for %.0f s; compiling", lock, LOCK_TIMEOUT_S)
                    held = False
                    break
                time.sleep(0.05)
            except OSError:
                held = False
                break
        yield held
    finally:
        os.close(fd)  # releases the lock


def load_or_build(key: Any, build: Callable[[Any], Any]) -> Any:
    """The binary for `key`: loaded from its entry, else `build(key)` stored and loaded back.
    With the cache off, or a key without a value repr, just `build(key)`."""
    path = entry_path(key)
    if path is None:
        return build(key)
    fn = load(key)
    if fn is not None:
        return fn
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _warn_once(f"cannot create {path.parent} ({e}): compiled kernels are not cached on disk")
        return build(key)
    with _turn(path.with_suffix(".lock")):
        fn = load(key, quiet=True)  # stored by another process while this one waited its turn
        if fn is not None:
            return fn
        return store(key, build(key))


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("fa3 cache: %s", message)
