"""How long the coordinator waits for a call to a model service.

A call's deadline follows its work. `--rpc-timeout-s` is the deadline of a call of ordinary
size: one forward of up to ORDINARY_CALL_TOKENS input tokens (a round, or one chunk of a long
prefill at the services' default --prefill-chunk). A call with more input — a long prompt's
prefill, a session restored after a restart — gets that deadline once per ORDINARY_CALL_TOKENS
tokens, or SAFETY times what the replica's own measured pace says its tokens take, whichever is
longer: a slow replica is given the time its work needs, never abandoned for being long.

What catches a replica that stopped answering is not that ceiling but a liveness limit that a
long call does not block: on a call stream the service reports progress after each chunk and
sends a heartbeat while the call runs, and a call that hears neither its answer nor a progress
message for `--rpc-timeout-s` is given up (specdec/rpc/streaming.py); the deadline itself
counts again from each chunk the call finished. A replica whose call timed out is then health-checked, and counted
failed only when it does not answer (coordinator/session_calls.py).
"""

from __future__ import annotations

ORDINARY_CALL_TOKENS = 512  # input tokens of a call of ordinary size (the default --prefill-chunk)
SAFETY = 3.0  # a call's deadline is at least this many times what its tokens take at the measured pace
PACE_MIN_TOKENS = 64  # calls with fewer input tokens say more about fixed costs than about pace
PREFILL_TOKENS = 16  # a call with more new tokens than this is described as a prefill


def call_deadline_s(tokens: int, seconds_per_token: float | None, ordinary_s: float) -> float:
    """The deadline of a call with `tokens` input tokens to a replica that processes a token in
    `seconds_per_token` (None: not measured yet), `ordinary_s` being --rpc-timeout-s."""
    floor = ordinary_s * max(1.0, tokens / ORDINARY_CALL_TOKENS)
    measured = SAFETY * tokens * seconds_per_token if seconds_per_token else 0.0
    return max(floor, measured)


def describe_work(method: str, new_tokens: int, drafts: int = 0) -> str:
    """What a call was doing, as its timeout error says it: "Verify: prefill of 3,975 tokens"."""
    if new_tokens > PREFILL_TOKENS:
        work = f"prefill of {new_tokens:,} tokens" + (f" and {drafts} drafts" if drafts else "")
    else:
        work = f"a round of {new_tokens} new token{'s' * (new_tokens != 1)} and {drafts} draft{'s' * (drafts != 1)}"
    return f"{method}: {work}"


class Pace:
    """A replica's measured seconds per input token, from its calls with at least PACE_MIN_TOKENS
    tokens (time waiting in its queue included). It follows a slower call at once and a faster
    one slowly, so a replica that got loaded is given more time at its next call. A call that ran
    out of time says the replica is slower than one ordinary call's tokens in that time: the
    retry is given the time that pace needs."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None

    def record(self, tokens: int, seconds: float) -> None:
        if tokens < PACE_MIN_TOKENS or seconds <= 0:
            return
        sample = seconds / tokens
        current = self.seconds_per_token
        self.seconds_per_token = sample if current is None or sample > current else 0.8 * current + 0.2 * sample

    def overran(self, seconds: float) -> None:
        """A call ran `seconds` without finishing (at most ORDINARY_CALL_TOKENS of its tokens
        did in that time, or it would have reported them and been given more)."""
        floor = seconds / ORDINARY_CALL_TOKENS
        if self.seconds_per_token is None or self.seconds_per_token < floor:
            self.seconds_per_token = floor
