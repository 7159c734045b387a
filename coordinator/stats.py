"""Per-request and per-session counters (vLLM's vocabulary)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from specdec.maths.tree import TokenTree, tree_outcome
from specdec.types import Source

from coordinator.sessions.model_tiers import Tier

PER_REQUEST = frozenset({"gamma_per_round"})  # fields that describe one request, never summed


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    coordinator_seconds: float = 0.0
    draft_prefill_tokens: int = 0
    target_prefill_tokens: int = 0
    draft_restored_tokens: int = 0   # of draft_prefill_tokens, loaded from K/V chunks instead of run
    target_restored_tokens: int = 0  # of target_prefill_tokens, loaded from K/V chunks instead of run
    cache_misses: int = 0
    fallback_rounds: int = 0
    target_retries: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_rounds: int = 0           # rounds the draft model proposed
    ngram_rounds: int = 0           # rounds prompt lookup proposed
    ngram_draft_tokens: int = 0     # of draft_tokens, proposed by prompt lookup
    ngram_accepted_tokens: int = 0  # of accepted_tokens, proposed by prompt lookup
    heads_rounds: int = 0           # rounds the target's heads proposed (their tree, read the round before)
    heads_draft_tokens: int = 0     # of draft_tokens, proposed by the heads (the trees' nodes)
    heads_accepted_tokens: int = 0  # of accepted_tokens, proposed by the heads (the accepted paths' nodes)
    draft_hint_tokens: int = 0      # of a draft round's tokens, prompt-lookup hints the draft kept
    draft_hint_accepted_tokens: int = 0  # of those, accepted by the target
    draft_ahead_calls: int = 0      # Propose calls made ahead, while the round before was verified
    draft_ahead_rounds: int = 0     # draft rounds whose drafts such a call proposed
    tree_rounds: int = 0            # of draft_rounds, those that proposed a token tree
    tree_draft_tokens: int = 0      # of draft_tokens, the nodes of those trees
    tree_accepted_tokens: int = 0   # of accepted_tokens, the accepted paths' nodes of those trees
    tree_branch_accepted_tokens: int = 0  # of those, nodes off the draft's own chain (what a chain lacked)
    tree_accepted_per_depth: list[int] = field(default_factory=list)  # [d] -> tree rounds whose path reached depth d + 1
    tree_lookup_tokens: int = 0     # of tree_draft_tokens, nodes of prompt lookup's branches grafted on
    tree_lookup_accepted_tokens: int = 0  # of tree_accepted_tokens, nodes of those branches
    rounds_by_gamma: list[int] = field(default_factory=list)  # [γ] -> rounds that proposed γ
    gamma_per_round: list[int] = field(default_factory=list)  # this request only (not cumulated)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def tree_tokens_per_round(self) -> float:
        """Tokens a tree round committed per target pass: its accepted path and the target's token."""
        return (self.tree_accepted_tokens + self.tree_rounds) / self.tree_rounds if self.tree_rounds else 0.0

    def add_prefill(self, tier: Tier, tokens: int, restored: int = 0) -> None:
        """`tokens` the tier's replica had to prefill (a request's first call, or a resend), of
        which it loaded `restored` from K/V chunks."""
        if tier == Tier.DRAFT:
            self.draft_prefill_tokens += tokens
            self.draft_restored_tokens += restored
        else:
            self.target_prefill_tokens += tokens
            self.target_restored_tokens += restored

    def record_round(self, gamma: int, accepted: int, source: Source = Source.DRAFT,
                     hints_kept: int = 0, tree: TokenTree | None = None,
                     accepted_nodes: tuple[int, ...] = (), lookup_nodes: int = 0) -> None:
        """One round: γ tokens proposed by `source` (DRAFT, PROMPT_LOOKUP, HEADS; NONE when γ is 0),
        the first `hints_kept` of a draft round being prompt-lookup hints the draft model kept; a
        draft tree round's γ tokens are `tree`'s nodes, of which the target accepted the path
        `accepted_nodes`, and whose last `lookup_nodes` nodes are prompt lookup's branches (the
        tree_* counts are the draft's trees; a heads round counts as heads only)."""
        if tree is not None and gamma and source == Source.DRAFT:
            self._record_tree(tree, accepted_nodes, len(tree) - lookup_nodes)
        self.rounds += 1
        self.draft_tokens += gamma
        self.accepted_tokens += accepted
        if gamma and source == Source.PROMPT_LOOKUP:
            self.ngram_rounds += 1
            self.ngram_draft_tokens += gamma
            self.ngram_accepted_tokens += accepted
        elif gamma and source == Source.HEADS:
            self.heads_rounds += 1
            self.heads_draft_tokens += gamma
            self.heads_accepted_tokens += accepted
        elif gamma:
            self.draft_rounds += 1
            self.draft_hint_tokens += hints_kept
            self.draft_hint_accepted_tokens += min(hints_kept, accepted)
        if len(self.rounds_by_gamma) <= gamma:
            self.rounds_by_gamma += [0] * (gamma + 1 - len(self.rounds_by_gamma))
        self.rounds_by_gamma[gamma] += 1
        self.gamma_per_round.append(gamma)
        _count_up_to(self.accepted_per_position, accepted)

    def _record_tree(self, tree: TokenTree, accepted_nodes: tuple[int, ...], draft_nodes: int) -> None:
        self.tree_rounds += 1
        self.tree_draft_tokens += len(tree)
        self.tree_accepted_tokens += len(accepted_nodes)
        spine_accepted = tree_outcome(tree, accepted_nodes, draft_nodes).spine_accepted
        self.tree_branch_accepted_tokens += len(accepted_nodes) - spine_accepted
        self.tree_lookup_tokens += len(tree) - draft_nodes
        self.tree_lookup_accepted_tokens += sum(node >= draft_nodes for node in accepted_nodes)
        _count_up_to(self.tree_accepted_per_depth, len(accepted_nodes))

    def merged(self, other: "GenerationStats") -> "GenerationStats":
        """Sum of two stats (for a session's cumulative view; the per-round γ list is left out)."""
        out = GenerationStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in PER_REQUEST:
                continue
            if isinstance(a, list):
                n = max(len(a), len(b))
                setattr(out, f.name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)
                                      for i in range(n)])
            else:
                setattr(out, f.name, a + b)
        return out

    def to_dict(self) -> dict:
        data = asdict(self)
        data["acceptance_rate"] = self.acceptance_rate
        data["tokens_per_round"] = self.tokens_per_round
        data["tree_tokens_per_round"] = self.tree_tokens_per_round
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "GenerationStats":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def summary(self) -> str:
        return (f"rounds={self.rounds} generated={self.generated_tokens} drafted={self.draft_tokens} "
                f"accepted={self.accepted_tokens} acceptance={self.acceptance_rate:.3f} "
                f"tokens/round={self.tokens_per_round:.2f} draft_rounds={self.draft_rounds} "
                f"ngram_rounds={self.ngram_rounds} heads_rounds={self.heads_rounds}")


def _count_up_to(counts: list[int], reached: int) -> None:
    """counts[i] += 1 for i < reached (a per-position or per-depth count), growing the list."""
    if len(counts) < reached:
        counts += [0] * (reached - len(counts))
    for i in range(reached):
        counts[i] += 1
