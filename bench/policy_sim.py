"""The adaptive policy on simulated sessions: how it splits rounds between the draft and prompt
lookup when copying sessions and sessions of new text share one coordinator.

Usage:
  python bench/policy_sim.py [--seeds 100] [--rounds 60] [--draft-alpha 0.8] [--copy-alpha 0.95]
                             [--new-alpha 0.15,0.25] [--cost-ratio 0.35]

No model runs: each round the policy (coordinator/policy/speculation.py, as the coordinator uses it)
chooses a source and γ, and the simulation accepts each proposed token with that source's α
until the first rejection. Prompt lookup matches a suffix of 1, 2 or 3 tokens at random; in a
copying session its α grows with the match length (α·(0.6 + 0.2·n)), in new text it is flat.
Per seed, one coordinator runs the sessions in the order copy, copy, copy, new, new, copy, new
(the --new-alpha values take turns), so new-text sessions start from priors learnt on copying
ones. Two cost models: `flat` (a pinned cost ratio, verification flat: Leviathan's) and
`slope` (a CPU-like verify curve, 15 ms per token over a 240 ms pass, a draft step of 80 ms).
Prints, per kind of session, the tokens committed per unit of cost (in plain-decode steps) and
the lookup rounds of --rounds.

A second table asks what a draft that does not pay costs `auto` (issue 32's "an independent
draft under auto ≥ 0.95× target-only"): per pinned cost ratio (--useless-costs) and draft α
(--useless-alphas), one coordinator serves --useless-sessions sessions of --useless-tokens
tokens each with no prompt lookup; it prints the first session's tokens per unit of cost
(target-only is 1.0; the first session pays the draft's warm-up) and the later sessions' (they
start from the coordinator-wide α and share its probe clock), and the draft rounds each made.
Writes policy_sim.json under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.policy.estimates import CostModel  # noqa: E402
from coordinator.policy.speculation import FixedCosts, Speculation  # noqa: E402
from specdec.types import Source  # noqa: E402

ORDER = ("copy", "copy", "copy", "new", "new", "copy", "new")  # the sessions of one coordinator


def sloped_costs() -> CostModel:
    """A CPU-like target: verification 240 ms + 15 ms per extra token, a draft step 80 ms."""
    costs = CostModel(decay=1.0)
    for n in range(1, 10):
        costs.observe_verify(n, 0.24 + 0.015 * (n - 1))
        costs.observe_propose(Source.DRAFT, n, 0.08 * n)
        costs.observe_propose(Source.PROMPT_LOOKUP, n, 0.0001)
    return costs


def run_session(spec: Speculation, name: str, lookup_alpha, draft_alpha: float, rounds: int,
                rng: random.Random) -> tuple[float, int]:
    """(tokens per plain-decode step of cost, lookup rounds) of one simulated session."""
    request = spec.start(name, Source.AUTO, None)
    tokens = cost = 0.0
    lookups = 0
    for _ in range(rounds):
        order = rng.choice((1, 2, 3))
        choice = request.policy.choose(max_gamma=8, lookup_available=8, lookup_order=order)
        request._order = order if choice.source == Source.PROMPT_LOOKUP else 0
        alpha = lookup_alpha(order) if choice.source == Source.PROMPT_LOOKUP else draft_alpha
        lookups += choice.source == Source.PROMPT_LOOKUP
        committed, spent = play_round(spec, request, choice, alpha, rng)
        tokens += committed
        cost += spent
    return tokens / cost, lookups


def play_round(spec: Speculation, request, choice, alpha: float, rng: random.Random) -> tuple[int, float]:
    """One chosen round: each proposed token accepted with probability α until the first
    rejection, the outcome fed to the request's policy -> (tokens committed, cost in
    plain-decode steps)."""
    accepted = 0
    while accepted < choice.gamma and rng.random() < alpha:
        accepted += 1
    cost = 1.0 if choice.gamma == 0 else spec.costs.relative_cost(choice.source, choice.gamma)
    request.observe(choice.source, choice.gamma, accepted, propose_seconds=None, verify_seconds=None,
                    verified_tokens=choice.gamma + 1)
    return accepted + 1, cost


def draft_only_session(spec: Speculation, name: str, alpha: float, tokens_wanted: int,
                       rng: random.Random) -> tuple[float, int]:
    """(tokens per plain-decode step of cost, draft rounds) of one session that has the draft
    only (no lookup), run until it commits `tokens_wanted` tokens."""
    request = spec.start(name, Source.AUTO, None)
    tokens = cost = 0.0
    drafted = 0
    while tokens < tokens_wanted:
        choice = request.policy.choose(max_gamma=8, lookup_available=0, lookup_order=0)
        committed, spent = play_round(spec, request, choice, alpha, rng)
        tokens += committed
        cost += spent
        drafted += choice.gamma > 0
    return tokens / cost, drafted


def useless_draft(args: argparse.Namespace) -> list[dict]:
    """The second table (module docstring): per cost ratio and draft α, the first and the later
    sessions' tokens per unit of cost and draft rounds, means over the seeds."""
    rows = []
    for ratio in (float(c) for c in args.useless_costs.split(",")):
        for alpha in (float(a) for a in args.useless_alphas.split(",")):
            first: list[tuple[float, int]] = []
            later: list[tuple[float, int]] = []
            for seed in range(args.seeds):
                rng = random.Random(seed)
                spec = Speculation(8, 4)
                spec.costs = FixedCosts(ratio)
                for i in range(args.useless_sessions):
                    (later if i else first).append(
                        draft_only_session(spec, f"s{i}", alpha, args.useless_tokens, rng))
            rows.append({"cost_ratio": ratio, "draft_alpha": alpha,
                         "first_tokens_per_cost": statistics.mean(r for r, _ in first),
                         "first_draft_rounds": statistics.mean(d for _, d in first),
                         "later_tokens_per_cost": statistics.mean(r for r, _ in later) if later else None,
                         "later_draft_rounds": statistics.mean(d for _, d in later) if later else None})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=60, help="rounds per session")
    parser.add_argument("--draft-alpha", type=float, default=0.8)
    parser.add_argument("--copy-alpha", type=float, default=0.95, help="lookup's α in copying sessions")
    parser.add_argument("--new-alpha", default="0.15,0.25", help="lookup's α in new-text sessions (in turn)")
    parser.add_argument("--cost-ratio", type=float, default=0.35, help="the flat model's pinned c")
    parser.add_argument("--useless-costs", default="0.05,0.36,0.55",
                        help="second table: pinned cost ratios c of the draft")
    parser.add_argument("--useless-alphas", default="0,0.1,0.3", help="second table: the draft's α")
    parser.add_argument("--useless-sessions", type=int, default=10, help="second table: sessions per coordinator")
    parser.add_argument("--useless-tokens", type=int, default=128, help="second table: tokens per session")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    new_alphas = [float(a) for a in args.new_alpha.split(",")]
    results = {}
    for model in ("flat", "slope"):
        by_kind: dict[str, list[tuple[float, int]]] = {"copy": [], "new": []}
        for seed in range(args.seeds):
            rng = random.Random(seed)
            spec = Speculation(8, 4)
            spec.costs = FixedCosts(args.cost_ratio) if model == "flat" else sloped_costs()
            new_turn = 0
            for i, kind in enumerate(ORDER):
                if kind == "copy":
                    alpha = lambda n: args.copy_alpha * (0.6 + 0.2 * n)  # noqa: E731
                else:
                    flat = new_alphas[new_turn % len(new_alphas)]
                    new_turn += 1
                    alpha = lambda n, flat=flat: flat  # noqa: E731
                by_kind[kind].append(run_session(spec, f"{kind}-{i}", alpha, args.draft_alpha, args.rounds, rng))
        results[model] = {kind: {"tokens_per_cost": statistics.mean(r for r, _ in runs),
                                 "lookup_rounds": statistics.mean(n for _, n in runs)}
                          for kind, runs in by_kind.items()}
    print(f"{'cost model':10s} {'session':8s} {'tokens/cost':>12s} {'lookup rounds':>14s}")
    for model, kinds in results.items():
        for kind, row in kinds.items():
            print(f"{model:10s} {kind:8s} {row['tokens_per_cost']:12.3f} {row['lookup_rounds']:14.1f}")
    useless = useless_draft(args)
    print(f"\ndraft only, {args.useless_sessions} sessions of {args.useless_tokens} tokens per coordinator "
          "(tokens per plain-decode step of cost: target-only is 1.000)")
    print(f"{'c':>5s} {'draft α':>8s} {'first session':>14s} {'draft rounds':>13s} {'later sessions':>15s} "
          f"{'draft rounds':>13s}")
    for row in useless:
        later = (f"{row['later_tokens_per_cost']:15.3f} {row['later_draft_rounds']:13.1f}"
                 if row["later_tokens_per_cost"] is not None else f"{'-':>15s} {'-':>13s}")
        print(f"{row['cost_ratio']:5.2f} {row['draft_alpha']:8.2f} {row['first_tokens_per_cost']:14.3f} "
              f"{row['first_draft_rounds']:13.1f} {later}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_sim.json").write_text(json.dumps({"args": vars(args), "results": results,
                                                     "useless_draft": useless}, indent=2))
    print(f"wrote {out / 'policy_sim.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
