"""Chat rendering: a continuation turn renders only the new messages, without the template's
conversation start (Qwen2.5's default system prompt) a second time."""

from __future__ import annotations

import pytest

from coordinator.chat import render_messages
from specdec_cli import tiny
from specdec.errors import InvalidArgument
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.qwen_template import QWEN_DEFAULT_SYSTEM, qwen_style_tokenizer

TURN_2 = "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"  # Qwen's mid-conversation format


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return qwen_style_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.unit
def test_first_turn_renders_the_template_as_is(qwen_tokenizer):
    ids = render_messages(qwen_tokenizer, [("user", "Hello there")], continuing=False)
    assert ids == _ids(qwen_tokenizer, f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
                                       "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.unit
def test_continuation_renders_only_the_new_messages(qwen_tokenizer):
    assert render_messages(qwen_tokenizer, [("user", "And now?")], continuing=True) == _ids(qwen_tokenizer, TURN_2)
    # a system message later in a conversation is rendered as one, not as the conversation start
    ids = render_messages(qwen_tokenizer, [("system", "Be brief."), ("user", "And now?")], continuing=True)
    assert ids == _ids(qwen_tokenizer, "<|im_start|>system\nBe brief.<|im_end|>\n" + TURN_2)


@pytest.mark.unit
def test_continuation_with_a_template_without_default_system_prompt():
    tokenizer = tiny.byte_level_tokenizer()
    messages = [("user", "hi")]
    assert render_messages(tokenizer, messages, continuing=True) == render_messages(tokenizer, messages, False)


@pytest.mark.unit
@pytest.mark.parametrize("template, says", [
    # the conversation start depends on the number of messages: the sentinel is no prefix
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}", "renders a conversation's"),
    # the template refuses a system message
    ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
     "{% endif %}{{ m['content'] }}{% endfor %}", "System role not supported"),
])
def test_continuation_that_the_template_cannot_split_is_invalid_argument(template, says):
    tokenizer = tiny.byte_level_tokenizer()
    tokenizer.chat_template = template
    with pytest.raises(InvalidArgument) as info:
        render_messages(tokenizer, [("user", "hi")], continuing=True)
    assert says in str(info.value) and "start a new session" in str(info.value)


@pytest.mark.unit
def test_template_errors_are_invalid_argument():
    tokenizer = tiny.byte_level_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        render_messages(tokenizer, [("user", "hi")], continuing=False)


@pytest.fixture(scope="module")
def qwen_models(tmp_path_factory, qwen_tokenizer):
    root = tmp_path_factory.mktemp("qwen-chat")
    return (str(tiny.build_model(root / "draft", qwen_tokenizer, "llama", seed=31, layers=1)),
            str(tiny.build_model(root / "target", qwen_tokenizer, "llama", seed=32)))


@pytest.mark.e2e
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
