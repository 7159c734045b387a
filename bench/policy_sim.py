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
the lookup rounds of --rounds; writes policy_sim.json under bench/results/.
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
from specdec.types import Proposer  # noqa: E402

ORDER = ("copy", "copy", "copy", "new", "new", "copy", "new")  # the sessions of one coordinator


def sloped_costs() -> CostModel:
    """A CPU-like target: verification 240 ms + 15 ms per extra token, a draft step 80 ms."""
    costs = CostModel(decay=1.0)
    for n in range(1, 10):
        costs.observe_verify(n, 0.24 + 0.015 * (n - 1))
        costs.observe_propose(Proposer.DRAFT, n, 0.08 * n)
        costs.observe_propose(Proposer.PROMPT_LOOKUP, n, 0.0001)
    return costs


def run_session(spec: Speculation, name: str, lookup_alpha, draft_alpha: float, rounds: int,
                rng: random.Random) -> tuple[float, int]:
    """(tokens per plain-decode step of cost, lookup rounds) of one simulated session."""
    request = spec.start(name, Proposer.AUTO, None)
    tokens = cost = 0.0
    lookups = 0
    for _ in range(rounds):
        order = rng.choice((1, 2, 3))
        choice = request.policy.choose(max_gamma=8, lookup_available=8, lookup_order=order)
        request._order = order if choice.source == Proposer.PROMPT_LOOKUP else 0
        alpha = lookup_alpha(order) if choice.source == Proposer.PROMPT_LOOKUP else draft_alpha
        accepted = 0
        while accepted < choice.gamma and rng.random() < alpha:
            accepted += 1
        lookups += choice.source == Proposer.PROMPT_LOOKUP
        tokens += accepted + 1
        cost += 1.0 if choice.gamma == 0 else spec.costs.relative_cost(choice.source, choice.gamma)
        request.observe(choice.source, choice.gamma, accepted, propose_seconds=None, verify_seconds=None,
                        verified_tokens=choice.gamma + 1)
    return tokens / cost, lookups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=60, help="rounds per session")
    parser.add_argument("--draft-alpha", type=float, default=0.8)
    parser.add_argument("--copy-alpha", type=float, default=0.95, help="lookup's α in copying sessions")
    parser.add_argument("--new-alpha", default="0.15,0.25", help="lookup's α in new-text sessions (in turn)")
    parser.add_argument("--cost-ratio", type=float, default=0.35, help="the flat model's pinned c")
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_sim.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {out / 'policy_sim.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
