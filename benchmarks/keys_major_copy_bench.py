"""Time the copy of fp8 V into the keys-major layout (fa3's Vᵀ): PyTorch's strided copy against
`common.transpose.keys_major_copy` (a GPU run).

    python3 -m benchmarks.keys_major_copy_bench [--head-dim 128] [--passes 5]

Shapes: the standard sweep's B·N = 16k keys, Hkv·D = 2048, at N = 1k, 4k, 16k. Prints the
median time per copy and the rate of bytes read plus written (2·B·N·Hkv·D), passes interleaved;
"trit-pk" is the copy with the keys permuted within 32-key blocks (transpose_keys_permuted,
Fa3Config.permute_v_keys' Vᵀ, allocating its output).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from flashsuite.common.fp8 import keys_major_empty
    from flashsuite.common.transpose import keys_major_copy, transpose_keys_permuted
    from flashsuite.dispatch.bench import time_ms

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args(argv)
    d = args.head_dim
    h = 2048 // d
    fns, sizes = {}, {}
    for n in (1024, 4096, 16384):
        b = 16384 // n
        v = torch.randn(b, n, h, d, device="cuda").to(torch.float8_e4m3fn)
        out = keys_major_empty((b, n, h, d), v.dtype, v.device)
        fns["torch", n] = lambda v=v, out=out: out.view(torch.uint8).copy_(v.view(torch.uint8))
        fns["triton", n] = lambda v=v, out=out: keys_major_copy(v, out)
        fns["trit-pk", n] = lambda v=v: transpose_keys_permuted(v)  # permute_v_keys' Vᵀ
        sizes[n] = 2 * v.numel()
        ref = keys_major_empty((b, n, h, d), v.dtype, v.device)
        ref.view(torch.uint8).copy_(v.view(torch.uint8))
        keys_major_copy(v, out)
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), n
    times: dict = {key: [] for key in fns}
    for _ in range(args.passes):
        for key, fn in fns.items():
            times[key].append(time_ms(fn))
    print(f"fp8 V -> keys-major, D {d}, Hkv {h}, B*N = 16k ({sizes[1024] / 2**20:.0f} MiB moved)")
    for (name, n), vals in times.items():
        ms = statistics.median(vals)
        print(f"{name:>7} N {n:5d}: {ms * 1e3:7.1f} us, {sizes[n] / ms / 1e9:5.2f} TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
