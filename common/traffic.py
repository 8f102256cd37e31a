"""HBM-traffic model of each attention loop order: bytes read and written, from the schedule.

Pure Python (no torch). Every function returns `(bytes_read, bytes_written)` for the forward
pass of one problem, counting what the loop order moves between HBM and the chip and
assuming nothing is served from L2. That makes these upper bounds for a real GPU, where
L2 (50 MB on H100/H200) absorbs re-reads whose working set fits; compare against ncu's
`dram__bytes_read.sum` / `dram__bytes_write.sum` to see how much L2 saves.

Symbols: B batch, H query heads, Nq / Nk query / key lengths,
D head dim of q and k, Dv of v (default D), e the element size of q, k, v, out (2 for
fp16/bf16, 4 for fp32), BM = Br rows of Q per tile, BN = Bc rows of K/V per tile,
Tr = ceil(Nq / BM), Tc = ceil(Nk / BN). Statistics (m, l, LSE) and the FA1 running output are
fp32 (4 bytes). Non-causal, full attention: every (Q tile, K/V tile) pair is visited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

F32 = 4  # bytes of the fp32 scratch (running O, m, l) and of the LSE


@dataclass(frozen=True)
class Traffic:
    """Bytes moved between HBM and the chip by one forward pass."""

    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written

    def __iter__(self):  # unpacks as (bytes_read, bytes_written)
        return iter((self.read, self.written))


def fa1_forward(
    B: int,
    H: int,
    Nq: int,
    Nk: int,
    D: int,
    elem: int,
    BM: int,
    BN: int,
    *,
    Dv: int | None = None,
    fold_first_and_last: bool = True,
    q_splits: int = 1,
    reads_initial_o: bool = False,
) -> Traffic:
    """FA1 (Dao et al. 2022, Alg. 1): outer loop over K/V tiles j, inner over Q tiles i.

    Per (batch, head), K and V are read once; every (j, i) step reads Q_i and the fp32 running
    state O_i (BM x Dv), m_i, l_i, and writes O_i, m_i, l_i back:

        read    = B*H * [ Nk*(D + Dv)*e  +  Tc * Nq*( D*e + (Dv + 2)*4 ) ]
        written = B*H * [ Tc * Nq*(Dv + 2)*4 ]  (+ out and LSE at the end)

    With `fold_first_and_last` (what flashsuite's fa1 does), the j = 0 step does not read the
    initial O = 0, m = -inf, l = 0 (one fewer state read per row), and the last step writes
    out (Dv*e) and LSE (4) instead of the state, so

        read    = B*H * [ Nk*(D + Dv)*e + Tc*Nq*D*e + (Tc - 1)*Nq*(Dv + 2)*4 ]
        written = B*H * [ (Tc - 1)*Nq*(Dv + 2)*4 + Nq*(Dv*e + 4) ]

    Without it (the paper literally): initialise O, m, l in HBM (Nq*(Dv + 2)*4 written),
    read the state at every step, write it at every step, then a finalize pass reads it once
    more and writes out and LSE. With GQA the same K/V tile is read by each of the H/Hkv query
    heads' programs, so K/V reads are B*H*Nk*(D + Dv)*e whatever Hkv (one program per query
    head), and the model takes no Hkv.
    The quadratic term is Tc*Nq*(D*e + 2*(Dv + 2)*4) ~ Nq*Nk/BN * (D*e + 8*Dv): only a
    larger K/V tile BN cuts it.

    `reads_initial_o` (fa1's sm90 TMA path): the j = 0 step still loads the O_i tile (a TMA
    load cannot be masked; the values are discarded), one Nq*Dv*4 read more per (batch, head).

    `q_splits` > 1 (flashsuite's fa1 aims at 8 programs per SM): each (batch, head) is shared
    by that many programs, each owning a range of Q tiles and reading all of K and V, so the
    K/V term is multiplied by q_splits (non-causal; causal splits skip the K/V tiles they
    never see).
    """
    Dv = D if Dv is None else Dv
    tc = math.ceil(Nk / BN)
    bh = B * H
    state = Nq * (Dv + 2) * F32  # fp32 O_i, m_i, l_i for every row of one (batch, head)
    kv = q_splits * Nk * (D + Dv) * elem
    q_reads = tc * Nq * D * elem
    final = Nq * (Dv * elem + F32)  # out and LSE
    if fold_first_and_last:
        read = bh * (kv + q_reads + (tc - 1) * state + (Nq * Dv * F32 if reads_initial_o else 0))
        written = bh * ((tc - 1) * state + final)
    else:
        read = bh * (kv + q_reads + tc * state + state)  # + finalize reads the state once
        written = bh * (state + tc * state + final)  # init + every step + out and LSE
    return Traffic(read, written)


def fa2_forward(
    B: int,
    H: int,
    Nq: int,
    Nk: int,
    D: int,
    elem: int,
    BM: int,
    BN: int,
    *,
    Dv: int | None = None,
) -> Traffic:
    """FA2: outer loop over Q tiles (one program each), inner over K/V tiles; O stays on chip.

    Q is read once, every Q tile streams all of K and V, O and LSE are written once:

        read    = B*H * [ Nq*D*e  +  Tr * Nk*(D + Dv)*e ]
        written = B*H * [ Nq*Dv*e  +  Nq*4 ]

    The quadratic term is Tr*Nk*(D + Dv)*e ~ Nq*Nk/BM * 2*D*e: only reads, in the input
    dtype, and (unlike FA1) shared by the concurrent programs of one head through L2.
    BN does not appear: it changes the tile shape, not what is read.
    """
    Dv = D if Dv is None else Dv
    tr = math.ceil(Nq / BM)
    bh = B * H
    read = bh * (Nq * D * elem + tr * Nk * (D + Dv) * elem)
    written = bh * (Nq * Dv * elem + Nq * F32)
    return Traffic(read, written)


def compulsory_forward(
    B: int, H: int, Nq: int, Nk: int, D: int, elem: int, *, Dv: int | None = None, Hkv: int = 0
) -> Traffic:
    """The floor of any exact forward: q, k, v read once, out and LSE written once.

    Every model above counts each re-read of a tile as HBM traffic; on an H200 (50 MB of L2)
    re-reads whose working set stays in L2 cost no HBM bytes, so measured DRAM bytes fall
    between this floor and the loop-order model (docs/results.md sets them side by side).
    """
    Dv = D if Dv is None else Dv
    hkv = Hkv or H
    read = B * (H * Nq * D + hkv * Nk * (D + Dv)) * elem
    written = B * H * Nq * (Dv * elem + F32)
    return Traffic(read, written)


def naive_forward(
    B: int,
    H: int,
    Nq: int,
    Nk: int,
    D: int,
    elem: int,
    *,
    Dv: int | None = None,
    score_elem: int | None = None,
    separate_scale: bool = False,
) -> Traffic:
    """Materialising attention `softmax(q @ k^T * scale) @ v` as three kernels through HBM.

    1. S = q @ k^T (scale fused): reads Q and K, writes S (Nq x Nk);
    2. P = softmax(S): reads S, writes P (Nq x Nk);
    3. O = P @ v: reads P and V, writes O.

        read    = B*H * [ Nq*D*e + Nk*D*e  +  Nq*Nk*s  +  Nq*Nk*s + Nk*Dv*e ]
        written = B*H * [ Nq*Nk*s  +  Nq*Nk*s  +  Nq*Dv*e ]

    with s = `score_elem` the element size of S and P (default e: PyTorch keeps them in the
    input dtype). Each GEMM is assumed to read its operands once (a tiled GEMM re-reads
    them from L2, not HBM, at these sizes). `separate_scale`: `(q @ k^T) * scale` as its own
    elementwise kernel, one more Nq*Nk*s read and write (scaling q first avoids it).
    """
    Dv = D if Dv is None else Dv
    s = elem if score_elem is None else score_elem
    bh = B * H
    scores = Nq * Nk * s
    passes = 3 if separate_scale else 2  # kernels that read (and write) an Nq x Nk matrix
    read = bh * (Nq * D * elem + Nk * D * elem + passes * scores + Nk * Dv * elem)
    written = bh * (passes * scores + Nq * Dv * elem)
    return Traffic(read, written)


def sweep(
    seqlens: tuple[int, ...] = (1024, 4096, 16384),
    head_dims: tuple[int, ...] = (64, 128),
    *,
    tokens: int = 16384,
    width: int = 2048,
    elem: int = 2,
    fa1_tiles: tuple[int, int] = (32, 256),
    fa2_tiles: tuple[int, int] = (128, 64),
    num_sms: int = 132,
) -> list[dict[str, object]]:
    """The model over the standard sweep (B*N = tokens, H*D = width), one row per (N, D)."""
    rows: list[dict[str, object]] = []
    for d in head_dims:
        for n in seqlens:
            b, h = max(1, tokens // n), width // d
            rows.append(
                {
                    "N": n,
                    "D": d,
                    "B": b,
                    "H": h,
                    "fa1": fa1_forward(b, h, n, n, d, elem, *fa1_tiles),
                    "fa1_split": fa1_forward(
                        b,
                        h,
                        n,
                        n,
                        d,
                        elem,
                        *fa1_tiles,
                        q_splits=_splits(b * h, n, fa1_tiles[0], num_sms),
                    ),
                    "fa2": fa2_forward(b, h, n, n, d, elem, *fa2_tiles),
                    "naive": naive_forward(b, h, n, n, d, elem),
                }
            )
    return rows


def _splits(batch_heads: int, n: int, bm: int, num_sms: int, programs_per_sm: int = 8) -> int:
    """The Q-split count flashsuite's fa1 launches (fa1/configs.py q_splits, PROGRAMS_PER_SM;
    common does not import the versions, tests/test_common.py checks the two agree)."""
    return max(1, min(math.ceil(n / bm), math.ceil(programs_per_sm * num_sms / batch_heads)))


def _gb(x: int) -> str:
    return f"{x / 1e9:8.3f}"


if __name__ == "__main__":
    print("forward HBM traffic, GB read / written (B*N = 16k, H*D = 2048, 2-byte inputs;")
    print("fa1 32x256 tiles; fa1_split as launched on 132 SMs; fa2 128x64 tiles)")
    cols = ("fa1", "fa1_split", "fa2", "naive")
    print(f"{'N':>6} {'D':>4} " + " ".join(f"{c + ' r':>12} {c + ' w':>12}" for c in cols))
    for r in sweep():
        cells = " ".join(f"{_gb(r[c].read):>12} {_gb(r[c].written):>12}" for c in cols)
        print(f"{r['N']:>6} {r['D']:>4} {cells}")
