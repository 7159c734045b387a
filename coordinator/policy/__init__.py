"""What each round does: the planner (`speculation.py`: which source, how many tokens, a chain or
a tree), the per-session policy and its estimates (`session_policy.py`, `estimates.py`, the
target's heads' in `heads_estimates.py`), whether
adaptive requests speculate under load (`load_governor.py`) and whether draft rounds draft ahead
(`draft_ahead_trial.py`).

Decides: from numbers (acceptance, timings, what prompt lookup found), never by calling anything.
May import: the shared library and its own modules only (no I/O, no sessions, no sources).
"""
