"""HBM traffic and speed of fa1, fa2 and materialising PyTorch attention, next to the model.

On a GPU host (B·N = 16k tokens, Hq·D = 2048, bf16, non-causal):

    python scripts/hbm_traffic.py                  # forward time and TFLOP/s, model GB beside them
    python scripts/hbm_traffic.py --ncu            # plus measured DRAM bytes: runs itself under ncu

DRAM bytes are `dram__bytes_read.sum` and `dram__bytes_write.sum` summed over every kernel of
one forward (ncu --clock-control none, NVTX range "measure"), after a warm-up call outside the
range so compilation and autotuning are not counted. One ncu process profiles every case (N =
1k, 4k, 16k); a marker kernel before each forward tells the cases apart in ncu's output.
The model is `common/traffic.py`, with the tile sizes (and fa1 Q splits) each version actually
uses; it counts every tile re-read as HBM traffic. "floor" is the compulsory traffic (q, k, v
read once, out and LSE written once): re-reads that hit the 50 MB L2 land between the two.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys

import torch

from flashsuite.common import ncu, traffic
from flashsuite.common.flops import attention_flops
from flashsuite.common.testing import make_inputs
from flashsuite.dispatch.bench import materialising, standard_sweep, time_ms

CONTENDERS = ("fa1", "fa2", "naive")
SEQLENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)


def _inputs(n: int, d: int):
    (case,) = standard_sweep(head_dims=(d,), seqlens=(n,), causals=(False,))
    return make_inputs(case, "cuda")  # q, k, v (B, N, H, D) bf16


def _runner(name: str, q, k, v):
    from flashsuite import dispatch

    if name in ("fa1", "fa2"):
        return lambda: dispatch.attention(q, k, v, version=name)
    return materialising(q, k, v)


def model_bytes(name: str, n: int, d: int) -> traffic.Traffic:
    """The traffic model with the tiles (and, for fa1, the Q splits) the version launches."""
    b, h = 16384 // n, 2048 // d
    if name == "fa1":
        from flashsuite.fa1 import configs

        cfg = configs.fwd_config(d, torch.bfloat16, 90, False)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = configs.q_splits(b * h, math.ceil(n / cfg.block_m), sms)
        return traffic.fa1_forward(
            b, h, n, n, d, 2, cfg.block_m, cfg.block_n, q_splits=splits,
            reads_initial_o=cfg.use_tma,
        )  # fmt: skip
    if name == "fa2":
        from flashsuite.fa2 import configs

        cfg = configs.fwd_config(d, torch.bfloat16, False, 90)
        return traffic.fa2_forward(b, h, n, n, d, 2, cfg.block_m, cfg.block_n)
    return traffic.naive_forward(b, h, n, n, d, 2)


NCU_SEQLENS = (1024, 4096, 16384)
_BYTES = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9}


def profile_child(cases: list[tuple[str, int, int]]) -> None:
    """Run under ncu: per case, one forward in the profiled range (common/ncu.py)."""
    for name, n, d in cases:
        run = _runner(name, *_inputs(n, d))
        ncu.measure_once(run)
        del run
        torch.cuda.empty_cache()


def ncu_bytes(cases: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], tuple[float, float]]:
    """DRAM bytes (read, written) of one forward per case, from one ncu process."""
    exe = shutil.which("ncu")
    if exe is None:
        print("ncu not on PATH: no measured bytes", file=sys.stderr)
        return {}
    spec = ",".join(f"{name}:{n}:{d}" for name, n, d in cases)
    cmd = ncu.command(exe, "--print-units", "base")
    cmd += ["--metrics", "dram__bytes_read.sum,dram__bytes_write.sum"]
    cmd += [sys.executable, __file__, "--profile-child", spec]
    res = subprocess.run(cmd, capture_output=True, text=True)
    per_case = ncu.cases(res.stdout)
    if res.returncode != 0 or len(per_case) != len(cases):
        print(f"ncu rc {res.returncode}, {len(per_case)} marker kernels for {len(cases)} cases:")
        print(f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return {}
    totals = {}
    for case, kernels in zip(cases, per_case, strict=True):
        totals[case] = tuple(
            sum(ncu.value(k["metrics"][m], _BYTES) for k in kernels if m in k["metrics"])
            for m in ("dram__bytes_read.sum", "dram__bytes_write.sum")
        )
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile-child", help=argparse.SUPPRESS)
    parser.add_argument("--ncu", action="store_true", help="measure DRAM bytes with ncu")
    args = parser.parse_args()
    if args.profile_child:
        cases = [
            (c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2]))
            for c in args.profile_child.split(",")
        ]
        profile_child(cases)
        return
    measured = {}
    if args.ncu:
        cases = [(name, n, d) for d in HEAD_DIMS for n in NCU_SEQLENS for name in CONTENDERS]
        measured = ncu_bytes(cases)
    print("N      D   version  ms       TFLOP/s  model GB r/w     floor GB r/w     ncu GB r/w")
    for d in HEAD_DIMS:
        for n in SEQLENS:
            flops = attention_flops(16384 // n, 2048 // d, n, n, d)
            for name in CONTENDERS:
                run = _runner(name, *_inputs(n, d))
                ms = time_ms(run)
                m = model_bytes(name, n, d)
                f = traffic.compulsory_forward(16384 // n, 2048 // d, n, n, d, 2)
                line = (
                    f"{n:<6} {d:<3} {name:8} {ms:8.3f} {flops / ms / 1e9:8.0f}  "
                    f"{m.read / 1e9:6.2f} / {m.written / 1e9:6.2f}   "
                    f"{f.read / 1e9:6.2f} / {f.written / 1e9:6.2f}"
                )
                if (name, n, d) in measured:
                    r, w = measured[(name, n, d)]
                    line += f"   {r / 1e9:6.2f} / {w / 1e9:6.2f}"
                print(line, flush=True)
                del run
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
