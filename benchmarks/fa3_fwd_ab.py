"""Interleaved A/B timing of fa3 forward tile configs against each other and the peers (a GPU run).

    python3 -m benchmarks.fa3_fwd_ab --variant t128ol:tile_n=128,intra_wg_overlap=1,o_alias_q=0
    python3 -m benchmarks.fa3_fwd_ab --head-dim 128 --causal --seqlen 8192 --passes 7 \
        --variant t176:tile_n=176

A variant is NAME:FIELD=VALUE,... : the shipped config for the shape (configs.config_for) with
those Fa3Config fields replaced (ints; 0 / 1 for the flags); with `table=1` among them, the
table's entry for the shape (configs.get_config: without config_for's dense builds) instead,
so `--variant plain:table=1` is the build a dense problem ran before those. Each variant must build
(can_implement) at every timed shape and pass the oracle on three small cases (odd lengths, GQA,
one long) under the suite's comparison rule before it is timed; a check case whose build the
variant cannot take (config_for runs short keys on the Q-in-registers build) is skipped with
the reason, at least one must run. Then every contender is timed once per shape per
pass, passes interleaved (a run drifts by several percent, more than what is being decided):
the variants through fa3.interface.forward, "fa3" (the shipped path through dispatch), SDPA's
cuDNN backend and, when flash-attn-4 imports, FA4's SM90 forward. Shapes: the standard sweep's
B·N = 16k, Hq·D = 2048 at each --seqlen (default 4k, 8k, 16k). Prints forward TFLOP/s per pass
and the medians.

With --fp8 the inputs are e4m3 with per-(batch, kv head) descales: each variant passes
benchmarks.fa3_fp8_check's three small cases (against the float64 oracle and the e4m3-rounding
emulation), and the contenders are the variants and the shipped fp8 config through
fa3.interface.forward (Vᵀ made as the config says: every user-visible step timed), fa3's bf16
forward and SDPA's cuDNN backend in bf16 on the same shapes, and "fa3-fp8-km", the shipped
call on V laid out keys-major (common.fp8.keys_major: no Vᵀ copy before the kernel).
--fp8-blocks adds the per-block descale build ("fa3-fp8-blocks": the same descales as block
views, one per 128 query rows and per key tile; tests/test_fp8_blocks.py holds its accuracy).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch


def parse_variant(spec: str, table_ok: bool = True):
    """("name", {field: int}) from NAME:FIELD=VALUE,...; a clear error for a bad field.
    `table_ok`: whether `table=1` (`variant_config`'s base) is allowed."""
    from flashsuite.fa3.configs import Fa3Config

    name, _, body = spec.partition(":")
    fields = {f.name: f.type for f in dataclasses.fields(Fa3Config)}
    changes: dict[str, object] = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key == "table":
            if not table_ok:
                raise ValueError(f"--variant {spec!r}: table=1 is for the A/B tools' variants")
            if value not in ("0", "1"):
                raise ValueError(f"--variant {spec!r}: table expected 0 or 1, got {value!r}")
            changes[key] = value == "1"
            continue
        if key not in fields:
            raise ValueError(f"--variant {spec!r}: field {key!r} not in Fa3Config {sorted(fields)}")
        current = getattr(Fa3Config(), key)
        try:
            changes[key] = bool(int(value)) if isinstance(current, bool) else type(current)(value)
        except ValueError:
            kind = type(current).__name__
            raise ValueError(f"--variant {spec!r}: {key}={value!r} is not a {kind}") from None
    if not name:
        raise ValueError(f"--variant {spec!r}: expected NAME:FIELD=VALUE,...")
    return name, changes


def variant_config(p, changes: dict):
    """The config of a parsed variant for problem `p`: config_for's, or with `table` the
    table's entry (get_config of its head dim, dtype, causal flag and key length), with the
    variant's fields replaced."""
    from flashsuite.fa3.configs import config_for, get_config

    fields = dict(changes)
    if fields.pop("table", False):
        base = get_config(p.head_dim, p.dtype, p.causal, p.seqlen_k)
    else:
        base = config_for(p)
    return dataclasses.replace(base, **fields)


def parse_sweep(ap: argparse.ArgumentParser, args, default: list[int]) -> tuple[list, list]:
    """(seqlens, variants) of a standard-sweep tool's --seqlen (divisors of 16384, else
    `default`) and --variant arguments, or ap.error naming the bad one."""
    seqlens = args.seqlen or default
    if bad := [n for n in seqlens if n < 1 or 16384 % n]:
        ap.error(f"--seqlen: expected divisors of 16384 (B * N = 16k), got {bad}")
    try:
        return seqlens, [parse_variant(s) for s in args.variant]
    except ValueError as exc:
        ap.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    from flashsuite.common.testing import Case, compare, make_inputs, reference_pair
    from flashsuite.common.validation import check_inputs
    from flashsuite.dispatch.bench import prepare
    from flashsuite.fa3 import interface as fa3
    from flashsuite.fa3.configs import can_implement

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME:FIELD=VALUE,... (repeat)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--seqlen", type=int, action="append", default=[], help="N (repeat)")
    ap.add_argument("--fp8", action="store_true", help="e4m3 inputs (see above)")
    ap.add_argument(
        "--fp8-blocks", action="store_true", help="with --fp8: also the per-block descale build"
    )
    args = ap.parse_args(argv)
    if args.fp8_blocks and not args.fp8:
        ap.error("--fp8-blocks: needs --fp8")
    if args.passes < 1:
        ap.error(f"--passes: expected >= 1, got {args.passes}")
    seqlens, variants = parse_sweep(ap, args, [4096, 8192, 16384])
    d, heads = args.head_dim, 2048 // args.head_dim
    bf16 = torch.bfloat16
    if args.fp8:
        return _fp8_main(args, variants, seqlens)

    def cfg_for(case: Case, changes: dict):
        q, k, v = make_inputs(case, "cuda")
        p = check_inputs(q, k, v, **case.options())
        return (q, k, v, p), variant_config(p, changes)

    checks = [
        Case(2, 1000, 1000, 4, 4, d, dtype=bf16, causal=args.causal),
        Case(2, 172, 333, 8, 2, d, dtype=bf16, causal=args.causal),
        Case(1, 4096, 4096, 4, 2, d, dtype=bf16, causal=args.causal),
    ]
    for name, changes in variants:
        checked = 0
        for case in checks:
            (q, k, v, p), cfg = cfg_for(case, changes)
            ok, why = can_implement(cfg, d, bf16)
            if not ok:
                # A variant of config_for's build at a check shape whose build it cannot take
                # (short keys run the Q-in-registers build): checked at the other shapes.
                print(f"[{name}] {case.id}: not checked, cannot build {cfg}: {why}", flush=True)
                continue
            out, lse = fa3.forward(q, k, v, p, cfg=cfg)
            refs = reference_pair(q, k, v, **case.options())
            for res in (compare("out", out, *refs["out"]), compare("lse", lse, *refs["lse"])):
                print(f"{'ok' if res.ok else 'FAIL'} [{name}] {case.id}: {res}", flush=True)
                if not res.ok:
                    return 1
            checked += 1
        if not checked:
            print(f"{name}: builds at none of the check shapes; not timed", flush=True)
            return 1

    causal = args.causal
    cases = [Case(16384 // n, n, n, heads, heads, d, dtype=bf16, causal=causal) for n in seqlens]
    fns: dict[tuple[str, int], object] = {}
    for case in cases:
        for name, changes in variants:
            (q, k, v, p), cfg = cfg_for(case, changes)
            ok, why = can_implement(cfg, d, bf16)
            if not ok:
                print(f"{name}: cannot build {cfg} at N = {case.seqlen_q}: {why}", flush=True)
                return 1
            fns[name, case.seqlen_q] = lambda q=q, k=k, v=v, p=p, cfg=cfg: fa3.forward(
                q, k, v, p, cfg=cfg
            )
        for peer in ("fa3", "sdpa-cudnn", "fa4"):
            try:
                fns[peer, case.seqlen_q] = prepare(peer, case)
            except Exception as exc:  # FA4 not installed, a backend refusing the shape
                print(f"{peer}: not timed ({type(exc).__name__}: {exc})"[:200], flush=True)
    _time_and_report(fns, seqlens, args, "bf16", 12, ("sdpa-cudnn", "fa4", "fa3"))
    return 0


def _time_and_report(
    fns: dict, seqlens: list[int], args, dtype: str, width: int, bases: tuple[str, ...]
) -> None:
    """Time every contender of `fns` ((name, N) -> callable) once per N per pass, passes
    interleaved, and print forward TFLOP/s per pass and the medians (B·N = 16k, Hq·D = 2048),
    then every contender's per-pass ratio to each of `bases` (`ab_stats.paired_ratios`)."""
    from benchmarks.ab_stats import paired_ratios
    from flashsuite.dispatch.bench import time_ms

    d = args.head_dim
    tflops: dict[tuple[str, int], list[float]] = {key: [] for key in fns}
    for _ in range(args.passes):
        for n in seqlens:
            flops = 4 * (16384 // n) * (2048 // d) * n * n * d / (2 if args.causal else 1)
            for (name, m), fn in fns.items():
                if m == n:
                    with torch.no_grad():
                        tflops[name, n].append(flops / time_ms(fn) / 1e9)
    what = "causal" if args.causal else "non-causal"
    print(f"forward TFLOP/s, D {d}, {what}, {dtype}, B*N = 16k, Hq*D = 2048", flush=True)
    for (name, n), vals in tflops.items():
        passes = " ".join(f"{t:.1f}" for t in vals)
        print(f"{name:>{width}} N {n:5d}: median {statistics.median(vals):.1f} (passes {passes})")
    for line in paired_ratios(tflops, [b for b in bases if any(k[0] == b for k in tflops)]):
        print(line)


def _fp8_main(args, variants: list, seqlens: list[int]) -> int:
    """--fp8: the e4m3 forward's variants against the shipped fp8 config (see the docstring)."""
    from benchmarks.fa3_fp8_check import _inputs, _small_cases, check_case
    from flashsuite.common.fp8 import keys_major
    from flashsuite.common.testing import Case
    from flashsuite.common.validation import check_inputs
    from flashsuite.dispatch.bench import prepare
    from flashsuite.fa3 import interface as fa3
    from flashsuite.fa3.configs import FP8_DTYPE, can_implement, config_for

    d, heads, causal = args.head_dim, 2048 // args.head_dim, args.causal
    for name, changes in variants:
        for c in _small_cases(d):
            c = {**c, "causal": c.get("causal", False) or causal}
            q, k, v, _ = _inputs(c)
            p = check_inputs(q, k, v, causal=c["causal"])
            cfg = variant_config(p, changes)
            ok, why = can_implement(cfg, d, FP8_DTYPE)
            if not ok:
                print(f"{name}: cannot build {cfg}: {why}", flush=True)
                return 1
            res = check_case(c, cfg=cfg)
            print(f"{res['status']} [{name}] {c}: {res}"[:400], flush=True)
            if res["status"] != "PASS":
                return 1
    fns: dict[tuple[str, int], object] = {}
    for n in seqlens:
        b = 16384 // n
        q, k, v, ds = _inputs(dict(b=b, nq=n, nk=n, hq=heads, hkv=heads, d=d, descale=True))
        p = check_inputs(q, k, v, causal=causal)
        for name, changes in [("fa3-fp8", {}), *variants]:
            cfg = variant_config(p, changes)
            fns[name, n] = lambda q=q, k=k, v=v, p=p, ds=ds, cfg=cfg: fa3.forward(
                q, k, v, p, *ds, cfg=cfg
            )
        # The same call on V laid out keys-major (what quantize(..., keys_major=True) writes):
        # the long-key builds read it as Vᵀ instead of copying V before the kernel.
        vk = keys_major(v)
        pk = check_inputs(q, k, vk, causal=causal)
        fns["fa3-fp8-km", n] = lambda q=q, k=k, v=vk, p=pk, ds=ds: fa3.forward(q, k, v, p, *ds)
        if args.fp8_blocks:
            # The per-block build (docs/fp8.md): the same descales as block views, q in blocks
            # of 128 rows, k and v in blocks of one key tile (a descale load per K/V block).
            from flashsuite.common.fp8 import block_view

            tile = config_for(p).tile_n
            views = (
                block_view(ds[0][:, :, None].expand(b, heads, -(-n // 128)).contiguous(), 128),
                *(block_view(t[:, :, None].expand(b, heads, -(-n // tile)).contiguous(), tile)
                  for t in ds[1:]),
            )  # fmt: skip
            fns["fa3-fp8-blocks", n] = lambda q=q, k=k, v=v, p=p, views=views: fa3.forward(
                q, k, v, p, *views
            )
        case = Case(b, n, n, heads, heads, d, dtype=torch.bfloat16, causal=causal)
        for peer in ("fa3", "sdpa-cudnn"):
            fns[f"{peer}-bf16", n] = prepare(peer, case)
    _time_and_report(fns, seqlens, args, "e4m3 (bf16 peers)", 16, ("sdpa-cudnn-bf16", "fa3-fp8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
