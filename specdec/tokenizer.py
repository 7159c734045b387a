"""A model's tokenizer, and what makes two tokenizers agree, without torch.

The coordinator runs no model but detokenizes and checks that draft and target share a
vocabulary; importing this module loads neither torch nor transformers (transformers'
tokenizer classes pull in torch where it is installed, so they are imported only when a
tokenizer is loaded). specdec.runtime.loader builds the model loading on these.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Callable


class ModelLoadError(RuntimeError):
    """The model or tokenizer could not be loaded; the message says why and what to do."""


def model_source(spec: str) -> tuple[str, dict[str, Any]]:
    """(path or hub id, extra from_pretrained kwargs) for a model spec: a directory, a hub id
    or a .gguf file."""
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {spec}")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists():
        return str(path), {}
    return spec, {}


def load_tokenizer(spec: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model spec (directory, hub id or .gguf file)."""
    from transformers import AutoTokenizer

    source, extra = model_source(spec)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **extra)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {spec!r}: {exc}") from exc


def tokenizer_fingerprint(tokenizer: Any, limit: int | None = None) -> str:
    """sha256 over the vocabulary's (id, token) pairs with id < limit (None: all of them).

    Two models can draft for each other exactly when every id either can emit (below the
    smaller output size) means the same token to both; entries past a model's output size
    (e.g. an unk/pad a tokenizer class adds) cannot be emitted and do not matter, nor does
    which tokens a checkpoint calls bos or pad.
    """
    vocab = sorted((i, t) for t, i in tokenizer.get_vocab().items() if limit is None or i < limit)
    return hashlib.sha256(json.dumps([[t, i] for i, t in vocab], ensure_ascii=False).encode()).hexdigest()


def fingerprints(tokenizer: Any) -> Callable[[int | None], str]:
    """tokenizer_fingerprint of `tokenizer` by limit, each limit's computed once. A model
    service answers the coordinator's probes with it: over a 150k-token vocabulary it takes
    seconds on a busy CPU, longer than a probe waits, and the next probe must not start over."""
    return functools.lru_cache(maxsize=8)(lambda limit: tokenizer_fingerprint(tokenizer, limit))
