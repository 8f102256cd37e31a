"""HBM traffic and speed of fa1, fa2 and materialising PyTorch attention, next to the model.

On a GPU host (B·N = 16k tokens, Hq·D = 2048, bf16, non-causal):

    python scripts/hbm_traffic.py                  # forward time and TFLOP/s, model GB beside them
    python scripts/hbm_traffic.py --ncu            # plus measured DRAM bytes: runs itself under ncu
    python scripts/hbm_traffic.py --one fa1 4096 64   # one forward inside an NVTX range (for ncu)

DRAM bytes are `dram__bytes_read.sum` and `dram__bytes_write.sum` summed over every kernel of
one forward (ncu --clock-control none, NVTX range "measure"), after a warm-up call outside the
range so compilation and autotuning are not counted. The model is `common/traffic.py`, with
the tile sizes each version actually uses.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import shutil
import subprocess
import sys

import torch

from flashsuite.common import traffic
from flashsuite.common.flops import attention_flops

CONTENDERS = ("fa1", "fa2", "naive")
SEQLENS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)


def _inputs(n: int, d: int):
    b, h = 16384 // n, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (b, n, h, d)
    q, k, v = (
        torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in "qkv"
    )
    return q, k, v


def _runner(name: str, q, k, v):
    from flashsuite import dispatch

    if name in ("fa1", "fa2"):
        return lambda: dispatch.attention(q, k, v, version=name)
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, H, N, D)
    scale = 1.0 / math.sqrt(q.shape[-1])
    # What a user writes without a fused kernel: S and P go through HBM in bf16.
    return lambda: torch.softmax((qh * scale) @ kh.transpose(-1, -2), dim=-1) @ vh


def model_bytes(name: str, n: int, d: int) -> traffic.Traffic:
    """The traffic model with the tiles (and, for fa1, the Q splits) the version launches."""
    b, h = 16384 // n, 2048 // d
    if name == "fa1":
        from flashsuite.fa1 import configs

        cfg = configs.fwd_config(d, torch.bfloat16, 90, False)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = configs.q_splits(b * h, math.ceil(n / cfg.block_m), sms)
        return traffic.fa1_forward(b, h, n, n, d, 2, cfg.block_m, cfg.block_n, q_splits=splits)
    if name == "fa2":
        from flashsuite.fa2 import configs

        cfg = configs.fwd_config(d, torch.bfloat16, False, 90)
        return traffic.fa2_forward(b, h, n, n, d, 2, cfg.block_m, cfg.block_n)
    return traffic.naive_forward(b, h, n, n, d, 2)


def one(name: str, n: int, d: int) -> None:
    """Warm up, then run one forward inside the NVTX range that ncu filters on."""
    run = _runner(name, *_inputs(n, d))
    run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measure")
    run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def ncu_bytes(name: str, n: int, d: int) -> tuple[float, float] | None:
    ncu = shutil.which("ncu")
    if ncu is None:
        return None
    cmd = [
        ncu,
        "--clock-control",
        "none",
        "--nvtx",
        "--nvtx-include",
        "measure/",
        "--csv",
        "--metrics",
        "dram__bytes_read.sum,dram__bytes_write.sum",
        sys.executable,
        __file__,
        "--one",
        name,
        str(n),
        str(d),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    rows = [line for line in res.stdout.splitlines() if line.startswith('"')]
    read = written = 0.0
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(row["Metric Unit"], 1)
        if row["Metric Name"] == "dram__bytes_read.sum":
            read += value * scale
        elif row["Metric Name"] == "dram__bytes_write.sum":
            written += value * scale
    return read, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=3, metavar=("VERSION", "N", "D"))
    parser.add_argument("--ncu", action="store_true", help="measure DRAM bytes with ncu")
    args = parser.parse_args()
    if args.one:
        one(args.one[0], int(args.one[1]), int(args.one[2]))
        return
    from triton.testing import do_bench

    print("N      D   version  ms       TFLOP/s  model GB r/w     ncu GB r/w")
    for d in HEAD_DIMS:
        for n in SEQLENS:
            flops = attention_flops(16384 // n, 2048 // d, n, n, d)
            for name in CONTENDERS:
                run = _runner(name, *_inputs(n, d))
                ms = do_bench(run, warmup=25, rep=100, return_mode="median")
                m = model_bytes(name, n, d)
                line = (
                    f"{n:<6} {d:<3} {name:8} {ms:8.3f} {flops / ms / 1e9:8.0f}  "
                    f"{m.read / 1e9:6.2f} / {m.written / 1e9:6.2f}"
                )
                measured = ncu_bytes(name, n, d) if args.ncu else None
                if measured is not None:
                    line += f"   {measured[0] / 1e9:6.2f} / {measured[1] / 1e9:6.2f}"
                print(line, flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
