"""Statistics of interleaved A/B timings (fa3_fwd_ab, fa3_bwd_ab)."""

from __future__ import annotations

import statistics


def paired_ratios(tflops: dict[tuple[str, int], list[float]], peers: list[str]) -> list[str]:
    """Per shape, each contender's TFLOP/s over each peer's pass by pass (a peer over another
    only when listed after it), as lines: the passes
    run interleaved, so a pass's ratio compares two timings taken minutes apart at most and
    the machine's drift between passes (several percent) mostly cancels; the median of the
    per-pass ratios and their range say more than the ratio of two medians."""
    lines = []
    for peer in peers:
        for (name, n), values in tflops.items():
            base = tflops.get((peer, n))
            if (
                name == peer
                or base is None
                or (name in peers and peers.index(name) < peers.index(peer))
            ):
                continue  # one peer over another only as listed later over earlier
            ratios = [a / b for a, b in zip(values, base, strict=True)]
            lines.append(
                f"{name:>12} / {peer} N {n:>5}: median {statistics.median(ratios):.3f} "
                f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} passes)"
            )
    return lines
