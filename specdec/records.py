"""Training records: what the target committed, per request, as a coordinator records it.

The coordinator writes them (`--record-dir`, `--record-stream`; coordinator/recording.py) and
`specdec distill --records` reads them (specdec/distill/). One record per finished request,
one JSON object per line (docs/operations.md#recording says what each field holds):

    {"v": 1, "session": "…", "request": 2, "context": 57, "tokens": [...], "input": 12,
     "rounds": [[at, proposed, accepted, "draft"], ...], "finish": "length",
     "draft": "…", "target": "…", "time": 1796342400.0}

`context` committed tokens of the session came before this request and are not in `tokens`
(they are in the session's earlier records, which a recorder writes only when it wrote every
request before: `stitched` joins them again). `tokens` holds this request's input (`input`
tokens) and then what the target committed. A round that proposed tokens is
`[at, proposed, accepted, source]` (+ `"tree"` for a token tree): its proposals stood at
`tokens[at:]`, the target kept `accepted` of them, and where `accepted < proposed` the token at
`tokens[at + accepted]` is the target's own, where the proposal was wrong.

Reading tolerates a torn line (a coordinator killed while writing one): a line that does not
decode is skipped and counted, never an error.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger(__name__)

RECORD_VERSION = 1
RECORD_GLOB = "records-*.jsonl"  # the files a recorder writes in its directory


@dataclass(frozen=True)
class RoundRecord:
    """One round that proposed tokens."""

    at: int          # index in the record's tokens of the first proposed position
    proposed: int    # tokens proposed (a tree: its nodes)
    accepted: int    # of them, the target kept this many (a tree: the accepted path's length)
    source: str      # who proposed: "draft" or "ngram" (prompt lookup)
    tree: bool = False  # the proposals were a token tree

    def to_json(self) -> list:
        return [self.at, self.proposed, self.accepted, self.source, *(["tree"] if self.tree else [])]

    @classmethod
    def from_json(cls, data: list) -> "RoundRecord":
        return cls(int(data[0]), int(data[1]), int(data[2]), str(data[3]), len(data) > 4 and data[4] == "tree")


@dataclass(frozen=True)
class RequestRecord:
    """One finished request of a session."""

    session_id: str      # the session
    request: int         # the session's request number (1: the one that started it)
    context: int         # committed tokens of the session before this request (not in `tokens`)
    tokens: list[int]    # this request's input, then what the target committed
    input_tokens: int    # of `tokens`, the leading ones that were the request's input
    rounds: list[RoundRecord] = field(default_factory=list)  # the rounds that proposed tokens
    finish: str = ""     # why the request ended (eos, length, stop, context_length)
    draft: str = ""      # the draft model's id as its service reports it
    target: str = ""     # the target model's id
    time: float = 0.0    # when the request finished (Unix seconds)

    def to_line(self) -> bytes:
        """The record as one JSON line (newline included)."""
        data = {"v": RECORD_VERSION, "session": self.session_id, "request": self.request,
                "context": self.context, "tokens": self.tokens, "input": self.input_tokens,
                "rounds": [r.to_json() for r in self.rounds], "finish": self.finish,
                "draft": self.draft, "target": self.target, "time": round(self.time, 3)}
        return (json.dumps(data, separators=(",", ":")) + "\n").encode()

    @classmethod
    def from_line(cls, line: str | bytes) -> "RequestRecord":
        """ValueError for anything but a whole record of a known version."""
        try:
            data = json.loads(line)
            if data.get("v") != RECORD_VERSION:
                raise ValueError(f"record version {data.get('v')!r}, this reader knows {RECORD_VERSION}")
            return cls(str(data["session"]), int(data["request"]), int(data["context"]),
                       [int(t) for t in data["tokens"]], int(data["input"]),
                       [RoundRecord.from_json(r) for r in data["rounds"]], str(data.get("finish", "")),
                       str(data.get("draft", "")), str(data.get("target", "")), float(data.get("time", 0.0)))
        except (KeyError, TypeError, IndexError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a record: {exc}") from exc

    def missed_positions(self) -> list[int]:
        """Indices in `tokens` where a proposal was wrong (the target's token stands there)."""
        return [r.at + r.accepted for r in self.rounds if r.accepted < r.proposed]


@dataclass
class ReadCount:
    """What reading found."""

    records: int = 0  # whole records read
    skipped: int = 0  # lines that did not decode (a torn last line, another version)


def record_files(path: str | Path) -> list[Path]:
    """A record file, or every record file of a directory (oldest name first)."""
    path = Path(path)
    if path.is_dir():
        return sorted(path.glob(RECORD_GLOB))
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"no record file or directory at {path}")


def read_lines(lines: Iterable[bytes | str], count: ReadCount | None = None) -> Iterator[RequestRecord]:
    """The records of JSON lines, undecodable ones skipped (and counted)."""
    count = count if count is not None else ReadCount()
    for line in lines:
        if not line.strip():
            continue
        try:
            record = RequestRecord.from_line(line)
        except ValueError as exc:
            count.skipped += 1
            log.info("skipping a record line: %s", exc)
            continue
        count.records += 1
        yield record


def read_records(path: str | Path, count: ReadCount | None = None) -> Iterator[RequestRecord]:
    """Every record under `path` (a directory of record files, or one file)."""
    for file in record_files(path):
        with open(file, "rb") as handle:
            yield from read_lines(handle, count)


def read_stream(url: str, key: str, count: ReadCount | None = None, batch: int = 1000) -> Iterator[RequestRecord]:
    """Every record of the Redis stream `key` (--record-stream) at `url` (any topology:
    specdec/redis_url.py), oldest first."""
    from specdec.redis_url import redis_client

    client = redis_client(url)
    try:
        start = "-"
        while True:
            entries = client.xrange(key, min=start, max="+", count=batch)
            if not entries:
                return
            yield from read_lines((fields.get(b"record", b"") for _, fields in entries), count)
            if len(entries) < batch:
                return
            start = "(" + entries[-1][0].decode()
    finally:
        client.close()


def stitched(records: Iterable[RequestRecord]) -> list[list[int]]:
    """Token sequences to learn from: each session's records joined in request order while each
    one's context is exactly the tokens before it; a record whose context is missing (an earlier
    request not recorded, or its record lost) starts a sequence of its own."""
    sessions: dict[str, list[RequestRecord]] = {}
    for record in records:
        sessions.setdefault(record.session_id, []).append(record)
    sequences: list[list[int]] = []
    for session in sessions.values():
        session.sort(key=lambda r: (r.request, r.context))
        current: list[int] = []
        length = 0  # the session's committed length that `current` reaches (its context included)
        for record in session:
            if not current or record.context != length:
                if current:
                    sequences.append(current)
                current, length = [], record.context
            current = current + record.tokens
            length += len(record.tokens)
        if current:
            sequences.append(current)
    return sequences
