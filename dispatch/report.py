"""Render benchmark results (from `flashsuite bench` or pytest-benchmark's JSON) as a markdown
table with ratios to the SDPA peers, and TFLOP/s-vs-N plots (bench-fwd.png, bench-bwd.png: a
panel per D and causal).

    python -m flashsuite.dispatch.report results.json --out docs/results
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

RATIO_PEERS = ("sdpa-flash", "sdpa-cudnn")


def load(path: str | Path) -> tuple[list[dict], dict]:
    """Results and metadata from either JSON format."""
    data = json.loads(Path(path).read_text())
    if "benchmarks" in data:  # pytest-benchmark: our numbers live in extra_info
        results = [
            b["extra_info"] for b in data["benchmarks"] if "tflops" in b.get("extra_info", {})
        ]
        info = data.get("machine_info", {})
        meta = {
            "gpu": info.get("gpu", "?"),
            "date": data.get("datetime", "?")[:10],
            "commit": data.get("commit_info", {}).get("id", "?")[:10],
        }
        return results, meta
    return data["results"], data.get("meta", {})


def table(results: list[dict]) -> str:
    contenders = list(dict.fromkeys(r["contender"] for r in results))
    ours = [c for c in contenders if not c.startswith("sdpa")]
    peers = [p for p in RATIO_PEERS if p in contenders]
    grid: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in results:
        key = (r["direction"], r["head_dim"], r["causal"], r["seqlen"])
        grid[key][r["contender"]] = r["tflops"]
    head = ["dir", "D", "causal", "N", *contenders]
    head += [f"{o}/{p.removeprefix('sdpa-')}" for o in ours for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(grid):
        row = grid[key]
        cells = [key[0], str(key[1]), "yes" if key[2] else "no", str(key[3])]
        cells += [_num(row.get(c)) for c in contenders]
        for o in ours:
            for p in peers:
                a, b = row.get(o, math.nan), row.get(p, math.nan)
                cells.append(f"{a / b:.2f}" if a == a and b == b and b else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.0f}" if x >= 10 else f"{x:.3g}"  # GPU TFLOP/s whole, a CPU run's readable


def plot(results: list[dict], out_dir: Path) -> list[Path]:
    """One figure per direction, `bench-fwd.png` and `bench-bwd.png`: a panel per (D, causal),
    TFLOP/s against N, one line per version (solid) and SDPA peer (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for direction in sorted({r["direction"] for r in results}, key=("fwd", "bwd").index):
        rows = [r for r in results if r["direction"] == direction]
        panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
        cols = min(3, len(panels))
        n_rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(n_rows, cols, figsize=(5 * cols, 3.6 * n_rows), squeeze=False)
        for ax, (d, causal) in zip(axes.flat, panels, strict=False):
            sel = [r for r in rows if (r["head_dim"], r["causal"]) == (d, causal)]
            for c in dict.fromkeys(r["contender"] for r in sel):
                pts = sorted(
                    (r["seqlen"], r["tflops"])
                    for r in sel
                    if r["contender"] == c and r["tflops"] == r["tflops"]
                )
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        marker="o",
                        label=c,
                        linestyle="--" if c.startswith("sdpa") else "-",
                    )
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction} D={d}{' causal' if causal else ''}")
            ax.set_xlabel(f"N (B·N = {sel[0]['batch'] * sel[0]['seqlen']})")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(panels) :]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / f"bench-{direction}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def render(results: list[dict], meta: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    header = (
        f"GPU {meta.get('gpu', '?')}, {meta.get('date', '?')}, commit {meta.get('commit', '?')}"
    )
    units = "TFLOP/s (forward 4·B·H·N²·D, causal halved, backward 2.5x)"
    text = f"{header}\n\n{units}\n\n{table(results)}\n"
    (out_dir / "bench.md").write_text(text)
    try:
        paths = plot(results, out_dir)
    except ImportError:
        return text + "\n(matplotlib not installed: no plot)\n"
    return text + f"\nplots: {', '.join(str(p) for p in paths)}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="bench.json from `flashsuite bench` or pytest-benchmark")
    parser.add_argument("--out", default=".", help="folder for bench.md and the plots")
    args = parser.parse_args()
    results, meta = load(args.json)
    print(render(results, meta, Path(args.out)))


if __name__ == "__main__":
    main()
