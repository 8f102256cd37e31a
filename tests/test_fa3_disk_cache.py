"""fa3's on-disk cache of compiled binaries (fa3/disk_cache.py), on a machine without a GPU.

One real sm_90a forward binary (bf16, D = 64) is compiled in this process and stored, loaded,
damaged and replaced under temporary cache folders: a stored entry loads instead of compiling;
an entry that is truncated anywhere, has a flipped payload byte, or was written by another
toolchain or for another key is rejected and compiled again, and is whole afterwards;
FLASHSUITE_CACHE_DIR moves the folder or turns the cache off; the key changes with the kernel
source; without a linker the object file is stored and loads through the DSL. Two fresh
processes (benchmarks/warm_start.py's child) missing the same key at once compile it once: the
other loads the entry, without compiling and without importing the CuTe DSL, and both binaries
have the compiled one's signature. On an sm90 GPU, a fresh process's first call on a warm cache
must cost at most 0.2 s beyond a warm call.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")
tvm_ffi = pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi not installed")

from benchmarks.warm_start import run_child  # noqa: E402
from flashsuite.fa3 import compile as fa3_compile  # noqa: E402
from flashsuite.fa3 import disk_cache  # noqa: E402
from flashsuite.fa3.configs import get_config  # noqa: E402

header_of = disk_cache.stored_header

KEY = fa3_compile.CompileKey(
    torch.bfloat16, 64, False, False, False, get_config(64, torch.bfloat16, False)
)
Q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)  # (B, N, H, D), on the CPU
# q, k, v, out, lse, three descales and two cu_seqlens (None: 16-bit, dense), four scalars,
# the persistent grid size.
ARGS = (Q, Q, Q, Q.clone(), torch.zeros(1, 1, 128), *(None,) * 5, 1.0, 1.0, 0, 0, 1)


def _signature(fn) -> str:
    """The binary's argument check on CPU tensors: its full signature, before any launch."""
    with pytest.raises(ValueError, match="Mismatched Tensor on argument #0") as info:
        fn(*ARGS)
    return str(info.value)


@pytest.fixture(scope="module")
def compiled():
    return fa3_compile.compile_forward(KEY)


@pytest.fixture(scope="module")
def signature(compiled, tmp_path_factory) -> str:
    """The signature of the compiled binary, read from its stored and loaded copy: the DSL
    imported by this test session may target another arch and then cannot call `compiled`
    itself (the fresh-process test below compares the two)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHSUITE_CACHE_DIR", str(tmp_path_factory.mktemp("reference")))
        sig = _signature(disk_cache.store(KEY, compiled))
    assert "mQ: Tensor([n0, n1, n2, 64], bfloat16)" in sig and "max_ctas: int32" in sig
    return sig


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache folder (FLASHSUITE_CACHE_DIR), linking with the default driver."""
    monkeypatch.setenv("FLASHSUITE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHSUITE_CACHE_LINK", raising=False)
    return tmp_path / "cache"


class Builds:
    """A build function that hands back the compiled binary and counts its calls."""

    def __init__(self, compiled) -> None:
        self.compiled, self.keys = compiled, []

    def __call__(self, key):
        self.keys.append(key)
        return self.compiled


def test_round_trip_loads_instead_of_compiling(cache, compiled, signature) -> None:
    build = Builds(compiled)
    fn = disk_cache.load_or_build(KEY, build)
    assert build.keys == [KEY]
    assert isinstance(fn, tvm_ffi.Function)  # the stored entry, loaded back
    path = disk_cache.entry_path(KEY)
    assert path.parent.parent == cache / "fa3" and path.is_file()
    header = header_of(path)
    assert header["key"] == disk_cache.key_text(KEY) and "CompileKey(" in header["key"]
    assert header["fingerprint"] == disk_cache.fingerprint()
    assert header["kind"] == ("so" if disk_cache.linker() else "o")
    assert _signature(fn) == signature
    again = disk_cache.load_or_build(KEY, build)
    assert build.keys == [KEY], "an entry on disk must load, not compile"
    assert _signature(again) == signature


@pytest.mark.parametrize("cut", ["empty", "magic", "header", "payload-1"])
def test_truncated_entry_is_compiled_again(cache, compiled, cut, caplog, signature) -> None:
    disk_cache.load_or_build(KEY, Builds(compiled))
    path = disk_cache.entry_path(KEY)
    whole = path.read_bytes()
    header_end = whole.index(b"\n", len(disk_cache.MAGIC)) + 1
    keep = {"empty": 0, "magic": 10, "header": header_end - 20, "payload-1": len(whole) - 1}
    path.write_bytes(whole[: keep[cut]])
    build = Builds(compiled)
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        fn = disk_cache.load_or_build(KEY, build)
    assert build.keys == [KEY], f"a truncated entry ({cut}) must be compiled again"
    assert "rejected" in caplog.text
    assert _signature(fn) == signature
    assert disk_cache.load(KEY) is not None and len(path.read_bytes()) == len(whole)


def test_flipped_payload_byte_fails_the_checksum(cache, compiled, caplog) -> None:
    disk_cache.load_or_build(KEY, Builds(compiled))
    path = disk_cache.entry_path(KEY)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))
    build = Builds(compiled)
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        disk_cache.load_or_build(KEY, build)
    assert build.keys == [KEY] and "sha256" in caplog.text
    assert disk_cache.load(KEY) is not None


def _rewrite_header(path: Path, **fields) -> None:
    data = path.read_bytes()
    end = data.index(b"\n", len(disk_cache.MAGIC))
    header = json.loads(data[len(disk_cache.MAGIC) : end]) | fields
    path.write_bytes(disk_cache.MAGIC + json.dumps(header).encode() + data[end:])


def test_entry_of_another_toolchain_is_compiled_again(cache, compiled, caplog) -> None:
    disk_cache.load_or_build(KEY, Builds(compiled))
    path = disk_cache.entry_path(KEY)
    other = disk_cache.fingerprint() | {"nvidia-cutlass-dsl": "0.0.1"}
    _rewrite_header(path, fingerprint=other)  # payload and its checksum still intact
    build = Builds(compiled)
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        disk_cache.load_or_build(KEY, build)
    assert build.keys == [KEY] and "'fingerprint'" in caplog.text
    assert header_of(path)["fingerprint"] == disk_cache.fingerprint()


def test_entry_of_another_key_is_compiled_again(cache, compiled, caplog) -> None:
    other = replace(KEY, causal=True)
    disk_cache.load_or_build(KEY, Builds(compiled))
    disk_cache.entry_path(other).write_bytes(disk_cache.entry_path(KEY).read_bytes())
    build = Builds(compiled)
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        disk_cache.load_or_build(other, build)
    assert build.keys == [other] and "'key'" in caplog.text
    assert header_of(disk_cache.entry_path(other))["key"] == disk_cache.key_text(other)


def test_env_var_moves_the_folder_or_turns_the_cache_off(tmp_path, monkeypatch, compiled):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("FLASHSUITE_CACHE_DIR", raising=False)
    assert disk_cache.cache_root() == tmp_path / "xdg" / "flashsuite" / "fa3"
    monkeypatch.setenv("FLASHSUITE_CACHE_DIR", str(tmp_path / "moved"))
    disk_cache.load_or_build(KEY, Builds(compiled))
    assert disk_cache.entry_path(KEY).is_relative_to(tmp_path / "moved" / "fa3")
    assert disk_cache.entry_path(KEY).is_file() and not (tmp_path / "xdg").exists()
    for off in ("off", "0", "OFF"):
        monkeypatch.setenv("FLASHSUITE_CACHE_DIR", off)
        assert disk_cache.cache_root() is None and disk_cache.entry_path(KEY) is None
        build = Builds(compiled)
        assert disk_cache.load_or_build(KEY, build) is compiled and build.keys == [KEY]
    assert not Path("off").exists() and not Path("0").exists()


def test_key_changes_with_the_kernel_source(tmp_path, monkeypatch, cache) -> None:
    package = Path(disk_cache.__file__).parent
    copy = tmp_path / "fa3"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert disk_cache.source_hash(copy) == disk_cache.source_hash()
    with open(copy / "kernels.py", "a") as f:
        f.write("\n# one more line\n")
    changed = disk_cache.source_hash(copy)
    assert changed != disk_cache.source_hash()
    before = disk_cache.entry_path(KEY)
    edited = disk_cache.fingerprint() | {"source": changed}
    monkeypatch.setattr(disk_cache, "fingerprint", lambda: edited)
    assert disk_cache.entry_path(KEY).parent != before.parent
    assert disk_cache.entry_path(replace(KEY, softcap=True)) != disk_cache.entry_path(KEY)


@pytest.mark.parametrize("how", ["FLASHSUITE_CACHE_LINK=0", "CC=false"])
def test_object_file_entry_without_a_linker(cache, compiled, monkeypatch, how, signature) -> None:
    name, value = how.split("=")
    monkeypatch.setenv(name, value)
    build = Builds(compiled)
    fn = disk_cache.load_or_build(KEY, build)
    assert header_of(disk_cache.entry_path(KEY))["kind"] == "o"
    assert disk_cache.load_or_build(KEY, build) is not None and build.keys == [KEY]
    assert _signature(fn) == signature


def test_unwritable_folder_compiles_without_the_cache(tmp_path, monkeypatch, compiled) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHSUITE_CACHE_DIR", str(blocker / "cache"))  # under a file
    build = Builds(compiled)
    assert disk_cache.load_or_build(KEY, build) is compiled and build.keys == [KEY]
    assert disk_cache.store(KEY, compiled) is compiled


def test_memory_dict_is_the_first_level(monkeypatch) -> None:
    """A key in this process's dict never reaches the disk layer."""
    calls = []
    monkeypatch.setattr(fa3_compile, "_cache", {})
    monkeypatch.setattr(disk_cache, "load_or_build", lambda key, build: calls.append(key) or 7)
    assert fa3_compile.cached(KEY, None) == 7 and fa3_compile.cached(KEY, None) == 7
    assert calls == [KEY]


def test_entry_is_replaced_whole_under_concurrent_writers(tmp_path) -> None:
    """Writers replacing one entry while a reader reads it: the reader sees a whole entry."""
    path = tmp_path / "entry.bin"
    payloads = [bytes([i]) * (1 << 20) for i in range(4)]
    stop, seen, bad = threading.Event(), set(), []

    def write(i: int) -> None:
        for _ in range(25):
            disk_cache._write_atomic(path, payloads[i])

    def read() -> None:
        while not stop.is_set():
            if path.exists():
                data = path.read_bytes()
                if data not in payloads:
                    bad.append(len(data))
                seen.add(data[:1])

    reader = threading.Thread(target=read)
    reader.start()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(4)))
    stop.set()
    reader.join()
    assert not bad, f"the reader saw partial entries of {bad} bytes"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_processes_compile_a_key_once_and_load_it_without_the_dsl(tmp_path) -> None:
    """Two fresh processes miss the same key at once: one compiles and stores, the other waits
    its turn and loads the entry, without compiling and without importing the CuTe DSL; both
    binaries have the signature of the one the DSL compiled."""
    args = Namespace(cpu=True, steps=["fwd"], head_dim=64, causal=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHSUITE_CACHE")}
    folder = str(tmp_path / "cache")
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: run_child(folder, args, env)["steps"][0], range(2)))
    both.sort(key=lambda r: r["compiles"])
    loader, compiler = both
    assert (loader["compiles"], compiler["compiles"]) == (0, 1)
    assert "mQ: Tensor([n0, n1, n2, 64], bfloat16)" in compiler["compiled_signature"]
    assert loader["signature"] == compiler["signature"] == compiler["compiled_signature"]
    (entry,) = (tmp_path / "cache" / "fa3").glob("*/*.bin")
    if header_of(entry)["kind"] == "so":
        assert not loader["dsl_imported"], "loading a 16-bit forward must not import the DSL"


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# Measured on the H200: the forward meets the bound; a fresh process's first forward +
# backward took 0.89 s beyond a warm call (1.7 ms) while the backward launched Triton's
# preprocess (0.47 s of Triton's per-process cache key, triton.runtime.cache.triton_key, and
# Triton's compiler imports). With the CuTe DSL pre- and postprocess (fa3/bwd_prepost.py) a
# fresh process's first forward took 0.18 s and its first backward 0.07 s (a profile, not this
# test): about 0.25 s together, still above the bound.
@pytest.mark.gpu
@pytest.mark.timing  # under parallel workers compiling at once a fresh process starts slower
@pytest.mark.skipif(not _sm90(), reason="needs an sm90 GPU")
@pytest.mark.parametrize("step", ["fwd", "bwd"])
def test_gpu_first_call_on_a_warm_cache(tmp_path, step) -> None:
    """A fresh process's first fa3 call on a warm cache: <= 0.2 s beyond a warm call ("bwd":
    the first forward and backward together)."""
    args = Namespace(cpu=False, steps=[step], head_dim=128, causal=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHSUITE_CACHE")}
    folder = str(tmp_path / "cache")
    cold, report = run_child(folder, args, env), run_child(folder, args, env)
    warm = report["steps"][0]
    print(f"{step}: cold first call {cold['steps'][0]['seconds']:.3f} s, warm {warm}")
    if set(report["entry_kinds"]) == {"so"}:
        assert not warm["dsl_imported"]
    assert warm["beyond_s"] <= 0.2, (report["entry_kinds"], warm)
