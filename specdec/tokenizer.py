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
import os
from pathlib import Path
from typing import Any, Callable


class ModelLoadError(RuntimeError):
    """The model or tokenizer could not be loaded; the message says why and what to do."""


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set: nothing comes from the hub that its cache does not hold."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def in_hub_cache(hub_id: str) -> bool:
    """The hub cache holds some revision of `hub_id` (a model repository)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return (Path(HF_HUB_CACHE) / ("models--" + hub_id.replace("/", "--"))).is_dir()


def why_not_a_hub_id(spec: str) -> str | None:
    """Why a model argument that names nothing on this machine cannot be a hub id (None: it can
    be one, and goes to the hub). A hub id is NAME or ORG/NAME; the rule, in docs/models.md:
    it is a path when it starts with /, ~, ./ or ../, holds more than one /, ends with .gguf or
    its first component is a directory here; with HF_HUB_OFFLINE set, anything the hub cache
    lacks."""
    if spec in (".", "..") or spec.startswith(("/", "~", "./", "../")):
        return "it is a path"
    if spec.endswith(".gguf"):
        return "it is a .gguf file's path"
    parts = spec.rstrip("/").split("/")
    if len(parts) > 2 or "" in parts:
        return "a hub id is NAME or ORG/NAME"
    if len(parts) == 2 and Path(parts[0]).is_dir():
        return f"{parts[0]}/ is a directory here"
    if hub_offline() and not in_hub_cache(spec):
        return "HF_HUB_OFFLINE is set and the hub cache has no such model"
    return None


def resolve_model(spec: str) -> str:
    """What a model argument names: an existing file or directory (its absolute path, so its
    served name is its last component wherever it is read), else a hub id (as given).
    ModelLoadError("no such directory: ...") at once, before any hub call, for one that can only
    be a path (why_not_a_hub_id) and is not there."""
    path = Path(spec).expanduser()
    if spec and path.exists():
        return str(path.resolve())
    why = why_not_a_hub_id(spec) if spec else None
    if why is not None:
        kind = "file" if spec.endswith(".gguf") else "directory"
        raise ModelLoadError(f"no such {kind}: {spec} (looked for in {Path.cwd()}; not a hub id: {why})")
    return spec


def model_source(spec: str) -> tuple[str, dict[str, Any]]:
    """(path or hub id, extra from_pretrained kwargs) for a model spec: a directory, a hub id
    or a .gguf file; ModelLoadError for a path that is not there (resolve_model)."""
    resolved = resolve_model(spec)
    if spec.endswith(".gguf"):
        path = Path(resolved)
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {spec}")
        return str(path.parent), {"gguf_file": path.name}
    return resolved, {}


def load_tokenizer(spec: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model spec (directory, hub id or .gguf file)."""
    from transformers import AutoTokenizer

    source, extra = model_source(spec)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **extra)
    except (OSError, ValueError) as exc:
        here = "" if Path(source).exists() else f"no such directory: {spec}, and as a hub id: "
        raise ModelLoadError(f"cannot load the tokenizer of {spec!r}: {here}{exc}") from exc


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
