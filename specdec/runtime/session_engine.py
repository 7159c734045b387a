"""What every engine shares above its session half: a warm-up through the engine's own forward,
and the host loops for the per-round work (drafting.py, verification.py), which an engine
overrides where it has better (the graph engine's device loops)."""

from __future__ import annotations

from specdec.runtime.drafting import HostDrafting
from specdec.runtime.engine import Drafting, Verification
from specdec.runtime.session_kv import Row, SessionKV
from specdec.runtime.verification import HostVerification

WARM_UP_SESSION = "specdec-warm-up"  # the session warm_up runs and releases
WARM_UP_TOKENS = 8  # tokens of the prompt it prefills


class SessionEngine(SessionKV):
    """What every engine shares: the session half (session_kv.py), a warm-up through the
    engine's own forward, and the host loops for the per-round work."""

    def warm_up(self) -> None:
        """Prefill a short prompt, decode one token after it and roll one back, then forget the
        session: the first real call finds every lazy initialisation done. With heads the decode
        step hands out its hidden state and the heads run once on it. An engine with more to
        prepare (graph capture) does it first and calls this."""
        tokens = [i % max(1, self.embedding_size) for i in range(1, WARM_UP_TOKENS + 1)]
        try:
            entry, feed = self.begin(WARM_UP_SESSION, 0, 0, tokens)
            self.forward(WARM_UP_SESSION, entry, feed, 1)  # prefill
            decode = [Row(WARM_UP_SESSION, entry, tokens[:1], 1)]  # a decode step
            if self.heads is None:
                self.forward_batch(decode)
            else:
                _, [hidden] = self.forward_hidden(decode)  # [1, hidden]
                self.heads.proposals(hidden, [1])
            entry.crop(len(tokens))  # a rollback
        finally:
            self.release(WARM_UP_SESSION)
            self.finish([])

    def drafting(self, proposal_top_k: int) -> Drafting:
        """The draft's γ-step loop as host code over forward_batch (drafting.py)."""
        return HostDrafting(self, proposal_top_k)

    def verification(self) -> Verification:
        """Forward plus the acceptance step row by row (verification.py)."""
        return HostVerification(self)
