"""A target-only round (proposer `none`) and a prompt-lookup round that found nothing send the
services the same calls: no Propose at all, and the same Verify — prefix, fingerprint, new
tokens, no drafts, sampling. So neither mode does work on the model services that the other does
not, and the only difference between their rounds is the coordinator's own lookup."""

from __future__ import annotations

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.spies import RequestRecorder

FIELDS = ("prefix_len", "prefix_hash", "new_tokens", "draft_tokens", "draft_probs", "draft_parents", "sampling",
          "seed", "top_logprobs")


def _calls(recorder: RequestRecorder) -> list[tuple[str, tuple[str, ...]]]:
    """(method, the request's fields as text) of every recorded call, in order."""
    return [(name, tuple(str(getattr(request, field)) for field in FIELDS)) for name, request in recorder.calls]


def test_target_only_and_lookup_that_finds_nothing_send_the_same_calls(models):
    recorder = RequestRecorder("Verify", "Propose")
    prompt = list(range(3, 70))  # no token repeats: lookup matches only where the output repeats
    with Cluster(models["llama"]["draft"], models["llama"]["target"], interceptors=[recorder]) as cluster:
        sent = {}
        for name in ("none", "ngram"):
            recorder.calls.clear()
            response = cluster.complete(token_ids=prompt, max_new_tokens=48, ignore_eos=True, seed=5,
                                        proposer=getattr(coordinator_pb2, f"PROPOSER_{name.upper()}"))
            sent[name] = (list(response.token_ids), _calls(recorder), response.stats)
    (none_tokens, none_calls, none_stats), (lookup_tokens, lookup_calls, lookup_stats) = sent["none"], sent["ngram"]
    assert none_tokens == lookup_tokens
    assert {name for name, _ in none_calls + lookup_calls} == {"Verify"}  # neither mode calls the draft
    assert none_stats.rounds == 48 and len(none_calls) == 48
    # every round sends the one token the target lacks, at the committed length less one: the
    # target-only round at the same length is the one to compare with (the seed aside: an
    # accepted lookup draft skips lengths, and with them rounds of the request's seed sequence)
    at = FIELDS.index("prefix_len")
    none_at = {call[at]: call for _, call in none_calls}
    empty = [call for _, call in lookup_calls if call[FIELDS.index("draft_tokens")] == "[]"]
    assert len(empty) >= 8 and len(empty) < len(lookup_calls)  # both kinds of lookup round happened
    unseeded = [i for i, field in enumerate(FIELDS) if field != "seed"]
    for call in empty:
        assert [call[i] for i in unseeded] == [none_at[call[at]][i] for i in unseeded]
