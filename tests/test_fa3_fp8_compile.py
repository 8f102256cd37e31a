"""fa3's fp8 (e4m3) branch compiles for sm_90a without a GPU, and its host-side logic holds.

The compile runs in subprocesses (`python -m benchmarks.fa3_fp8_check --probe`: the CuTe DSL
reads its CUTE_DSL_* settings at import). Each table entry must show e4m3 wgmma, TMA loads and
store, setmaxnreg, the P exchange (shfl.sync + prmt) and 0 spill bytes. The P exchange itself is
checked on the CPU against the PTX fragment layouts, which the probe reads back from CuTe.
Nothing here runs the kernel: `python -m benchmarks.fa3_fp8_check --out DIR` does, on the H200.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl not installed")

from flashsuite.common.validation import check_inputs
from flashsuite.fa3 import fp8_ops, interface
from flashsuite.fa3.compile import CompileKey
from flashsuite.fa3.configs import (
    DTYPES,
    FP8_DTYPE,
    HEAD_DIMS,
    REG_SPLIT,
    SMEM_CAPACITY,
    TRANSPOSE_WARPS,
    VT_REG_SPLIT,
    Fa3Config,
    can_implement,
    config_for,
    fp8_shipped_configs,
    get_config,
    smem_bytes,
)

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/ imports from the repository root
SHARDS = ((128, 96), (64, 192, 256))  # two compiler processes, 13 and 15 builds (CI has 2 cores)
CASES = [("shipped", d, causal) for d, _, causal, _ in fp8_shipped_configs()]
CASES.append(("window_softcap", 128, False))  # left-window mask + softcap with descales
# V transposed in shared memory by the producer warpgroup (v_transpose="smem": get_config's
# build up to configs.FP8_SMEM_VT_MAX_SEQLEN_K keys).
VT_CASES = [("vt_smem", d, causal) for d in (64, 128, 256) for causal in (False, True)]
CASES += [*VT_CASES, ("vt_window_softcap", 128, False)]  # R236 of 240 in the host build
# The persistent host-Vᵀ entries on the plain grid (what the smem builds compare with).
CASES += [("host_plain", d, c) for d, _, c, cfg in fp8_shipped_configs() if cfg.persistent]
CASES.append(("host_permuted_keys", 64, False))  # Fa3Config.permute_v_keys, host Vᵀ
CASES.append(("host_key_order", 128, False))  # a keys-major V's build (fp8_key_order_config)
CASES.append(("causal_short", 128, True))  # FP8_CAUSAL_SHORT: causal D = 128 up to 1k keys
# Per-block descales (the FP8_BLOCKS build, tests/test_fp8_blocks.py): host and smem Vᵀ, and the
# window + softcap paths.
CASES += [("blocks", d, c) for d in (64, 128, 256) for c in (False, True)]
CASES += [("blocks_vt_smem", d, True) for d in (128, 256)]
CASES.append(("blocks_window_softcap", 128, False))

# The layouts the P exchange model below assumes (CuTe's m64nNk32 e4m3 A and m64nNk16 fp32 C,
# index = m + 64 k): the probe reads CuTe's own and must find exactly these.
EXPECTED_LAYOUTS = {
    "tv_A": "((4,8,4),(4,2,2)):((256,1,16),(64,8,1024))",
    "tv_C": "((4,8,4),(2,2,16)):((128,1,16),(64,8,512))",
    "frag_A": "((4,2,2),1,4):((1,4,8),0,16)",
    "frag_C": "((2,2,16),1,1):((1,2,4),0,0)",
}


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fa3_fp8_probe")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}

    def run(i: int) -> dict:
        path = out / f"shard{i}.json"
        cmd = [sys.executable, "-m", "benchmarks.fa3_fp8_check", "--probe", "--json", str(path)]
        for d in SHARDS[i]:
            cmd += ["--head-dim", str(d)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"fp8 probe {i} failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(path.read_text())

    with ThreadPoolExecutor(len(SHARDS)) as pool:
        shards = list(pool.map(run, range(len(SHARDS))))
    configs = {(r["name"], r["head_dim"], r["causal"]): r for s in shards for r in s["configs"]}
    return {"layouts": shards[0]["layouts"], "configs": configs}


@pytest.mark.parametrize(
    ("name", "d", "causal"),
    CASES,
    ids=[f"{n}-D{d}-{'causal' if c else 'full'}" for n, d, c in CASES],
)
def test_fp8_compiles_with_hopper_machinery(name: str, d: int, causal: bool, probes) -> None:
    _check_fp8_machinery(probes["configs"][(name, d, causal)])


def test_host_vt_key_extent_in_the_binary_signature(probes) -> None:
    """The binary's argument check binds each symbolic size once: Vᵀ's key extent is K's
    length in the host-Vᵀ builds, and its own symbol with permute_v_keys, whose Vᵀ runs to Nk
    rounded up to 32 (interface.transpose_v); were it K's, every ragged Nk would be refused at
    the call. The probe calls each D = 64 binary (host and shared-memory Vᵀ, permuted keys, block
    descales) with CPU tensors as fa3.interface hands them over, so only the device check may
    fail."""
    rows = [r for r in probes["configs"].values() if r.get("signature")]
    if not rows:
        pytest.skip("apache-tvm-ffi not installed")
    seen = set()
    for r in rows:
        sig, cfg = r["signature"], r["config"]
        assert "expected device_type=cuda" in sig, sig
        nk = re.search(r"mK: Tensor\(\[n0, (n\d+), ", sig).group(1)
        if cfg["v_transpose"] != "host":
            continue
        vt = re.search(r"mV: Tensor\(\[n0, n\d+, \d+, (n\d+)\]", sig).group(1)
        assert (vt != nk) == cfg["permute_v_keys"], (r["name"], sig)
        seen.add(cfg["permute_v_keys"])
    assert seen == {False, True}


@pytest.mark.lab
def test_fp8_variants_compile_with_hopper_machinery(tmp_path) -> None:
    """The fp8 ablation candidates no config ships (benchmarks/fa3_variants.fp8_variants: the
    persistent scheduler with per-tile descales, three consumer warpgroups, ...), non-causal,
    at D 64 and 128: `pytest -m lab`."""
    path = tmp_path / "variants.json"
    cmd = [sys.executable, "-m", "benchmarks.fa3_fp8_check", "--probe", "--variants"]
    cmd += ["--head-dim", "64", "--head-dim", "128", "--json", str(path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"fp8 variant probe failed:\n{proc.stdout}\n{proc.stderr}"
    configs = json.loads(path.read_text())["configs"]
    names = {r["name"] for r in configs}
    assert {"persistent_v2", "wg3_n128", "wg3_n160", "tile_n_224"} <= names, names
    for r in configs:
        _check_fp8_machinery(r)


def _check_fp8_machinery(r: dict) -> None:
    ptx = r["ptx"]
    assert ptx["wgmma_e4m3"] > 0 and ptx["wgmma_e4m3"] == ptx["wgmma"], "not all wgmma are e4m3"
    assert ptx["wgmma_rs"] > 0, "P·V is not an RS wgmma (P should come from registers)"
    assert ptx["tma_load"] > 0 and ptx["tma_store"] > 0, "no cp.async.bulk.tensor load/store"
    assert ptx["setmaxnreg"] >= 2, "setmaxnreg dec/inc missing"
    cfg = Fa3Config(**r["config"])
    assert ptx["stmatrix"] > 0
    if cfg.pingpong:
        assert ptx["bar_arrive"] > 0, "ping-pong named-barrier arrives missing"
    assert ptx["cvt_e4m3x2"] > 0
    if cfg.permute_v_keys:  # P packed where it lies: no exchange between the quad's lanes
        assert ptx["prmt"] == 0, "permute_v_keys: the quad exchange is still there"
    else:  # two shuffles and two prmt per 32-bit word pair of P, per k-block and row half
        assert ptx["shfl_idx"] > 0 and ptx["prmt"] > 0
    assert r["registers"] is not None, "no ptxas report captured"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r["ptxas_lines"]
    for code in ("C7508", "C7512", "C7515", "C7519"):
        assert code not in r["remarks"], f"ptxas remark {code}: {r['ptxas_lines']}"
    split = VT_REG_SPLIT if cfg.v_transpose == "smem" else REG_SPLIT
    assert r["max_reg"] is not None, "no cubin or no nvdisasm to read registers"
    assert r["max_reg"] < split[cfg.num_consumer_wgs][1], f"R{r['max_reg']} past setmaxnreg"
    if cfg.v_transpose == "host":
        assert ptx["ldmatrix_trans"] == 0, "the host-Vᵀ build transposes nothing in the kernel"


@pytest.mark.parametrize(
    ("name", "d", "causal"), VT_CASES, ids=[f"D{d}-{c}" for _, d, c in VT_CASES]
)
def test_smem_transpose_build_and_barrier_protocol(name: str, d: int, causal: bool, probes) -> None:
    """v_transpose="smem": the producer WG's transposing warps show in the PTX with the
    protocol of fp8_ops.transpose_block / pipeline.transpose_blocks, the host build's PTX
    plus: one ldmatrix.x4.trans and one stmatrix.x4 per 32-key x 16-byte unit per warp (units
    split over TRANSPOSE_WARPS warps, the last round guarded), a proxy fence before the Vᵀ
    full barrier's arrive, arrives on the V empty and Vᵀ full barriers (transposers) and Vᵀ
    empty (consumers), and as many wgmma instructions as the host build where the tiles are
    equal (they depend on tile_n and D only)."""
    r = probes["configs"][(name, d, causal)]
    ptx, cfg = r["ptx"], Fa3Config(**r["config"])
    cfgs = probes["configs"]
    host = cfgs.get(("host_plain", d, causal)) or cfgs[("shipped", d, causal)]  # plain grid
    assert not host["config"]["persistent"]
    units = cfg.tile_n // fp8_ops.VT_UNIT_KEYS * (d // fp8_ops.VT_UNIT_D)
    per_warp = -(-units // TRANSPOSE_WARPS)
    assert cfg.v_transpose == "smem" and not cfg.persistent
    assert ptx["ldmatrix_trans"] == per_warp
    assert ptx["stmatrix_b16x4"] == host["ptx"]["stmatrix_b16x4"] + per_warp
    assert ptx["fence_proxy_async"] == host["ptx"]["fence_proxy_async"] + 1
    # + V empty (transposers' release), Vᵀ full (commit), Vᵀ empty (consumers' VtPipe).
    assert ptx["mbarrier_arrive"] >= host["ptx"]["mbarrier_arrive"] + 2
    assert ptx["setmaxnreg"] == host["ptx"]["setmaxnreg"]
    if cfg.tile_n == host["config"]["tile_n"]:
        assert ptx["wgmma"] == host["ptx"]["wgmma"]
        assert ptx["prmt"] == host["ptx"]["prmt"] + 4 * per_warp
    assert r["smem"] == smem_bytes(cfg, d, FP8_DTYPE) <= SMEM_CAPACITY


def test_smem_transpose_register_split() -> None:
    """The split the smem builds run under fits the registers one CTA gets at launch
    (min_blocks_per_mp=1: 65,536 / threads, rounded down to 8) and gives the producer WG at
    least the host builds' registers (2 WGs: 56, not 24; with 24 and 40 ptxas spilled at
    D = 128)."""
    for wgs, (prod, cons) in VT_REG_SPLIT.items():
        threads = 128 * (1 + wgs)
        launch = 65_536 // threads // 8 * 8
        assert 128 * prod + 128 * wgs * cons <= threads * launch
        assert prod >= REG_SPLIT[wgs][0] and prod % 8 == 0 and cons % 8 == 0


def test_cute_fragment_layouts_match_the_exchange_model(probes) -> None:
    assert probes["layouts"] == EXPECTED_LAYOUTS


def _prmt(w1: list, w2: list, sel: int) -> list:
    both = w1 + w2  # prmt byte ids 0-3: w1, 4-7: w2
    return [both[(sel >> (4 * n)) & 7] for n in range(4)]


def _pair(acc_t: dict, kb: int, j: int, r: int) -> list:
    """The two C-fragment values of one lane in column group 4kb + j, row half r."""
    i = 4 * (4 * kb + j) + 2 * r
    return [acc_t[i], acc_t[i + 1]]


def test_quad_exchange_builds_the_fp8_a_fragment() -> None:
    """Simulate one quad through fp8_ops.probs_to_operand's steps on labelled P values."""
    for kb in range(4):  # 32-key blocks of a 128-wide S tile
        # C fragment (frag_C / tv_C): lane t, element 4j + 2r + c = (row half r, key 8j+2t+c).
        acc = [
            {
                4 * j + 2 * r + c: (r, 8 * j + 2 * t + c)
                for j in range(16)
                for r in (0, 1)
                for c in (0, 1)
            }
            for t in range(4)
        ]
        words: list[dict[int, list]] = [{} for _ in range(4)]
        for r in (0, 1):
            # cvt_pack_e4m3x4: X = (j=0 pair, j=2 pair), Y = (j=1, j=3), low byte first
            x = [_pair(acc[t], kb, 0, r) + _pair(acc[t], kb, 2, r) for t in range(4)]
            y = [_pair(acc[t], kb, 1, r) + _pair(acc[t], kb, 3, r) for t in range(4)]
            offer1 = [x[t] if t % 2 == 0 else y[t] for t in range(4)]
            offer2 = [y[t] if t % 2 == 0 else x[t] for t in range(4)]
            for t in range(4):
                src1, src2, sel_lo, sel_hi = fp8_ops.quad_exchange(t)
                w1, w2 = offer1[src1], offer2[src2]
                words[t][4 * kb + r] = _prmt(w1, w2, sel_lo)
                words[t][4 * kb + 2 + r] = _prmt(w1, w2, sel_hi)
        # A fragment (frag_A / tv_A): word 4kb + r + 2h of lane t = row half r,
        # keys 32kb + 16h + 4t + (0..3), low byte first.
        for t in range(4):
            for r in (0, 1):
                for h in (0, 1):
                    want = [(r, 16 * h + 4 * t + b + 32 * kb) for b in range(4)]
                    assert words[t][4 * kb + r + 2 * h] == want, (kb, t, r, h)


def test_permuted_keys_give_the_a_fragment_in_place() -> None:
    """probs_to_operand with keys_permuted (V's keys in slot_key order): each lane packs its own
    four C-fragment columns per key half into one word, and that word's bytes are the A
    fragment's slots 16h + 4t + 0..3, which hold keys slot_key(...) of V: P·V pairs every P
    with the V row of its own key. slot_key is a permutation of each 32-key block."""
    assert sorted(fp8_ops.slot_key(s) for s in range(32)) == list(range(32))
    for kb in range(6):  # 32-key blocks of a 192-wide S tile
        for t in range(4):
            acc = {
                4 * j + 2 * r + c: (r, 8 * j + 2 * t + c)
                for j in range(24)
                for r in (0, 1)
                for c in (0, 1)
            }
            for r in (0, 1):
                for h in (0, 1):
                    i0 = 4 * (4 * kb + 2 * h) + 2 * r  # the kernel's indices
                    word = [acc[i0], acc[i0 + 1], acc[i0 + 4], acc[i0 + 5]]
                    slots = [16 * h + 4 * t + b for b in range(4)]
                    want = [(r, 32 * kb + fp8_ops.slot_key(s)) for s in slots]
                    assert word == want, (kb, t, r, h)


def test_transpose_v_with_permuted_keys() -> None:
    """interface.transpose_v(permute_keys=True): Vᵀ's column 32 blk + s is V's key 32 blk +
    slot_key(s), zero past Nk, to Nk rounded up to 32 (ragged and whole blocks)."""
    for nk in (37, 64, 100):
        v = (torch.randn(2, nk, 3, 64) * 3).to(torch.float8_e4m3fn)  # (B, Nk, Hkv, D)
        vt = interface.transpose_v(v, permute_keys=True)
        nk32 = (nk + 31) // 32 * 32
        assert vt.shape == (2, 3, 64, nk32) and vt.dtype == v.dtype and vt.stride(-1) == 1
        u, vu = vt.view(torch.uint8), v.view(torch.uint8)
        for s in range(nk32):
            key = s // 32 * 32 + fp8_ops.slot_key(s % 32)
            want = vu[:, key] if key < nk else torch.zeros_like(vu[:, 0])  # (B, Hkv, D)
            assert torch.equal(u[..., s], want), (nk, s)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fp8_table_entries_can_be_implemented(d: int, causal: bool) -> None:
    ok, reason = can_implement(get_config(d, FP8_DTYPE, causal), d, FP8_DTYPE)
    assert ok, reason


def test_fp8_register_estimate_follows_the_split() -> None:
    """FA3's 128 x 224 e4m3 tile at D = 128 fits the host builds' 240 consumer registers (0
    spills on sm_90a) but not the smem transpose's 224 (96 bytes spilled): can_implement admits
    the one and names the budget for the other. The table's smem builds stay within theirs."""
    two_wgs = dict(num_consumer_wgs=2, tile_m=128, permute_v_keys=False)
    host = replace(get_config(128, FP8_DTYPE, False), tile_n=224, **two_wgs)
    assert host.v_transpose == "host" and can_implement(host, 128, FP8_DTYPE) == (True, "")
    ok, reason = can_implement(replace(host, v_transpose="smem"), 128, FP8_DTYPE)
    assert not ok and f"> {VT_REG_SPLIT[2][1]}" in reason, reason
    for d in (64, 128, 256):
        for causal in (False, True):
            cfg = get_config(d, FP8_DTYPE, causal, seqlen_k=512)
            assert cfg.v_transpose == "smem" and can_implement(cfg, d, FP8_DTYPE)[0], (d, cfg)


def test_fp8_limits_of_the_one_table() -> None:
    """What the fp8 branch cannot take, and why: sO on the fp8 sQ, P blocks under 32 keys."""
    cfg = replace(get_config(64, FP8_DTYPE, False), v_transpose="host", tile_m=128,
                  num_consumer_wgs=2, tile_n=192)  # fmt: skip
    for changed in (replace(cfg, o_alias_q=True), replace(cfg, tile_n=48)):
        assert can_implement(changed, 64, torch.bfloat16)[0]  # fine in 16 bits
    ok, reason = can_implement(replace(cfg, o_alias_q=True), 64, FP8_DTYPE)
    assert not ok and "own sO" in reason
    ok, reason = can_implement(replace(cfg, tile_n=48), 64, FP8_DTYPE)
    assert not ok and "multiple of 32" in reason
    with pytest.raises(ValueError, match="fp8 head_dim 80"):
        get_config(80, FP8_DTYPE, False)


def test_who_transposes_fp8_v_follows_the_key_length() -> None:
    """get_config's fp8 build transposes V in shared memory up to FP8_SMEM_VT_MAX_SEQLEN_K keys
    (at every length where that is None) and takes the host copy past it and at unmeasured
    head dims (FP8_CAUSAL_SHORT's build up to its limit, then the table's entry); config_for
    passes the problem's key length."""
    from flashsuite.fa3.configs import (
        FP8_CAUSAL_SHORT,
        FP8_SMEM_VT_CAUSAL_MAX_SEQLEN_K,
        FP8_SMEM_VT_MAX_SEQLEN_K,
        fp8_smem_transpose_config,
    )

    for d in (64, 96, 128, 192, 256):
        for causal in (False, True):
            limits = FP8_SMEM_VT_MAX_SEQLEN_K
            if causal and d in FP8_SMEM_VT_CAUSAL_MAX_SEQLEN_K:
                limits = FP8_SMEM_VT_CAUSAL_MAX_SEQLEN_K
            limit = limits.get(d, 0)
            for n in (1, 512, 513, 1024, 1025, 2048, 2049, 8192, 16384, 131072, None):
                smem = limit is None or (limit > 0 and n is not None and n <= limit)
                cfg = get_config(d, FP8_DTYPE, causal, seqlen_k=n)
                want = fp8_smem_transpose_config(d, causal) if smem else None
                assert cfg.v_transpose == ("smem" if smem else "host"), (d, causal, n)
                assert want is None or cfg == want
                # The smem build exists on the plain grid only (can_implement).
                assert not fp8_smem_transpose_config(d, causal).persistent
                short = FP8_CAUSAL_SHORT.get(d) if causal else None
                if short is not None and n is not None and n <= short[0] and not smem:
                    assert cfg == short[1], (d, n)  # the short causal build, past smem's limit
                else:
                    assert smem or cfg == fp8_shipped(d, causal)
    # The measured crossovers (configs.py, docs/fp8.md): D = 128 up to 2k, causal up to 512
    # (its host build runs on the persistent scheduler, which the smem build cannot).
    assert FP8_SMEM_VT_MAX_SEQLEN_K[128] == 2048 and FP8_SMEM_VT_CAUSAL_MAX_SEQLEN_K[128] == 512
    assert config_for(_fp8_params(nk=2048, causal=False)).v_transpose == "smem"
    assert config_for(_fp8_params(nk=4096, causal=False)).v_transpose == "host"
    assert config_for(_fp8_params(nk=512)).v_transpose == "smem"  # causal
    host = config_for(_fp8_params(nk=1024))
    assert host.v_transpose == "host" and host.persistent and host.overlap_tiles
    assert host.num_consumer_wgs == 2 and config_for(_fp8_params(nk=1025)).num_consumer_wgs == 3


def fp8_shipped(d: int, causal: bool):
    return {(dd, c): cfg for dd, _, c, cfg in fp8_shipped_configs()}[d, causal]


def test_one_compile_key_for_both_dtypes() -> None:
    """fp8 is a dtype of the one compile key: the same fields, distinct keys, a repr that
    names the dtype (what an on-disk cache of compiled kernels is keyed by)."""
    keys = [
        CompileKey(dt, 128, True, False, False, get_config(128, dt, True))
        for dt in (*DTYPES, FP8_DTYPE)
    ]
    assert len(set(keys)) == 3
    assert repr(keys[-1]).startswith("CompileKey(dtype=torch.float8_e4m3fn, head_dim=128, ")
    assert keys[-1].cfg != keys[0].cfg  # fp8 has its own table entry
    assert config_for(_fp8_params(nk=16384)) == keys[-1].cfg  # and config_for reads it


def _fp8_params(d: int = 128, nk: int = 130, causal: bool = True):
    f8 = torch.float8_e4m3fn
    q = torch.zeros(2, 100, 4, d).to(f8)  # (B, Nq, Hq, D)
    kv = torch.zeros(2, nk, 2, d).to(f8)  # (B, Nk, Hkv, D)
    return check_inputs(q, kv, kv, causal=causal)


def test_fp8_support_and_reasons() -> None:
    p = _fp8_params()
    ok, reason = interface.supports(p, 90)
    cfg = get_config(p.head_dim, FP8_DTYPE, p.causal, p.seqlen_k)
    assert ok and reason.startswith("fa3: fp8 e4m3 forward") and f"x{cfg.tile_n} tiles" in reason
    assert not interface.supports(p, None)[0]
    assert not interface.supports(p, 80)[0]
    ok, reason = interface.supports(_fp8_params(d=80), 90)
    assert not ok and "head_dim 80 not in" in reason


def test_transpose_v_layout() -> None:
    v = (torch.randn(2, 37, 3, 64) * 3).to(torch.float8_e4m3fn)  # (B, Nk, Hkv, D)
    vt = interface.transpose_v(v)  # (B, Hkv, D, Nk)
    assert vt.shape == (2, 3, 64, 37) and vt.dtype == v.dtype and vt.stride(-1) == 1
    assert vt.stride(2) % 16 == 0  # TMA: 16-byte outer strides
    assert torch.equal(vt.view(torch.uint8), v.view(torch.uint8).permute(0, 2, 3, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "e4m3"])
def test_one_forward_path_hands_the_binary_its_arguments(dtype, monkeypatch) -> None:
    """interface.forward on the CPU with the binary stubbed: both dtypes take the same path to
    one CompileKey and the binary's one calling convention (q, k, v, out, lse, three descales,
    two cu_seqlens (None: dense), four scalars, the SM count); fp8 gets Vᵀ (the host-copy build:
    the table's shared-memory transpose turned off here), bf16 O and (B, Hkv) descales (ones
    for None)."""
    from flashsuite.fa3 import compile as fa3_compile
    from flashsuite.fa3 import configs

    calls = []
    monkeypatch.setattr(configs, "FP8_SMEM_VT_MAX_SEQLEN_K", {})
    monkeypatch.setattr(configs, "FP8_SMEM_VT_CAUSAL_MAX_SEQLEN_K", {})

    def get_forward(key):
        return lambda *args: calls.append((key, args))

    props = type("Props", (), {"multi_processor_count": 132})
    monkeypatch.setattr(fa3_compile, "get_forward", get_forward)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(interface, "_plans", {})
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, 4, 64, generator=gen).to(dtype)  # (B, Nq, Hq, D)
    k = torch.randn(2, 56, 2, 64, generator=gen).to(dtype)  # (B, Nk, Hkv, D)
    v = torch.randn(2, 56, 2, 64, generator=gen).to(dtype)
    # (B, Hkv) descales: q's, none for k, a non-contiguous one for v.
    ds = (torch.rand(2, 2, generator=gen) + 0.5, None, torch.rand(2, 2, generator=gen).t())
    fp8 = dtype == FP8_DTYPE
    kwargs = dict(zip(("descale_q", "descale_k", "descale_v"), ds, strict=True)) if fp8 else {}
    p = check_inputs(q, k, v, causal=True, **kwargs)
    out, lse = interface.forward(q, k, v, p, *(ds if fp8 else ()))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 4, 40)
    ((key, args),) = calls
    cfg = configs.config_for(p)  # bf16 causal: config_for's dense build, with the tile counter
    assert cfg.tile_counter != fp8 and (not fp8 or cfg == get_config(64, dtype, True, 56))
    assert key == CompileKey(dtype, 64, True, False, False, cfg)
    assert len(args) == 5 + 3 + 2 + 4 + 1 and args[-1] == 132 and args[8] is None
    # cu_seqlens_k's slot: None (dense), or the tile counter's (2,) int32 zeros.
    assert args[9] is None if fp8 else (args[9].dtype, args[9].tolist()) == (torch.int32, [0, 0])
    assert args[0] is q and args[1] is k and args[3] is out and args[4] is lse
    if fp8:
        assert torch.equal(args[2].view(torch.uint8), v.view(torch.uint8).permute(0, 2, 3, 1))
        assert torch.equal(args[5], ds[0]) and torch.equal(args[7], ds[2])
        assert torch.equal(args[6], torch.ones(2, 2))  # descale_k None: 1.0
        assert all(t.dtype == torch.float32 and t.is_contiguous() for t in args[5:8])
    else:
        assert args[2] is v and args[5:8] == (None, None, None)
        with pytest.raises(ValueError, match="descale factors are for fp8 inputs only"):
            interface.forward(q, k, v, p, torch.ones(2, 2))


def _ldmatrix_trans(rows: list[list]) -> list[list]:
    """ldmatrix.x4.trans: rows[L] = the 16 bytes lane L addresses (matrix L // 8, row L % 8);
    lane t gets of matrix m the 16-bit column t // 4 of rows 2(t % 4), 2(t % 4) + 1 (PTX ISA,
    ldmatrix with .trans), low half first: 4 bytes per register."""
    regs = []
    for t in range(32):
        p, q = t // 4, t % 4
        regs.append(
            [
                rows[8 * m + 2 * q][2 * p : 2 * p + 2] + rows[8 * m + 2 * q + 1][2 * p : 2 * p + 2]
                for m in range(4)
            ]
        )
    return regs


def _stmatrix(regs: list[list]) -> list[list]:
    """stmatrix.x4: the 16 bytes written at the row address of lane L (matrix L // 8, row
    L % 8): register m of lanes 4r .. 4r + 3, 4 bytes each."""
    return [[b for q in range(4) for b in regs[4 * (L % 8) + q][L // 8]] for L in range(32)]


@pytest.mark.parametrize("permuted", [False, True], ids=["keys", "slots"])
@pytest.mark.parametrize(("tile_n", "d"), [(32, 16), (64, 64), (96, 256), (192, 128)])
def test_smem_transpose_lane_model_writes_v_transposed(tile_n: int, d: int, permuted: bool) -> None:
    """fp8_ops.transpose_block's lanes, instruction by instruction: ldmatrix.trans at the rows
    vt_load_row names, the two prmt per register pair, stmatrix at the rows vt_store_row names,
    over every unit and warp: sVt[d, key] ends up V[key, d] for every byte, each written once
    (`permuted`, Fa3Config.permute_v_keys: sVt[d, 32 blk + s] = V[32 blk + slot_key(s), d])."""
    sv = {(k, c): ("v", k, c) for k in range(tile_n) for c in range(d)}  # (key, D byte)
    svt: dict[tuple, tuple] = {}
    kbs = tile_n // fp8_ops.VT_UNIT_KEYS
    units = kbs * (d // fp8_ops.VT_UNIT_D)
    for u in range(units):
        k0, d0 = (u % kbs) * fp8_ops.VT_UNIT_KEYS, (u // kbs) * fp8_ops.VT_UNIT_D
        rows = []
        for lane in range(32):
            key = k0 + fp8_ops.vt_load_row(lane, permuted)
            rows.append([sv[(key, d0 + c)] for c in range(16)])
        regs = _ldmatrix_trans(rows)
        words = [
            [
                _prmt(r[2 * g], r[2 * g + 1], sel)
                for g in range(2)
                for sel in (fp8_ops.VT_SEL_EVEN, fp8_ops.VT_SEL_ODD)
            ]
            for r in regs
        ]
        for lane, seg in enumerate(_stmatrix(words)):
            dd, kk = fp8_ops.vt_store_row(lane)
            for c in range(16):
                at = (d0 + dd, k0 + kk + c)  # (D row, key) of sVt
                assert at not in svt, f"sVt{at} written twice"
                svt[at] = seg[c]
    assert len(svt) == tile_n * d

    def key_at(s: int) -> int:
        return s // 32 * 32 + fp8_ops.slot_key(s % 32) if permuted else s

    assert all(svt[(c, s)] == ("v", key_at(s), c) for s in range(tile_n) for c in range(d))


def test_keys_major_v_skips_the_host_copy(monkeypatch) -> None:
    """interface.forward with a keys-major fp8 V (common.fp8.keys_major, binary stubbed): the
    table takes the host-Vᵀ build for it at every key length, which gets a view of V's own
    storage as Vᵀ (no copy); a smem build asked for by cfg a token-major copy (what it reads),
    and a keys-major V whose strides TMA cannot take transpose_v's copy."""
    from flashsuite.common.fp8 import keys_major
    from flashsuite.fa3 import compile as fa3_compile
    from flashsuite.fa3.configs import (
        config_for,
        dense_options_off,
        fp8_smem_transpose_config,
        get_config,
    )

    calls = []
    props = type("Props", (), {"multi_processor_count": 132})
    monkeypatch.setattr(fa3_compile, "get_forward", lambda key: lambda *a: calls.append((key, a)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(interface, "_plans", {})
    copies = []
    real_transpose = interface.transpose_v
    monkeypatch.setattr(
        interface, "transpose_v", lambda v, pk=False: copies.append(v) or real_transpose(v, pk)
    )
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, 4, 128, generator=gen).to(FP8_DTYPE)  # (B, Nq, Hq, D)
    k = torch.randn(2, 50, 2, 128, generator=gen).to(FP8_DTYPE)  # (B, Nk, Hkv, D)
    v = torch.randn(2, 50, 2, 128, generator=gen).to(FP8_DTYPE)
    vk = keys_major(v)  # (B, Nk, Hkv, D) over (B, Hkv, D, 64) storage
    assert vk.stride(1) == 1 and torch.equal(vk.view(torch.uint8), v.view(torch.uint8))
    p = check_inputs(q, k, vk)
    # 50 keys: V as it lies takes the smem transpose; keys-major, it is Vᵀ already, and the
    # table takes it on a host-Vᵀ build that reads V's keys in order (no copy either way; the
    # entry's own build permutes them).
    assert p.v_keys_major and not check_inputs(q, k, v).v_keys_major
    assert config_for(check_inputs(q, k, v)) == fp8_smem_transpose_config(128, False)
    host = config_for(p)
    assert host.v_transpose == "host" and not host.permute_v_keys
    assert get_config(128, FP8_DTYPE, False).permute_v_keys
    assert not check_inputs(q.bfloat16(), k.bfloat16(), v.bfloat16()).v_keys_major
    # A window keeps the rule of its own: no schedule options (D = 256's entry has wg_slice).
    q2, k2 = (torch.zeros(1, n, 2, 256).to(FP8_DTYPE) for n in (40, 50))
    window = config_for(check_inputs(q2, k2, keys_major(k2), window_size=(16, 0)))
    assert window == dense_options_off(get_config(256, FP8_DTYPE, False, seqlen_k=16384))
    assert window != get_config(256, FP8_DTYPE, False, seqlen_k=16384)
    interface.forward(q, k, vk, p, cfg=host)
    vt = calls[-1][1][2]  # (B, Hkv, D, Nk)
    assert not copies and vt.data_ptr() == vk.data_ptr() and vt.stride(-1) == 1
    assert torch.equal(vt.view(torch.uint8), interface.transpose_v(v).view(torch.uint8))
    copies.clear()
    smem = fp8_smem_transpose_config(128, False)
    interface.forward(q, k, vk, p, cfg=smem)
    v_smem = calls[-1][1][2]
    assert not copies and v_smem.is_contiguous() and v_smem.data_ptr() != vk.data_ptr()
    assert torch.equal(v_smem.view(torch.uint8), v.view(torch.uint8))
    # Keys contiguous, but the D stride (50 bytes) is no multiple of 16: the padded copy.
    odd = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    interface.forward(q, k, odd, check_inputs(q, k, odd), cfg=host)
    assert len(copies) == 1
    assert torch.equal(calls[-1][1][2].view(torch.uint8), vt.view(torch.uint8))
    # With permute_v_keys the kernel wants another key order: the copy, from either layout.
    interface.forward(q, k, vk, p, cfg=replace(host, permute_v_keys=True))
    assert len(copies) == 2
    # One key, its stride not 1 (any stride passes for a size-1 dim): the copy, not a view
    # whose last stride the binary would refuse.
    one = torch.empty_strided((2, 1, 2, 128), (8192, 3, 2048, 16), dtype=FP8_DTYPE)
    k1 = k[:, :1]
    interface.forward(q, k1, one, check_inputs(q, k1, one), cfg=host)
    assert len(copies) == 3 and calls[-1][1][2].stride(-1) == 1


def test_smem_transpose_build_takes_v_as_it_lies(monkeypatch) -> None:
    """interface.forward with a v_transpose="smem" config (binary stubbed): V goes to the
    binary untouched (B, Nk, Hkv, D), no Vᵀ copy; the compile key carries the config."""
    from flashsuite.fa3 import compile as fa3_compile
    from flashsuite.fa3.configs import fp8_smem_transpose_config

    calls = []
    props = type("Props", (), {"multi_processor_count": 132})
    monkeypatch.setattr(fa3_compile, "get_forward", lambda key: lambda *a: calls.append((key, a)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(interface, "_plans", {})
    monkeypatch.setattr(interface, "transpose_v", lambda v: pytest.fail("Vᵀ copied on the host"))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, 4, 128, generator=gen).to(FP8_DTYPE)  # (B, Nq, Hq, D)
    k = torch.randn(2, 56, 2, 128, generator=gen).to(FP8_DTYPE)  # (B, Nk, Hkv, D)
    v = torch.randn(2, 56, 2, 128, generator=gen).to(FP8_DTYPE)
    p = check_inputs(q, k, v)
    cfg = fp8_smem_transpose_config(128, False)
    interface.forward(q, k, v, p, cfg=cfg)
    ((key, args),) = calls
    assert key.cfg == cfg and key.cfg.v_transpose == "smem"
    assert args[2] is v
    ok, reason = interface.supports(p, 90)
    assert ok and "Vᵀ in shared memory" in reason  # the table's pick for 56 keys at D = 128
    kv_long = k[:, :1].expand(2, 16384, 2, 128)
    long = check_inputs(q, kv_long, kv_long)
    reason = interface.supports(long, 90)[1]  # and for 16k
    assert "Vᵀ copied on the host, its keys permuted within 32-key blocks" in reason, reason
    q64, kv64 = q[..., :64], kv_long[..., :64]  # D = 64's host build keeps V's key order
    reason = interface.supports(check_inputs(q64, kv64, kv64, causal=True), 90)[1]
    assert "Vᵀ copied on the host unless V is keys-major" in reason, reason
    from flashsuite.common.fp8 import keys_major

    for kv in (k, kv_long):  # the host build in key order: V's own storage is its Vᵀ
        reason = interface.supports(check_inputs(q, kv, keys_major(kv)), 90)[1]
        assert "Vᵀ read from V laid out keys-major, no copy" in reason, reason
