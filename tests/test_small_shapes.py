"""GPU sweep of small and odd shapes: every version's forward and backward against the oracle.

Sequence lengths on both sides of every tile boundary the versions use (16 ... 128 rows), Nq
and Nk different, every (D, Dv) pair a version's `supports()` accepts, GQA, causal and a
sliding window. A kernel that touches memory outside its tensors can fault here (the CUDA
context is then lost for the rest of the process, so scripts/gpu_check.sh runs this file in a
process of its own, and a subset under compute-sanitizer memcheck). The address arithmetic
alone is also checked on CPU, under the interpreter, by test_bounds.py.
"""

from __future__ import annotations

import pytest
import torch

from flashsuite import dispatch
from flashsuite.common.testing import Case, compare, make_grad_out, make_inputs, reference_pair
from tests.conftest import runnable_versions

pytestmark = pytest.mark.gpu

F32 = torch.float32
LENGTHS = (1, 2, 3, 4, 7, 8, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 72, 96, 127, 128)
LENGTHS += (129, 130)
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# Options cycled over the sweep: (Hq, Hkv, causal, window_size)
VARIANTS = (
    (2, 2, False, (-1, -1)),
    (4, 2, True, (-1, -1)),
    (2, 2, False, (7, 3)),
    (6, 2, False, (-1, -1)),
    (2, 1, True, (-1, -1)),
    (4, 4, False, (0, 20)),
)
VERSIONS = runnable_versions()


def _supported(case: Case, version: str, device: str) -> tuple[bool, str]:
    q, k, v = make_inputs(case, device, requires_grad=True)
    try:
        dispatch.select(q, k, v, version=version, **case.options())
    except dispatch.Unsupported as exc:
        return False, str(exc)
    return True, ""


def _pairs(version: str, dtype: torch.dtype, device: str) -> list[tuple[int, int]]:
    """The (D, Dv) pairs the version takes (forward and backward) for `dtype` on this GPU."""
    pairs = []
    for d in HEAD_DIMS:
        for dv in HEAD_DIMS:
            case = Case(seqlen_q=16, seqlen_k=16, head_dim=d, head_dim_v=dv, dtype=dtype)
            if _supported(case, version, device)[0]:
                pairs.append((d, dv))
    return pairs


def _check(version: str, case: Case, device: str) -> None:
    ok, why = _supported(case, version, device)
    if not ok:
        pytest.skip(why)
    q, k, v = make_inputs(case, device, requires_grad=True)
    dout = make_grad_out(case, device)
    out, lse = dispatch.attention(q, k, v, **case.options(), return_lse=True, version=version)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    if q.is_cuda:
        torch.cuda.synchronize()  # a fault surfaces here, attributed to this case
    ref = reference_pair(q, k, v, grad_out=dout, **case.options())
    results = [compare("out", out, *ref["out"]), compare("lse", lse, *ref["lse"], dtype=F32)]
    results += [
        compare(name, got, *ref[name], factor=3.0)
        for name, got in (("dq", dq), ("dk", dk), ("dv", dv))
    ]
    bad = [str(c) for c in results if not c.ok]
    assert not bad, f"{case.id}\n" + "\n".join(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [8, 12, 16, 24, 48])
@pytest.mark.parametrize("version", VERSIONS)
def test_head_dim_v_smaller_than_head_dim(version: str, n: int, dtype, device: str) -> None:
    """D 64 / Dv 32, Nq = Nk: the shapes that once faulted in the fa2 forward on the H200."""
    _check(version, Case(seqlen_q=n, seqlen_k=n, head_dim=64, head_dim_v=32, dtype=dtype), device)


@pytest.mark.parametrize("i", range(len(LENGTHS)), ids=lambda i: f"nq{LENGTHS[i]:03d}")
@pytest.mark.parametrize("version", VERSIONS)
def test_tile_boundaries(version: str, i: int, device: str) -> None:
    """Nq = LENGTHS[i] against Nk = Nq and a second Nk further along the list; the (D, Dv)
    pair and the options (GQA, causal, window) rotate with i so every variant meets both
    short and long sequences."""
    dtype = torch.bfloat16
    pairs = _pairs(version, dtype, device)
    if not pairs:
        pytest.skip(f"{version}: no (D, Dv) pair supported for {dtype}")
    d, dv = pairs[(i * 5) % len(pairs)]
    hq, hkv, causal, window = VARIANTS[i % len(VARIANTS)]
    nq = LENGTHS[i]
    for nk in dict.fromkeys((nq, LENGTHS[(i * 7 + 5) % len(LENGTHS)])):
        case = Case(
            seqlen_q=nq, seqlen_k=nk, heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=dv,
            dtype=dtype, causal=causal, window_size=window,
        )  # fmt: skip
        _check(version, case, device)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_head_dim_pair(version: str, device: str) -> None:
    """Each (D, Dv) pair the version claims, at lengths that fill no tile (Nq 33, Nk 17),
    causal with GQA."""
    pairs = _pairs(version, torch.float16, device)
    if not pairs:
        pytest.skip(f"{version}: no (D, Dv) pair supported for float16")
    for d, dv in pairs:
        case = Case(
            seqlen_q=33, seqlen_k=17, heads_q=4, heads_kv=2, head_dim=d, head_dim_v=dv,
            causal=True,
        )  # fmt: skip
        _check(version, case, device)
