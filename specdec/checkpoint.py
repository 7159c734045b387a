"""What a checkpoint on disk is: an identity of its files' contents, cheap to take at start.

A model service reports it (`ModelInfo.checkpoint_id`) so the coordinator keeps what it learnt
of a model per checkpoint, not per path: a distilled draft written over the old one's
directory is another model to it, while the same files copied to every replica's disk are one.
Hashing every weight would cost seconds per gigabyte at start; the identity reads each file's
name and size and SAMPLES evenly spaced slices of it (the first and last bytes among them), so
a checkpoint rewritten with other weights of the same shapes — a fine-tune, a LoRA merged into
every layer — differs in the slices that land in its changed tensors. Files' times and places
are not read: a copy is the same checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SLICES = 16  # slices sampled per file, evenly spaced, the first at offset 0 and the last at the end
SLICE_BYTES = 64 * 1024  # bytes per slice: 1 MiB read per file at most


def checkpoint_id(spec: str) -> str:
    """The identity of the checkpoint `spec` names: a directory (every plain file in it, by
    name) or one file (a .gguf); "" for anything not on this disk (a hub id)."""
    path = Path(spec)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    else:
        return ""
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(_file_identity(file, file.name if path.is_dir() else ""))
    return digest.hexdigest()


def _file_identity(file: Path, name: str) -> bytes:
    """A file's name, size and SLICES slices of its bytes, evenly spaced."""
    size = file.stat().st_size
    digest = hashlib.blake2b(f"{name}\x00{size}\x00".encode(), digest_size=16)
    with open(file, "rb") as handle:
        if size <= SLICES * SLICE_BYTES:
            digest.update(handle.read())
            return digest.digest()
        last = size - SLICE_BYTES
        for k in range(SLICES):
            handle.seek(last * k // (SLICES - 1), os.SEEK_SET)
            digest.update(handle.read(SLICE_BYTES))
    return digest.digest()
