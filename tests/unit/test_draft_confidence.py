"""The draft stops early where it is unsure (`min_confidence`).

Pure proposer on the small-vocabulary draft (float64): greedy, the call stops right after the
first token whose softmax probability under the draft, computed here from the model itself, is
below the threshold, and its tokens are the prefix of the full-γ call; sampled, every token but
the last had q ≥ threshold and the last had q below it (or γ was reached), and the draws keep
their distribution (chi-square of the second token, which only exists when the first was sure);
the cache then holds the call's tokens but the last, as after any call. A bad threshold is
INVALID_ARGUMENT over gRPC. End to end: greedy output equals the target's with early stops
happening, and a fixed γ is never cut.

Here the unit tests; the other tiers' are in tests/service/test_draft_confidence.py and
tests/e2e/test_draft_confidence.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec.config import DraftConfig
from specdec.runtime.loader import load_model
from specdec.runtime.engines import engine_from_config
from specdec.types import SamplingParams
from specdec.runtime.drafting import HostDrafting
from tests.e2e.test_sources import IDS_PROMPTS

GAMMA = 8


def greedy_confidences(model_dir: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """The draft's softmax probability of each of `tokens` (its greedy continuation of
    `prompt`), from one forward of the model outside the service."""
    model = load_model(model_dir, "float64").model
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]  # [len, vocab]
    probs = torch.softmax(logits[len(prompt) - 1:-1], dim=-1)  # [len(tokens), vocab]
    assert probs.argmax(dim=-1).tolist() == tokens  # they are its greedy tokens
    return probs.max(dim=-1).values.tolist()


@pytest.fixture(scope="module")
def draft_proposer(small_vocab_models):
    engine = engine_from_config(DraftConfig(model=small_vocab_models["draft"], dtype="float64"))
    return HostDrafting(engine, 32)


def test_greedy_stops_right_after_the_first_unsure_token(draft_proposer, small_vocab_models):
    greedy = SamplingParams(temperature=0.0)
    stops = set()
    for n, prompt in enumerate(IDS_PROMPTS + [[4, 4, 8, 2], [11, 0, 6]]):
        full = draft_proposer.propose_batch([draft_proposer.call(f"full{n}", 0, 0, prompt, GAMMA, greedy, 0)])[0]
        confidences = greedy_confidences(small_vocab_models["draft"], prompt, full.draft_tokens)
        levels = sorted(set(confidences))
        for threshold in [(a + b) / 2 for a, b in zip(levels, levels[1:])][:3]:  # some fall below, some not
            session = f"cut{n}-{threshold}"
            cut = draft_proposer.propose_batch([draft_proposer.call(session, 0, 0, prompt, GAMMA, greedy, 0,
                                                  min_confidence=threshold)])[0]
            first_unsure = next(i for i, c in enumerate(confidences) if c < threshold)
            assert cut.draft_tokens == full.draft_tokens[:first_unsure + 1]
            assert cut.cached_len == len(prompt) + len(cut.draft_tokens) - 1
            stops.add(len(cut.draft_tokens))
            draft_proposer.release(session)
        draft_proposer.release(f"full{n}")
    assert len(stops) > 1  # the stop moved with the threshold


def test_calls_in_one_batch_stop_each_on_their_own(draft_proposer):
    """A batch of calls: one stops at its first token, the others run their γ."""
    greedy = SamplingParams(temperature=0.0)
    calls = [draft_proposer.call("sure", 0, 0, IDS_PROMPTS[0], 5, greedy, 0),
             draft_proposer.call("unsure", 0, 0, IDS_PROMPTS[0], 5, greedy, 0, min_confidence=0.999999),
             draft_proposer.call("other", 0, 0, IDS_PROMPTS[1], 3, greedy, 0)]
    sure, unsure, other = draft_proposer.propose_batch(calls)
    assert len(sure.draft_tokens) == 5 and len(other.draft_tokens) == 3
    assert unsure.draft_tokens == sure.draft_tokens[:1] and unsure.cached_len == len(IDS_PROMPTS[0])
    for name in ("sure", "unsure", "other"):
        draft_proposer.release(name)
