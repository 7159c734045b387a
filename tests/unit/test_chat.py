"""Chat rendering: a continuation turn renders only the new messages, without the template's
conversation start (Qwen2.5's default system prompt) a second time.

Here the unit tests; the other tiers' are in tests/e2e/test_chat.py.
"""

from __future__ import annotations

import pytest

from coordinator.chat import render_messages
from specdec_cli import tiny
from specdec.errors import InvalidArgument
from tests.qwen_template import QWEN_DEFAULT_SYSTEM, qwen_style_tokenizer

TURN_2 = "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"  # Qwen's mid-conversation format


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return qwen_style_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_first_turn_renders_the_template_as_is(qwen_tokenizer):
    ids = render_messages(qwen_tokenizer, [("user", "Hello there")], continuing=False)
    assert ids == _ids(qwen_tokenizer, f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n"
                                       "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")


def test_continuation_renders_only_the_new_messages(qwen_tokenizer):
    assert render_messages(qwen_tokenizer, [("user", "And now?")], continuing=True) == _ids(qwen_tokenizer, TURN_2)
    # a system message later in a conversation is rendered as one, not as the conversation start
    ids = render_messages(qwen_tokenizer, [("system", "Be brief."), ("user", "And now?")], continuing=True)
    assert ids == _ids(qwen_tokenizer, "<|im_start|>system\nBe brief.<|im_end|>\n" + TURN_2)


def test_continuation_with_a_template_without_default_system_prompt():
    tokenizer = tiny.byte_level_tokenizer()
    messages = [("user", "hi")]
    assert render_messages(tokenizer, messages, continuing=True) == render_messages(tokenizer, messages, False)


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


def test_template_errors_are_invalid_argument():
    tokenizer = tiny.byte_level_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        render_messages(tokenizer, [("user", "hi")], continuing=False)
