"""What switching source costs auto, spread over the tokens a request has left: the draft
catching up on history it lacks (a new session's prompt, the tokens of rounds it did not propose),
and the plain round that reads the target's heads before they can propose. Without services:
the pure formula, the cost model's catch-up fit, the planner's choices under pinned costs, and
one round loop through real services that learns the catch-up's cost."""

from __future__ import annotations

import pytest

from coordinator.policy.estimates import CostModel, spread_speedup
from coordinator.sessions.model_tiers import Tier
from coordinator.sessions.session_store import SessionRecord
from coordinator.sources.draft_model import catch_up_tokens
from coordinator.policy.heads_estimates import HeadsAtHand
from coordinator.policy.session_policy import HEADS_NEXT, Horizon
from coordinator.policy.speculation import Offers, Speculation
from specdec.types import Source
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.test_heads_policy import STEP_S, VERIFY_S, pinned_policy

PER_TOKEN_S = 0.002  # the draft prefilling one history token: 300 tokens cost 6 plain steps
HEADS = [0.7, 0.4, 0.3]  # heads a little behind a draft of α 0.8 under flat verification (2.38 against 2.47)
TYPICAL = HeadsAtHand(depth=3, max_nodes=8, width=4)


def with_catch_up(policy, per_token: float = PER_TOKEN_S):
    """The policy's costs with a measured catch-up of `per_token` seconds per history token."""
    for tokens in (50, 150, 300, 600):
        policy.costs.observe_catch_up(tokens, 4, STEP_S * 4 + per_token * tokens)
    return policy


@pytest.mark.unit
def test_a_switching_cost_is_spread_over_the_tokens_left():
    assert spread_speedup(2.0, 0.0, 64) == 2.0 and spread_speedup(2.0, 5.0, 0) == 2.0  # free, or no horizon
    # 64 tokens at 2 a step take 32 steps; 8 steps first make it 40: 1.6
    assert spread_speedup(2.0, 8.0, 64) == pytest.approx(64 / 40)
    rates = [spread_speedup(2.0, 8.0, tokens) for tokens in (16, 64, 256, 4096)]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(2.0, rel=0.01)  # a long answer pays it off
    # a plain round (1 token, 1 step) before rounds at S: the switching cost is 1 − 1/S
    assert spread_speedup(3.0, 1 - 1 / 3.0, 10) == pytest.approx(10 / (1 + 9 / 3.0))


@pytest.mark.unit
def test_a_draft_round_catches_up_on_what_the_draft_lacks_beyond_a_plain_rounds_tokens():
    record = SessionRecord("s", list(range(40)))
    assert catch_up_tokens(record, 40) == 40  # a new session: the whole prompt
    for held, lacking in ((39, 0), (38, 0), (37, 3), (10, 30)):  # a plain round sends one or two
        record.hold(Tier.DRAFT, held)
        assert catch_up_tokens(record, 40) == lacking


@pytest.mark.unit
def test_the_catch_up_is_learnt_beyond_the_draft_steps_and_priced_in_plain_steps():
    costs = CostModel(decay=1.0)
    costs.observe_catch_up(300, 4, 0.7)  # the draft's steps unmeasured: the catch-up cannot be told apart
    assert costs.catch_up.w == 0 and costs.relative_catch_up(300) == 0.0
    for n in range(1, 6):
        costs.observe_verify(n, VERIFY_S)
        costs.observe_propose(Source.DRAFT, n, STEP_S * n)
    assert costs.relative_catch_up(300) == 0.0  # unmeasured: free, as before the fit
    for tokens in (100, 300):
        costs.observe_catch_up(tokens, 4, STEP_S * 4 + PER_TOKEN_S * tokens)
    assert costs.relative_catch_up(300) == pytest.approx(300 * PER_TOKEN_S / VERIFY_S)
    assert costs.relative_catch_up(0) == 0.0
    other = costs.for_another_draft()  # another draft model prefills at its own rate
    assert other.catch_up.w == 0 and costs.catch_up.w == 2


@pytest.mark.parametrize("tokens_left, lag, expected", [
    (32, 300, Source.NONE),     # a short answer: the heads, one plain round away, beat catching up
    (4096, 300, Source.DRAFT),  # a long one pays the catch-up off
    (32, 0, Source.DRAFT),      # a draft that holds the history: as before
], ids=["short-answer", "long-answer", "no-lag"])
@pytest.mark.unit
def test_auto_weighs_the_drafts_catch_up_against_reading_the_heads(tokens_left, lag, expected):
    policy = with_catch_up(pinned_policy(HEADS, draft_alpha=0.8, heads_b=0.2))
    choice = policy.choose(max_gamma=8, heads=None, horizon=Horizon(tokens_left, lag, TYPICAL))
    assert choice.source == expected
    if expected == Source.NONE:
        assert choice.reason == HEADS_NEXT and choice.speedup > 1.0
        assert policy.wants_heads(Source.AUTO)  # its Verify reads them for the next round
        at_hand = policy.choose(max_gamma=8, heads=TYPICAL, horizon=Horizon(tokens_left - 1, lag + 1))
        assert at_hand.source == Source.HEADS  # and the next round takes them, not the lagging draft


@pytest.mark.unit
def test_a_short_answer_left_is_not_worth_any_catch_up():
    """Without heads the choice is the draft or plain decoding: a lagging draft with few tokens left
    decodes plainly, with many it catches up; an unmeasured catch-up prices as before."""
    policy = with_catch_up(pinned_policy(None, draft_alpha=0.8))
    assert policy.choose(max_gamma=3, horizon=Horizon(4, 600)).source == Source.NONE
    assert policy.choose(max_gamma=8, horizon=Horizon(2000, 600)).source == Source.DRAFT
    assert pinned_policy(None, draft_alpha=0.8).choose(max_gamma=3, horizon=Horizon(4, 600)).source == Source.DRAFT


@pytest.mark.unit
def test_heads_next_needs_a_round_after_this_one_and_heads_that_beat_plain_decoding():
    policy = with_catch_up(pinned_policy(HEADS, draft_alpha=None))
    assert policy.choose(max_gamma=8, draft_available=False, horizon=Horizon(1, 0, TYPICAL)).reason != HEADS_NEXT
    poor = with_catch_up(pinned_policy([0.01, 0.01, 0.01], 0.05, draft_alpha=None))
    assert poor.choose(max_gamma=8, horizon=Horizon(64, 300, TYPICAL)).reason != HEADS_NEXT


@pytest.mark.unit
def test_only_adaptive_requests_weigh_switching():
    """A request that names its source (or γ) gets it: the horizon is auto's."""
    spec = Speculation(8, 4, cost_ratio=0.0)
    lagging = Offers(draft_lag=600)  # 4 tokens left (below)
    for name, mode, gamma in (("d", Source.DRAFT, None), ("g", Source.AUTO, 4)):
        request = spec.start(name, mode, gamma)
        request.policy.seed(Source.DRAFT, 0.8, 10_000)
        with_catch_up(_measured(request.policy))
        assert request.plan(lagging, 3, tokens_left=4).source == Source.DRAFT
    auto = spec.start("a", Source.AUTO, None)
    auto.policy.seed(Source.DRAFT, 0.8, 10_000)
    with_catch_up(_measured(auto.policy))
    assert auto.plan(lagging, 3, tokens_left=4).source == Source.NONE


def _measured(policy):
    for n in range(1, 10):
        policy.costs.observe_verify(n, VERIFY_S)
        policy.costs.observe_propose(Source.DRAFT, n, STEP_S * n)
    return policy


@pytest.mark.e2e
def test_the_round_loop_learns_the_catch_up_from_the_drafts_calls(models):
    """A request that calls the draft on a new session's prompt measures the catch-up (once the
    draft's steps are measured); the draft then holds the history, and its rounds are plain."""
    request = dict(max_new_tokens=12, ignore_eos=True, proposer=coordinator_pb2.PROPOSER_DRAFT,
                   num_speculative_tokens=3)
    with Cluster(models["llama"]["draft"], models["llama"]["target"]) as cluster:
        loop = cluster.coordinator.round_loop
        costs = loop.speculation.estimates(loop.speculation.draft_model).costs
        cluster.complete(prompt="def fibonacci(n):", **request)  # its first call is unmeasured: no step fit yet
        assert costs.propose[Source.DRAFT].w > 0 and costs.catch_up.w == 0
        response = cluster.complete(prompt="class Stack:\n    def __init__(self):\n        self.items = []\n", **request)
        assert costs.catch_up.w == 1 and costs.catch_up.sx >= len("class Stack:")  # byte-level: a token a byte
        assert costs.relative_catch_up(100) > 0 and response.stats.draft_rounds > 1


@pytest.mark.unit
def test_a_probe_of_a_draft_that_would_catch_up_waits_for_a_round_where_it_holds_the_history():
    """Heads that win under auto: the draft's probe comes due, but while the draft lacks history a
    probe would pay the catch-up whatever it finds; it waits, then probes once the draft is level."""
    policy = with_catch_up(pinned_policy([0.9, 0.8, 0.7], draft_alpha=0.5, heads_b=0.2))
    lagging = Horizon(64, 300)
    for _ in range(policy.config.probe_interval + 2):
        choice = policy.choose(max_gamma=8, heads=TYPICAL, horizon=lagging)
        assert (choice.source, choice.reason) == (Source.HEADS, "best")
    assert policy.sources[Source.DRAFT].clock.idle > policy.sources[Source.DRAFT].clock.interval  # it is due
    unmeasured = pinned_policy([0.9, 0.8, 0.7], draft_alpha=0.5, heads_b=0.2)  # a catch-up not measured: free
    for _ in range(unmeasured.config.probe_interval):
        unmeasured.choose(max_gamma=8, heads=TYPICAL, horizon=lagging)
    assert unmeasured.choose(max_gamma=8, heads=TYPICAL, horizon=lagging).reason == "probe"
    probe = policy.choose(max_gamma=8, heads=TYPICAL, horizon=Horizon(64, 0))
    assert (probe.source, probe.reason) == (Source.DRAFT, "probe")
