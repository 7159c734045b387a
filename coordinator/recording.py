"""Recording what the target committed, as training data for a draft (`--record-dir`,
`--record-stream`; off by default; docs/operations.md#recording).

One record per finished request (the format: specdec/records.py): the request's input and the
tokens the target committed, and per round that proposed tokens where the proposals stood, how
many the target kept and who proposed them. The round loop calls `Recorder.observe` once per
round: it appends four numbers to the request's buffer, and when the request finishes hands the
record to a writer thread (a bounded queue: a record it has no room for is dropped and counted,
never waited for), which appends it to the sinks — a directory of JSON-lines files, each record
flushed on its own so a killed coordinator leaves every finished record readable, and a Redis
stream trimmed to `--record-max-len` entries.

What is never written: a request whose `cache_salt` is set (its tenant did not agree to share),
and every later request of that session on this coordinator. A continued session is recorded
only where this recorder wrote each of its requests before (`_Chains`); its records then hold
only the new tokens and name the length of the context before them, which its earlier records
hold. A session a salted request touched therefore never has any of its text written, here or
on another coordinator (which did not record its start).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specdec.config import CoordinatorConfig
from specdec.records import RECORD_GLOB, RequestRecord, RoundRecord

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 64 << 20   # a record file is rotated past this (or an eighth of the cap, if less)
QUEUE_RECORDS = 256         # finished records waiting for the writer thread at most
CHAIN_SESSIONS = 65536      # sessions whose recorded length the recorder remembers (LRU)
FULL_RECHECK_S = 60.0       # a full directory is measured again this often (files moved away)
_NOT_RECORDED = False       # a request's buffer when it is not recorded


@dataclass
class RecordCounts:
    """What the recorder did since it started."""

    written: int = 0   # records every sink took (writer thread)
    refused: int = 0   # records a sink did not keep: a full directory, a failing write (writer thread)
    dropped: int = 0   # records dropped because the writer thread's queue was full (event loop)
    skipped: int = 0   # requests not recorded: a cache_salt, or a session not recorded from its start


@dataclass
class _Buffer:
    """One request being recorded."""

    context: int  # committed tokens of the session before the request
    rounds: list[RoundRecord] = field(default_factory=list)


class Sink(Protocol):
    def write(self, line: bytes) -> bool:
        """Append one record line; False when it was not kept (full, failing)."""

    def close(self) -> None: ...


class DirectorySink:
    """JSON-lines files in a directory, at most `max_bytes` in all: each line is written and
    flushed at once (a killed process loses at most the line it was writing, which readers
    skip); a file is rotated past MAX_FILE_BYTES; at the cap recording stops, and resumes when
    the directory, measured again every minute, has room (its files moved away)."""

    def __init__(self, directory: str | Path, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"--record-max-bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.file_bytes = max(1, min(MAX_FILE_BYTES, max_bytes // 8))
        self.used = self._measure()
        self._handle: Any = None
        self._handle_bytes = 0
        self._full_since: float | None = None
        self._serial = 0

    def _measure(self) -> int:
        return sum(f.stat().st_size for f in self.directory.glob(RECORD_GLOB) if f.is_file())

    def _open(self) -> None:
        self._serial += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        name = f"records-{stamp}-{socket.gethostname()}-{os.getpid()}-{self._serial}.jsonl"
        self._handle, self._handle_bytes = open(self.directory / name, "ab"), 0

    def write(self, line: bytes) -> bool:
        if self.used + len(line) > self.max_bytes:
            now = time.monotonic()
            if self._full_since is None:
                log.warning("recording: %s holds --record-max-bytes (%d bytes) of records: new records "
                            "are dropped until files are moved away", self.directory, self.max_bytes)
                self._full_since = now
            elif now - self._full_since >= FULL_RECHECK_S:
                self.used, self._full_since = self._measure(), now
            if self.used + len(line) > self.max_bytes:
                return False
            self._full_since = None
        if self._handle is None or self._handle_bytes + len(line) > self.file_bytes:
            self.close()
            self._open()
        self._handle.write(line)
        self._handle.flush()
        self._handle_bytes += len(line)
        self.used += len(line)
        return True

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class StreamSink:
    """A Redis stream, trimmed to `max_len` entries (XADD MAXLEN), each entry's field
    `record` one record line. The Redis is --session-store's, of any topology (one key: on a
    Cluster it lives on the node owning its slot); the client is opened on the writer thread,
    at the first record, so a Redis down at start costs records, not the start."""

    def __init__(self, url: str, key: str, max_len: int):
        from specdec.redis_url import parse_redis_url

        if max_len < 1:
            raise ValueError(f"--record-max-len must be >= 1, got {max_len}")
        try:
            parse_redis_url(url)
        except ValueError as exc:
            raise ValueError(f"--record-stream writes to the Redis of --session-store, which is not "
                             f"a Redis URL ({exc}): give --session-store a Redis URL, or record with "
                             "--record-dir") from None
        self.url, self.key, self.max_len = url, key, max_len
        self.client = None

    def write(self, line: bytes) -> bool:
        from specdec.redis_url import REDIS_ERRORS, redis_client

        try:
            if self.client is None:
                self.client = redis_client(self.url, socket_timeout=2.0, socket_connect_timeout=2.0)
            self.client.xadd(self.key, {"record": line}, maxlen=self.max_len, approximate=False)
        except REDIS_ERRORS as exc:
            log.warning("recording: could not add a record to the Redis stream %r (%s)", self.key, exc)
            return False
        return True

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class _Chains:
    """The sessions whose every request this recorder wrote: session -> its committed length
    after the last one (LRU)."""

    def __init__(self, size: int = CHAIN_SESSIONS):
        self.size = size
        self._lengths: OrderedDict[str, int] = OrderedDict()

    def follows(self, session_id: str, context: int) -> bool:
        """Whether a request starting after `context` committed tokens continues what was recorded."""
        return context == 0 or self._lengths.get(session_id) == context

    def recorded(self, session_id: str, length: int) -> None:
        self._lengths[session_id] = length
        self._lengths.move_to_end(session_id)
        while len(self._lengths) > self.size:
            self._lengths.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self._lengths.pop(session_id, None)


class Recorder:
    """See the module docstring. `observe` runs on the event loop; the sinks on a thread."""

    def __init__(self, sinks: list[Sink], draft_model: str = "", target_model: str = "",
                 max_queue: int = QUEUE_RECORDS):
        self.sinks = sinks
        self.draft_model, self.target_model = draft_model, target_model
        self.counts = RecordCounts()
        self.chains = _Chains()
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._write_all, name="specdec-recorder", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: CoordinatorConfig, draft_model: str = "", target_model: str = "") -> "Recorder | None":
        """The recorder --record-dir / --record-stream ask for (None: off). ValueError for bad settings."""
        sinks: list[Sink] = []
        if config.record_dir:
            sinks.append(DirectorySink(config.record_dir, config.record_max_bytes))
        if config.record_stream:
            sinks.append(StreamSink(config.session_store, config.record_stream, config.record_max_len))
        if not sinks:
            return None
        log.info("recording finished requests without a cache_salt to %s", " and ".join(
            ([f"{config.record_dir} (at most {config.record_max_bytes} bytes)"] if config.record_dir else [])
            + ([f"the Redis stream {config.record_stream!r} (at most {config.record_max_len} entries)"]
               if config.record_stream else [])))
        return cls(sinks, draft_model, target_model)

    # ---- the event loop's side ------------------------------------------------------------------

    def observe(self, run: Any, result: Any, committed: int, finish: Any) -> None:
        """After a round of `run` (a coordinator.rounds.RequestRun) committed `committed` tokens
        (`result`: its RoundResult; None when the request ended without a round); `finish`: the
        request's finish reason once it ends (None while it goes on)."""
        buffer = run.recording
        if buffer is _NOT_RECORDED:
            return
        record = run.record
        if buffer is None:
            context = len(record.token_ids) - committed - run.stats.prompt_tokens
            if run.cache_salt or not self.chains.follows(record.session_id, context):
                self.chains.forget(record.session_id)  # a salted request ends its session's recording
                self.counts.skipped += 1
                run.recording = _NOT_RECORDED
                return
            buffer = run.recording = _Buffer(context)
        if result is not None and result.drafts:
            at = len(record.token_ids) - committed - buffer.context
            buffer.rounds.append(RoundRecord(at, len(result.drafts), result.verdict.num_accepted,
                                             str(result.source), bool(result.parents)))
        if finish is not None:
            run.recording = _NOT_RECORDED  # written once
            self._finish(run, buffer, str(finish))

    def _finish(self, run: Any, buffer: _Buffer, finish: str) -> None:
        record = run.record
        entry = RequestRecord(record.session_id, record.requests, buffer.context,
                              record.token_ids[buffer.context:], run.stats.prompt_tokens, buffer.rounds,
                              finish, self.draft_model, self.target_model, time.time())
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.counts.dropped += 1
            self.chains.forget(record.session_id)
            return
        self.chains.recorded(record.session_id, len(record.token_ids))

    # ---- the writer thread --------------------------------------------------------------------

    def _write_all(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            line = entry.to_line()
            kept = True
            for sink in self.sinks:
                try:
                    kept = sink.write(line) and kept
                except OSError as exc:
                    log.warning("recording: could not write a record (%s)", exc)
                    kept = False
            if kept:
                self.counts.written += 1
            else:
                self.counts.refused += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (up to `timeout_s`), then close the sinks."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("recording: the writer is stuck; %d records not written", self._queue.qsize())
        self._thread.join(timeout_s)
        for sink in self.sinks:
            sink.close()
