"""Log-probabilities of emitted tokens (specdec/maths/logprobs.py): the pure function on hand-built
logits, and end to end through the gRPC API against the target model run alone.

Here the unit tests; the other tiers' are in tests/e2e/test_logprobs.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec.maths.logprobs import token_logprobs


def test_token_logprobs_on_hand_built_logits():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 3.0, 0.0]])  # [2, vocab 4]
    out = token_logprobs(logits, [2, 0], top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert [entry.token_id for entry in out] == [2, 0]
    assert out[0].logprob == pytest.approx(expected[0, 2].item())
    assert out[1].logprob == pytest.approx(expected[1, 0].item())
    assert [token for token, _ in out[0].top] == [0, 2]  # most likely first
    assert [token for token, _ in out[1].top][0] == 2
    assert out[0].top[0][1] == pytest.approx(expected[0, 0].item())
    # 0 alternatives: the emitted token's log-probability only; more than the vocabulary: all of it
    assert [entry.top for entry in token_logprobs(logits, [1, 1], top=0)] == [(), ()]
    assert len(token_logprobs(logits, [1, 1], top=9)[0].top) == 4
    # half precision logits are computed in float32
    half = token_logprobs(logits.to(torch.bfloat16), [2, 0], top=1)
    assert half[0].logprob == pytest.approx(expected[0, 2].item(), abs=2e-2)


def test_tokens_are_named_by_their_own_bytes():
    from coordinator.api.openai_protocol import TokenText
    from specdec_cli import tiny

    tokenizer = tiny.byte_level_tokenizer()
    name = TokenText(tokenizer)
    ids = tokenizer("é 🚀 hello")["input_ids"]
    named = [name.named(token) for token in ids]
    assert b"".join(raw for _, raw in named).decode() == "é 🚀 hello"  # the bytes add up to the text
    for text, raw in named:  # whole characters by their text, pieces of one by their bytes
        try:
            assert text == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert text == "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
    assert any(text.startswith("bytes:") for text, _ in named)  # the emoji spans tokens
    assert len({name(token) for token in range(len(tokenizer))}) == len(tokenizer)  # each its own name
