"""What a draft is distilled on: token sequences, from recorded traffic, given text, or prompts
the target answers; the held-out part α is measured on; windows of them for training.

A prompts file is JSON lines — `{"prompt": "..."}`, or `{"messages": [{"role": ..., "content":
...}, ...]}` rendered with the tokenizer's chat template — or plain text, one prompt per line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specdec.records import ReadCount, read_records, read_stream, stitched

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scored:
    """A held-out sequence: α is measured at the positions whose next token is from `start` on."""

    tokens: list[int]  # the whole sequence (a prompt and the target's answer, or text)
    start: int         # first token whose prediction is scored (a prompt's length; 1 for text)

    @property
    def positions(self) -> int:
        """Positions scored: every one from the distribution that produced tokens[start] on (the
        last position too: its distribution proposes the token after the sequence)."""
        return len(self.tokens) - self.start + 1


def read_prompt_files(paths: Sequence[str | Path], tokenizer: Any) -> list[list[int]]:
    """The prompts of every file, the files in the order given (see read_prompts)."""
    if isinstance(paths, (str, Path)):
        raise TypeError(f"expected a sequence of prompts files, got the one path {str(paths)!r}")
    return [prompt for path in paths for prompt in read_prompts(path, tokenizer)]


def read_prompts(path: str | Path, tokenizer: Any) -> list[list[int]]:
    """The prompts of a prompts file (see the module docstring) as token ids."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = line
        prompts.append(encode_prompt(item, tokenizer, f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts


def encode_prompt(item: Any, tokenizer: Any, where: str = "a prompt") -> list[int]:
    """A prompt (text, {"prompt": text} or {"messages": [...]}) as token ids."""
    if isinstance(item, dict) and "messages" in item:
        messages = [{"role": m["role"], "content": m["content"]} for m in item["messages"]]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    text = item.get("prompt") if isinstance(item, dict) else item
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: expected text, {{\"prompt\": text}} or {{\"messages\": [...]}}, got {item!r}")
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def read_text(paths: Sequence[str | Path], tokenizer: Any) -> list[list[int]]:
    """Each text file as one token sequence."""
    out = []
    for path in paths:
        ids = tokenizer(Path(path).read_text(), add_special_tokens=False)["input_ids"]
        if ids:
            out.append([int(t) for t in ids])
    return out


def read_recorded(source: str, stream_key: str = "") -> list[list[int]]:
    """The sequences of a coordinator's records: a directory or file (--record-dir), or with
    `stream_key` the Redis stream of that key at the URL `source` (--record-stream)."""
    count = ReadCount()
    records = list(read_stream(source, stream_key, count) if stream_key else read_records(source, count))
    if count.skipped:
        log.warning("records: %d lines skipped (torn or of another version), %d read", count.skipped, count.records)
    return stitched(records)


def split_held_out(sequences: list[list[int]], fraction: float) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held out): the last `fraction` of the sequences (at least one, when there are two
    or more) are held out."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"--held-out must be in [0, 1), got {fraction}")
    held = 0 if fraction == 0 or len(sequences) < 2 else max(1, round(len(sequences) * fraction))
    return sequences[:len(sequences) - held], sequences[len(sequences) - held:]


def windows(sequences: list[list[int]], length: int) -> list[list[int]]:
    """The sequences cut into windows of at most `length` tokens (each window trains on its own;
    a piece shorter than 2 tokens is dropped)."""
    if length < 2:
        raise ValueError(f"--seq-len must be >= 2, got {length}")
    return [seq[i:i + length] for seq in sequences for i in range(0, len(seq), length) if len(seq[i:i + length]) >= 2]


@torch.no_grad()
def generate(model: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
             eos_ids: Sequence[int], progress: Callable[[int], None] = lambda n: None,
             batch_size: int = 8) -> list[Scored]:
    """The target's answer to each prompt — greedy at temperature 0, else sampled from its plain
    softmax at that temperature (no top-k, top-p or repetition penalty of the checkpoint's
    generation config), seeded per batch — as scored sequences: prompt and answer, scored from the
    answer on. Prompts run `batch_size` at a time, left-padded."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    pad_id = int(eos_ids[0]) if eos_ids else 0
    settings = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
                                repetition_penalty=None, pad_token_id=pad_id, eos_token_id=list(eos_ids) or None)
    out = []
    for begin in range(0, len(prompts), batch_size):
        batch = prompts[begin:begin + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        torch.manual_seed(seed + begin)
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                   generation_config=settings)[:, width:].tolist()
        for prompt, answer in zip(batch, generated):
            end = next((i + 1 for i, token in enumerate(answer) if token in eos_ids), len(answer))
            out.append(Scored(list(prompt) + answer[:end], len(prompt)))
        progress(len(batch))
    return out
