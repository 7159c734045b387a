"""Chat messages -> token ids with the tokenizer's chat template.

A first turn renders the messages as the template does, generation prompt included. A
continuation turn (the session already holds a conversation) must not render the template's
conversation start again: Qwen's template, for one, inserts its default system prompt
whenever the first message is not a system message. So a continuation renders
[sentinel system message] + new messages and cuts off the sentinel's own rendering, which
leaves the new messages in the template's mid-conversation format.
"""

from __future__ import annotations

from typing import Any, Sequence

from specdec.errors import InvalidArgument
from specdec.fields import Field

SENTINEL = "specdec-continuation-sentinel-7d1c"
# the roles a message may have: OpenAI's that chat templates render ("developer" and "function"
# are not among them: Qwen's template, for one, drops such messages without a word)
CHAT_ROLES = ("system", "user", "assistant", "tool")


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # the template's own error (jinja raise_exception, bad role, ...)
        raise InvalidArgument(f"the chat template cannot render these messages: {exc}", Field.MESSAGES) from exc


def _continuation_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The new messages as they appear after earlier turns: rendered behind a sentinel system
    message whose own rendering is then cut off."""
    sentinel = [{"role": "system", "content": SENTINEL}]
    try:
        head = tokenizer.apply_chat_template(sentinel, tokenize=False, add_generation_prompt=False)
        whole = tokenizer.apply_chat_template(sentinel + messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise InvalidArgument(
            "this model's chat template cannot render a continuation turn on its own "
            f"({exc}); send the new turn as a prompt or token_ids, or start a new session "
            "with the whole conversation", Field.MESSAGES) from exc
    if SENTINEL not in head or not whole.startswith(head):
        raise InvalidArgument(
            "this model's chat template renders a conversation's later turns differently from its "
            "start, so a continuation turn cannot be rendered on its own; send the new turn as a "
            "prompt or token_ids, or start a new session with the whole conversation", Field.MESSAGES)
    return whole[len(head):]


def render_messages(tokenizer: Any, messages: Sequence[tuple[str, str]], continuing: bool) -> list[int]:
    """Token ids of chat messages (role, content), ending in the assistant's generation prompt.

    continuing: the session already holds earlier turns; render only what follows them."""
    if not messages:
        raise InvalidArgument("messages is empty: give at least one chat message", Field.MESSAGES)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("this model's tokenizer has no chat template: send a prompt instead", Field.MESSAGES)
    for role, _ in messages:
        if role not in CHAT_ROLES:
            problem = f"unknown chat role {role!r}" if role else "a chat message without a role"
            raise InvalidArgument(f"{problem}: a message's role is one of {', '.join(CHAT_ROLES)}", Field.MESSAGES)
    dicts = [{"role": role, "content": content} for role, content in messages]
    text = _continuation_text(tokenizer, dicts) if continuing else _render(tokenizer, dicts, True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
