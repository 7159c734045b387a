"""Chat rendering: a continuation turn renders only the new messages, without the template's
conversation start (Qwen2.5's default system prompt) a second time.

Here the e2e tests; the other tiers' are in tests/unit/test_chat.py.
"""

from __future__ import annotations

import pytest

from specdec_cli import tiny
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.qwen_template import QWEN_DEFAULT_SYSTEM
from tests.unit.test_chat import TURN_2, qwen_tokenizer, _ids


@pytest.fixture(scope="module")
def qwen_models(tmp_path_factory, qwen_tokenizer):
    root = tmp_path_factory.mktemp("qwen-chat")
    return (str(tiny.build_model(root / "draft", qwen_tokenizer, "llama", seed=31, layers=1)),
            str(tiny.build_model(root / "target", qwen_tokenizer, "llama", seed=32)))


def test_second_turn_of_a_chat_session_has_no_second_system_prompt(qwen_models, qwen_tokenizer):
    with Cluster(*qwen_models) as cluster:
        first = cluster.complete(messages=[("user", "Hello there")], max_new_tokens=5, ignore_eos=True)
        after_first = list(cluster.stub.GetSession(
            coordinator_pb2.GetSessionRequest(session_id=first.session_id)).token_ids)
        second = cluster.complete(session_id=first.session_id, messages=[("user", "And now?")],
                                  max_new_tokens=5, ignore_eos=True)
        committed = list(cluster.stub.GetSession(
            coordinator_pb2.GetSessionRequest(session_id=first.session_id)).token_ids)
    text = qwen_tokenizer.decode(committed, skip_special_tokens=False)
    assert text.count(QWEN_DEFAULT_SYSTEM) == 1, text
    assert text.count("<|im_start|>system") == 1, text
    assert committed[:len(after_first)] == after_first
    turn_2 = committed[len(after_first):len(after_first) + second.stats.prompt_tokens]
    assert turn_2 == _ids(qwen_tokenizer, TURN_2)
    assert len(committed) == len(after_first) + second.stats.prompt_tokens + len(second.token_ids)
