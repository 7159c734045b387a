"""Proposal sources: one module per source behind one interface (`base.ProposalSource`): the draft
model (`draft_model.py`, with its call made ahead in `draft_ahead.py`), prompt lookup
(`prompt_lookup.py`, with its n-gram index in `lookup_index.py`), the target's heads (`heads_source.py`)
and none (`none.py`).

Decides: the tokens a planned round proposes and the work alongside its verification.
May import: the shared library, `coordinator.policy`, `coordinator.sessions`, the round's records at
the top (`rounds`, `session_calls`, `tasks`), `sources.base`, and a source its own parts; no
source imports another, and none imports the round loop or the APIs.
"""
