"""The peers: transformers' own `generate`, plain, assisted by the draft model, prompt lookup.

Each method runs greedy in this process on the same checkpoints, dtype and thread count as the
services, and is timed like specdec: a streamer stamps every emitted chunk, so the decode rate
leaves out start-up and the prefill (the time to the first generated token).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value
ASSISTED_CONSTANT_GAMMA = 3


@dataclass
class Timed:
    """One generation: the tokens and when each chunk of them appeared."""

    token_ids: list[int]
    started: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in the chunk)
    ended: float = 0.0

    @property
    def total_seconds(self) -> float:
        return self.ended - self.started

    @property
    def first_token_seconds(self) -> float:
        return self.chunks[0][0] - self.started if self.chunks else self.total_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first chunk over the time after it (prefill and start-up cancelled)."""
        if len(self.chunks) < 2:
            return len(self.token_ids) / self.total_seconds if self.total_seconds > 0 else 0.0
        later = sum(count for _, count in self.chunks[1:])
        return later / (self.chunks[-1][0] - self.chunks[0][0])


class _Clock:
    """A transformers streamer that only records when tokens come out (the first put is the prompt)."""

    def __init__(self, timed: Timed) -> None:
        self.timed, self.prompt_seen = timed, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.timed.chunks.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        self.timed.ended = time.perf_counter()


@contextlib.contextmanager
def _assistant_schedule(draft: Any, **settings: Any) -> Iterator[None]:
    """Set the assistant's speculation settings for one call, then restore them."""
    config = draft.generation_config
    saved = {name: getattr(config, name, None) for name in settings}
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def generate(target: Any, ids: list[int], new_tokens: int, **kwargs: Any) -> Timed:
    """Greedy `target.generate`, EOS ignored, exactly `new_tokens` tokens."""
    timed = Timed([], time.perf_counter())
    inputs = torch.tensor([ids], device=target.device)
    with torch.inference_mode():
        out = target.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0, streamer=_Clock(timed), **kwargs)
    timed.token_ids = out[0, len(ids):].tolist()
    timed.ended = timed.ended or time.perf_counter()
    return timed


def methods(draft: Any) -> dict[str, Callable[[Any, list[int], int], Timed]]:
    """name -> run(target, ids, new_tokens)."""

    def assisted_default(target: Any, ids: list[int], n: int) -> Timed:
        with _assistant_schedule(draft, num_assistant_tokens=None, num_assistant_tokens_schedule=None,
                                 assistant_confidence_threshold=None):
            return generate(target, ids, n, assistant_model=draft)

    def assisted_constant(target: Any, ids: list[int], n: int) -> Timed:
        with _assistant_schedule(draft, num_assistant_tokens=ASSISTED_CONSTANT_GAMMA,
                                 num_assistant_tokens_schedule="constant",
                                 assistant_confidence_threshold=0.0):
            return generate(target, ids, n, assistant_model=draft)

    return {
        "hf plain": lambda target, ids, n: generate(target, ids, n),
        "hf assisted": assisted_default,
        f"hf assisted γ={ASSISTED_CONSTANT_GAMMA}": assisted_constant,
        "hf prompt lookup": lambda target, ids, n: generate(target, ids, n,
                                                            prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
    }
