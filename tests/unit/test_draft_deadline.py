"""A slow draft costs a few rounds, never a whole request: a replica's first (cold) Propose has
--draft-cold-deadline-s, and a request whose draft call timed out backs off for 1, 2, 4, ...
rounds, then uses the draft again. The target decides every token: the output never changes.

Here the unit tests; the other tiers' are in tests/e2e/test_draft_deadline.py.
"""

from __future__ import annotations

from coordinator.rounds import DraftBackoff
from coordinator.session_calls import propose_deadline_s
from specdec import errors
from specdec.config import CoordinatorConfig
from specdec.rpc.status import from_rpc_error
from specdec.rpc.streaming import CallStatus


def test_the_cold_deadline_holds_until_the_replica_answered_once():
    config = CoordinatorConfig(draft_timeout_s=2.0, draft_cold_deadline_s=30.0)
    assert propose_deadline_s(False, config) == 30.0
    assert propose_deadline_s(True, config) == 2.0
    assert propose_deadline_s(False, CoordinatorConfig(draft_timeout_s=40.0, draft_cold_deadline_s=30.0)) == 40.0


def test_backoff_doubles_per_timeout_in_a_row_and_an_answer_resets_it():
    backoff = DraftBackoff()
    assert backoff.ready(0)
    assert backoff.timed_out(0) == 1  # round 1 skipped, round 2 tries again
    assert not backoff.ready(1) and backoff.ready(2)
    assert backoff.timed_out(2) == 2  # rounds 3 and 4 skipped
    assert not backoff.ready(4) and backoff.ready(5)
    assert backoff.timed_out(5) == 4
    backoff.answered()
    assert backoff.timed_out(20) == 1 and backoff.ready(22)


def test_a_deadline_is_told_apart_from_an_unreachable_service():
    import grpc

    late = from_rpc_error(CallStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "draft")
    down = from_rpc_error(CallStatus(grpc.StatusCode.UNAVAILABLE, "connection refused"), "draft")
    assert isinstance(late, errors.DeadlineExceeded) and isinstance(late, errors.Unavailable)
    assert isinstance(down, errors.Unavailable) and not isinstance(down, errors.DeadlineExceeded)
