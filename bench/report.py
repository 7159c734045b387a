"""Analysis of a speedup-suite run: per prompt α, c, tokens/s, speed-ups, the Leviathan bound;
a text table, the JSON document and a PNG (speed-up by prompt kind and method)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from coordinator.policy.estimates import leviathan_speedup

TARGET_ONLY = "specdec target-only"
AUTO = "specdec auto"
LOOKUP = "specdec prompt lookup"
HEADS = "specdec heads"  # proposer heads: the target's Medusa-style heads (bench/speedup.py --heads)
DRAFT_PREFIX = "specdec draft γ="
TREE_PREFIX = "specdec tree γ="  # "specdec tree γ=4 n=8": draft rounds of a tree of 8 tokens, 4 deep
HF_PREFIX = "hf "
LLAMA_SERVER_PREFIX = "llama-server "
# the peer families a method of specdec is compared with: family -> its methods' prefix
PEERS = {"hf": HF_PREFIX, "llama-server": LLAMA_SERVER_PREFIX}
_FAMILY_SHORT = {"hf": "HF", "llama-server": "ls"}  # a family's name in the table's column heads


def draft_gamma(method: str) -> int | None:
    return int(method[len(DRAFT_PREFIX):]) if method.startswith(DRAFT_PREFIX) else None


def alpha_mle(stats: dict, gamma: int) -> tuple[float, int, int]:
    """Per-token acceptance α of the draft model's rounds at fixed γ: accepted / (accepted +
    rejections), a rejection being a round that did not accept all γ (the positions after it
    were never tried). Returns (α, accepted, rejections)."""
    accepted = stats["accepted_tokens"] - stats["ngram_accepted_tokens"]
    per_position = stats["accepted_per_position"]
    full = per_position[gamma - 1] if len(per_position) >= gamma else 0
    rejections = max(0, stats["draft_rounds"] - full)
    trials = accepted + rejections
    return (accepted / trials if trials else 0.0), accepted, rejections


def draft_step_seconds(stats: dict) -> float | None:
    """Seconds per token the draft model proposed, its RPCs included."""
    tokens = stats["draft_tokens"] - stats["ngram_draft_tokens"]
    return stats["draft_seconds"] / tokens if tokens else None


def analyse_prompt(runs: dict[str, dict]) -> dict:
    """runs: method -> run record of one prompt. Adds speed-ups in place; returns the summary."""
    base = runs[TARGET_ONLY]["decode_tps"]
    t_step = 1.0 / base  # a target-only step through specdec (RPC and coordinator included)
    reference = runs[TARGET_ONLY]["token_ids"]
    for run in runs.values():
        run["speedup"] = run["decode_tps"] / base
        run["identical"] = run["token_ids"] == reference
        run["common_prefix"] = next((i for i, (a, b) in enumerate(zip(run["token_ids"], reference)) if a != b),
                                    min(len(run["token_ids"]), len(reference)))
    pooled_accepted = pooled_rejections = 0
    pooled_draft_s = pooled_draft_tokens = 0.0
    for method, run in runs.items():
        gamma = draft_gamma(method)
        if gamma is None:
            continue
        stats = run["stats"]
        alpha, accepted, rejections = alpha_mle(stats, gamma)
        step = draft_step_seconds(stats)
        c = step / t_step if step is not None else 0.0
        run.update(alpha=alpha, c=c, bound=leviathan_speedup(alpha, gamma, c))
        run["bound_fraction"] = run["speedup"] / run["bound"]
        pooled_accepted += accepted
        pooled_rejections += rejections
        pooled_draft_s += stats["draft_seconds"]
        pooled_draft_tokens += stats["draft_tokens"] - stats["ngram_draft_tokens"]
    summary: dict[str, Any] = {"target_only_tps": base}
    if pooled_accepted + pooled_rejections:
        alpha = pooled_accepted / (pooled_accepted + pooled_rejections)
        c = (pooled_draft_s / pooled_draft_tokens) / t_step if pooled_draft_tokens else 0.0
        bounds = {g: leviathan_speedup(alpha, g, c) for g in range(0, 17)}
        best_g = max(bounds, key=bounds.get)
        drafts = {m: r for m, r in runs.items() if draft_gamma(m) is not None}
        best_draft = max(drafts, key=lambda m: drafts[m]["decode_tps"])
        summary.update(alpha=alpha, c=c, bound=bounds[best_g], bound_gamma=best_g, best_draft=best_draft,
                       best_draft_speedup=drafts[best_draft]["speedup"],
                       best_draft_bound_fraction=drafts[best_draft]["bound_fraction"])
    if LOOKUP in runs:
        s = runs[LOOKUP]["stats"]
        summary["lookup_alpha"] = (s["ngram_accepted_tokens"] / s["ngram_draft_tokens"]
                                  if s["ngram_draft_tokens"] else 0.0)
    for family, prefix in PEERS.items():
        peers = {m: r for m, r in runs.items() if m.startswith(prefix)}
        if not peers:
            continue
        best = max(peers, key=lambda m: peers[m]["decode_tps"])
        summary.update({f"best_{family}": best, f"best_{family}_tps": peers[best]["decode_tps"]})
        for method in (AUTO, LOOKUP):
            if method in runs:
                summary[f"{method} / best {family}"] = runs[method]["decode_tps"] / peers[best]["decode_tps"]
    if AUTO in runs:
        summary["auto_speedup"] = runs[AUTO]["speedup"]
    return summary


def overall(prompts: list[dict]) -> dict:
    """Medians over the suite (and the worst auto prompt)."""
    def collect(key: str) -> list[float]:
        return [p["summary"][key] for p in prompts if key in p["summary"]]

    out: dict[str, Any] = {}
    ratios = [f"{method} / best {family}" for family in PEERS for method in (AUTO, LOOKUP)]
    for key in ("auto_speedup", *ratios, "best_draft_bound_fraction", "alpha", "c", "lookup_alpha"):
        values = collect(key)
        if values:
            out[f"median {key}"] = statistics.median(values)
    if collect("auto_speedup"):
        out["min auto_speedup"] = min(collect("auto_speedup"))
    for family in PEERS:
        if collect(f"{AUTO} / best {family}"):
            out[f"min {AUTO} / best {family}"] = min(collect(f"{AUTO} / best {family}"))
    methods = sorted({m for p in prompts for m in p["runs"]})
    out["median speedup by method"] = {
        m: statistics.median([p["runs"][m]["speedup"] for p in prompts if m in p["runs"]]) for m in methods}
    out["identical to target-only"] = {
        m: sum(p["runs"][m]["identical"] for p in prompts if m in p["runs"]) for m in methods}
    return out


def table(prompts: list[dict], methods: list[str]) -> str:
    """Per prompt: target-only tok/s, every method's speed-up, auto / the best peer of each
    family that ran, α, c, bound."""
    short = {m: _short(m) for m in methods if m != TARGET_ONLY}
    families = [f for f, prefix in PEERS.items() if any(m.startswith(prefix) for m in methods)]
    head = (f"{'prompt':<22} {'kind':<18} {'tok/s':>6} " + " ".join(f"{s:>8}" for s in short.values())
            + "".join(f" {'auto/' + _FAMILY_SHORT[f]:>7}" for f in families)
            + f" {'α':>5} {'c':>5} {'bound':>9} {'of bnd':>6} {'α_ng':>5}")
    lines = [head]
    for p in prompts:
        s, runs = p["summary"], p["runs"]
        cells = " ".join(f"{runs[m]['speedup']:>7.2f}x" if m in runs else f"{'-':>8}" for m in short)
        bound = f"{s['bound']:.2f}@γ{s['bound_gamma']}" if "bound" in s else "-"
        peers = "".join(f" {s.get(f'{AUTO} / best {f}', float('nan')):>7.2f}" for f in families)
        lines.append(
            f"{p['name']:<22} {p['kind']:<18} {s['target_only_tps']:>6.2f} {cells}{peers} "
            f"{s.get('alpha', float('nan')):>5.2f} "
            f"{s.get('c', float('nan')):>5.2f} {bound:>9} {s.get('best_draft_bound_fraction', float('nan')):>6.2f} "
            f"{s.get('lookup_alpha', float('nan')):>5.2f}")
    lines.append("columns: speed-up of decode tokens/s over specdec target-only; auto/HF, auto/ls = "
                 "specdec auto over the best HF / llama-server method of the prompt; α, c = the draft model's acceptance and cost "
                 "ratio (pooled over its fixed-γ runs); bound = Leviathan's speed-up for that α and c at "
                 "its best γ; of bnd = the best draft run's speed-up over its own bound; α_ng = prompt "
                 "lookup's acceptance")
    lines.append("methods: " + ", ".join(f"{s} = {m}" for m, s in short.items()))
    return "\n".join(lines)


def passes_table(prompts: list[dict], methods: list[str]) -> str:
    """Per prompt, tokens committed per target pass (generated tokens over rounds) of each
    speculating specdec method: what a tree adds over a chain of its depth, pass for pass."""
    ours = [m for m in methods if m.startswith(("specdec ",)) and m != TARGET_ONLY]
    short = {m: _short(m) for m in ours}
    lines = [f"{'tokens per target pass':<22} " + " ".join(f"{s:>8}" for s in short.values())]
    for p in prompts:
        cells = []
        for m in ours:
            stats = p["runs"].get(m, {}).get("stats")
            cells.append(f"{stats['tokens_per_round']:>8.2f}" if stats else f"{'-':>8}")
        lines.append(f"{p['name']:<22} " + " ".join(cells))
    medians = []
    for m in ours:
        values = sorted(p["runs"][m]["stats"]["tokens_per_round"] for p in prompts if "stats" in p["runs"].get(m, {}))
        medians.append(f"{values[len(values) // 2]:>8.2f}" if values else f"{'-':>8}")
    lines.append(f"{'median':<22} " + " ".join(medians))
    return "\n".join(lines)


def _short(method: str) -> str:
    return (method.replace("specdec ", "").replace("prompt lookup", "lookup").replace("assisted", "asst")
            .replace("hf ", "hf:").replace(LLAMA_SERVER_PREFIX, "ls:").replace("draft γ=", "d")
            .replace("tree γ=", "t").replace(" n=", "n"))[:8]


def plot(prompts: list[dict], methods: list[str], path: Path) -> bool:
    """Grouped bars: mean speed-up over target-only per prompt kind, one bar per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = list(dict.fromkeys(p["kind"] for p in prompts))
    shown = [m for m in methods if m != TARGET_ONLY]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(kinds)), 4.5))
    width = 0.8 / len(shown)
    for i, method in enumerate(shown):
        values = []
        for kind in kinds:
            mine = [p["runs"][method]["speedup"] for p in prompts if p["kind"] == kind and method in p["runs"]]
            values.append(sum(mine) / len(mine) if mine else 0.0)
        ax.bar([k + i * width for k in range(len(kinds))], values, width, label=method)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], kinds)
    ax.set_ylabel("decode speed-up over target-only")
    ax.set_title("specdec and its peers, greedy, by prompt kind")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
