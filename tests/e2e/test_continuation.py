"""Continuing a session after every finish reason, and stop strings in the final flush."""

from __future__ import annotations

import grpc
import pytest
import torch

from specdec_cli import tiny
from specdec.runtime.loader import load_model
from specdec.v1 import common_pb2, coordinator_pb2
from tests.cluster import Cluster

EOS_PROMPT = [9, 9, 1]  # this target's first greedy token here is EOS (id 0)
STOP_PROMPT = [3, 7, 5]  # ... and here "w9"


@pytest.fixture(scope="module")
def word_target(tmp_path_factory):
    """A 12-word target (id 0 is EOS) whose greedy choices the prompts above rely on."""
    path = tiny.build_model(tmp_path_factory.mktemp("words") / "target", tiny.word_tokenizer(12), "llama",
                            seed=21, init_std=0.1)
    return str(path)


def target_only(target_dir: str, history: list[int], new_tokens: int) -> list[int]:
    model = load_model(target_dir, "float64").model
    out = model.generate(torch.tensor([history]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(history):].tolist()


@pytest.mark.parametrize("finish, first_request", [
    ("eos", dict(token_ids=EOS_PROMPT, max_new_tokens=8)),
    ("stop", dict(token_ids=STOP_PROMPT, max_new_tokens=8, stop=["w9"])),
    ("length", dict(token_ids=STOP_PROMPT, max_new_tokens=2)),
])
def test_continue_with_empty_input_after_each_finish_reason(word_target, finish, first_request):
    # the draft is the target itself: every draft is accepted, so the finish lands inside a round
    target = word_target
    with Cluster(target, target) as cluster:
        first = cluster.complete(num_speculative_tokens=4, **first_request)
        assert common_pb2.FinishReason.Name(first.finish_reason) == f"FINISH_REASON_{finish.upper()}"
        if finish != "length":
            assert first.stats.accepted_tokens > len(first.token_ids) - 1  # accepted drafts past the end
        for empty in (dict(prompt=""), dict(token_ids=[])):
            session = cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
            history = list(session.token_ids)
            more = cluster.complete(session_id=first.session_id, max_new_tokens=6, num_speculative_tokens=4,
                                    ignore_eos=True, **empty)
            assert list(more.token_ids) == target_only(target, history, 6)
            assert more.stats.cache_misses == 0


def test_continue_after_context_length_says_start_a_new_session(word_target):
    target = word_target
    with Cluster(target, target) as cluster:
        first = cluster.complete(token_ids=[1, 2, 3] * 166, max_new_tokens=64, ignore_eos=True)
        assert first.finish_reason == common_pb2.FINISH_REASON_CONTEXT_LENGTH
        with pytest.raises(grpc.RpcError) as info:
            cluster.complete(session_id=first.session_id, prompt="", max_new_tokens=4)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "start a new session" in info.value.details()


def test_stop_string_completed_by_the_final_flush_does_not_leak(models):
    """The last token of this generation leaves 'r' plus an incomplete UTF-8 sequence held back
    by the detokenizer; only the flush at the length limit emits them, and they complete the
    stop string "err\ufffd"."""
    paths = models["llama"]
    request = dict(prompt="Emoji: 🚀", max_new_tokens=21, num_speculative_tokens=3, ignore_eos=True)
    with Cluster(paths["draft"], paths["target"]) as cluster:
        plain = cluster.stream(**request)
        text = "".join(c.text for c in plain)
        assert text.endswith("err\ufffd") and "err\ufffd" not in text[:-1]
        assert plain[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        stopped = cluster.stream(stop=["err\ufffd"], **request)
        assert stopped[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert "".join(c.text for c in stopped) == text[:-4]
