"""The plots of docs/benchmarks.md's summary, from the JSON records committed beside them.

Usage:
  python bench/summary_figures.py                 # every docs/figures/*.json with a "figure" kind
  python bench/summary_figures.py --check         # only check that every record has its plot

Each record under docs/figures/ holds one headline measurement: its figures, the literal
commands that produced them, the machine, the date and the commit that recorded them. This
script draws each as docs/figures/NAME.png; it measures nothing. Rerun the record's commands to
reproduce its figures, then update the record's numbers and rerun this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"


def _axes(title: str, size: tuple[float, float] = (8, 4.2)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return fig, ax


def _save(fig, ax, record: dict, path: Path, **legend) -> None:
    """The legend, the record's date and machine at the foot, the PNG."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=legend.pop("fontsize", 8), **legend)
    fig.text(0.01, 0.01, f"{record['date']} · {record['machine'].split(';')[0][:120]}", fontsize=6, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, labels: list[str], series: list[tuple[str, list[float]]], horizontal: bool = False,
          errors: dict[str, list[list[float]]] | None = None) -> None:
    """Grouped bars: one group per label, one bar per (name, values) of series."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        offsets = [x + (i - len(series) / 2 + 0.5) * width for x in range(len(labels))]
        err = (errors or {}).get(name)
        if horizontal:
            ax.barh(offsets, values, width, label=name)
        else:
            ax.bar(offsets, values, width, label=name, yerr=err, capsize=3 if err else 0)
    if horizontal:
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    else:
        ax.set_xticks(range(len(labels)), labels, fontsize=8)


def plot_heads(record: dict, path: Path) -> None:
    prompts = record["prompts"]
    fig, ax = _axes("Speed-up over target-only, torch bfloat16 (run 6's heads; 2-core CPU)")
    heads = "heads (median of 3, range)"
    _bars(ax, [p["prompt"] for p in prompts],
          [(heads, [p["heads"] for p in prompts]), ("auto (draft / lookup / heads)", [p["auto"] for p in prompts])],
          errors={heads: [[p["heads"] - p["heads_low"] for p in prompts], [p["heads_high"] - p["heads"] for p in prompts]]})
    ax.axhline(1.0, color="0.3", lw=0.8)
    ax.axhline(record["median"]["heads"], color="C0", ls="--", lw=0.8, label=f"heads median {record['median']['heads']}×")
    ax.set_ylabel("× target-only decode tok/s")
    _save(fig, ax, record, path, loc="upper right")


def plot_speedup(record: dict, path: Path) -> None:
    prompts, names = record["prompts"], record["methods"]
    fig, ax = _axes("Speed-up over target-only by method (speed-up suite --quick; 2-core CPU)", (9, 4.2))
    _bars(ax, [p["prompt"] for p in prompts], [(names[key], [p[key] for p in prompts]) for key in names])
    ax.axhline(1.0, color="0.3", lw=0.8)
    ax.set_ylabel("× target-only decode tok/s")
    ax.set_ylim(0, max(p[key] for p in prompts for key in names) * 1.3)
    _save(fig, ax, record, path, fontsize=7, ncol=3, loc="upper right")


def plot_engines(record: dict, path: Path) -> None:
    rows = record["rows"]
    fig, ax = _axes("One forward of each engine: decode step and 5-token verification (2 threads)", (9, 4.6))
    _bars(ax, [f"{r['model']}: {r['variant']}" for r in rows],
          [("decode step (1 token)", [r["decode_ms"] for r in rows]),
           ("verification of 5 tokens", [r["verify5_ms"] for r in rows])], horizontal=True)
    ax.set_xlabel("ms (median of 9)")
    _save(fig, ax, record, path, loc="lower right")


def plot_kv_restore(record: dict, path: Path) -> None:
    rows = record["rows"]
    fig, ax = _axes("A moved session's first token: K/V restored against re-prefill (real pair, bf16)", (7, 4))
    _bars(ax, [f"{r['tokens']} tokens" for r in rows],
          [("re-prefill the history", [r["reprefill_s"] for r in rows]),
           ("restore K/V chunks from Redis", [r["restored_s"] for r in rows])])
    for x, r in enumerate(rows):
        ax.annotate(f"{r['ratio']:.1f}×", (x + 0.2, r["restored_s"]), ha="center",
                    xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_ylabel("time to first token (s)")
    _save(fig, ax, record, path)


def plot_overhead(record: dict, path: Path) -> None:
    rows = record["rows"]
    fig, ax = _axes("A round's wall time: model work and orchestration (tiny pair, loopback)", (7, 4))
    labels = [f"γ={r['gamma']} {r['rpc']}" for r in rows]
    model = [r["model_p50"] for r in rows]
    ax.bar(labels, model, label="model (p50)")
    ax.bar(labels, [r["wall_p50"] - m for r, m in zip(rows, model)], bottom=model,
           label="orchestration (wall p50 − model p50)")
    ax.set_ylabel("ms per round")
    _save(fig, ax, record, path)


PLOTS = {"heads": plot_heads, "speedup": plot_speedup, "engines": plot_engines, "kv_restore": plot_kv_restore,
         "overhead": plot_overhead}


def records(folder: Path = FIGURES) -> dict[Path, dict]:
    """Every record under folder that names a plot kind: its path -> its contents."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("figure") in PLOTS:
            found[path] = record
    return found


def median_check(record: dict) -> list[str]:
    """A record's stated medians against its rows (a typo in a copied table shows here)."""
    problems = []
    for key, stated in record.get("median", {}).items():
        values = [p[key] for p in record.get("prompts", []) if key in p]
        if values and abs(statistics.median(values) - stated) > 0.005:
            problems.append(f"{record['figure']}: median {key} is {statistics.median(values)}, the record says {stated}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="check every record has its plot; draw nothing")
    args = parser.parse_args()
    problems = []
    for path, record in records().items():
        problems += median_check(record)
        png = path.with_suffix(".png")
        if args.check:
            if not png.exists():
                problems.append(f"{png.name} is missing: run python bench/summary_figures.py")
            continue
        PLOTS[record["figure"]](record, png)
        print(f"{png.relative_to(ROOT)}  <-  {path.name}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
