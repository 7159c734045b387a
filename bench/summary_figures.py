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
    return plt, fig, ax


def _footer(fig, record: dict) -> None:
    fig.text(0.01, 0.01, f"{record['date']} · {record['machine'].split(';')[0][:120]}", fontsize=6, color="0.35")


def plot_heads(record: dict, path: Path) -> None:
    prompts = record["prompts"]
    plt, fig, ax = _axes("Speed-up over target-only, torch bfloat16 (run 6's heads; 2-core CPU)")
    xs = range(len(prompts))
    heads = [p["heads"] for p in prompts]
    low = [p["heads"] - p["heads_low"] for p in prompts]
    high = [p["heads_high"] - p["heads"] for p in prompts]
    ax.bar([x - 0.2 for x in xs], heads, 0.4, yerr=[low, high], capsize=3, label="heads (median of 3, range)")
    ax.bar([x + 0.2 for x in xs], [p["auto"] for p in prompts], 0.4, label="auto (draft / lookup / heads)")
    ax.axhline(1.0, color="0.3", lw=0.8)
    ax.axhline(record["median"]["heads"], color="C0", ls="--", lw=0.8, label=f"heads median {record['median']['heads']}×")
    ax.set_xticks(list(xs), [p["prompt"] for p in prompts], fontsize=8)
    ax.set_ylabel("× target-only decode tok/s")
    ax.legend(fontsize=8, loc="upper right")
    _footer(fig, record)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(record: dict, path: Path) -> None:
    prompts, names = record["prompts"], record["methods"]
    plt, fig, ax = _axes("Speed-up over target-only by method (speed-up suite --quick; 2-core CPU)", (9, 4.2))
    keys = list(names)
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ax.bar([x + (i - len(keys) / 2 + 0.5) * width for x in range(len(prompts))], [p[key] for p in prompts],
               width, label=names[key])
    ax.axhline(1.0, color="0.3", lw=0.8)
    ax.set_xticks(range(len(prompts)), [p["prompt"] for p in prompts], fontsize=8)
    ax.set_ylabel("× target-only decode tok/s")
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    ax.set_ylim(0, max(p[k] for p in prompts for k in keys) * 1.3)
    _footer(fig, record)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_engines(record: dict, path: Path) -> None:
    rows = record["rows"]
    plt, fig, ax = _axes("One forward of each engine: decode step and 5-token verification (2 threads)", (9, 4.6))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["decode_ms"] for r in rows], 0.4, label="decode step (1 token)")
    ax.barh([y + 0.2 for y in ys], [r["verify5_ms"] for r in rows], 0.4, label="verification of 5 tokens")
    ax.set_yticks(list(ys), [f"{r['model']}: {r['variant']}" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median of 9)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    _footer(fig, record)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kv_restore(record: dict, path: Path) -> None:
    rows = record["rows"]
    plt, fig, ax = _axes("A moved session's first token: K/V restored against re-prefill (real pair, bf16)", (7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["reprefill_s"] for r in rows], 0.4, label="re-prefill the history")
    ax.bar([x + 0.2 for x in xs], [r["restored_s"] for r in rows], 0.4, label="restore K/V chunks from Redis")
    for x, r in zip(xs, rows):
        ax.annotate(f"{r['reprefill_s'] / r['restored_s']:.1f}×", (x + 0.2, r["restored_s"]), ha="center",
                    xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_xticks(list(xs), [f"{r['tokens']} tokens" for r in rows])
    ax.set_ylabel("time to first token (s)")
    ax.legend(fontsize=8)
    _footer(fig, record)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overhead(record: dict, path: Path) -> None:
    rows = record["rows"]
    plt, fig, ax = _axes("A round's wall time: model work and orchestration (tiny pair, loopback)", (7, 4))
    labels = [f"γ={r['gamma']} {r['rpc']}" for r in rows]
    model = [r["model_p50"] for r in rows]
    orch = [r["wall_p50"] - r["model_p50"] for r in rows]
    ax.bar(labels, model, label="model (p50)")
    ax.bar(labels, orch, bottom=model, label="orchestration (wall p50 − model p50)")
    ax.set_ylabel("ms per round")
    ax.legend(fontsize=8)
    _footer(fig, record)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
