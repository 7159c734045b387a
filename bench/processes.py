"""Helpers for the benchmarks that run the services as processes: a free port for each, and
each one's CPU time so far."""

from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
    """A process's CPU time so far, all its threads (the exited ones too), to the nanosecond:
    Linux's CPU-time clock of the process, the clock clock_getcpuclockid(pid) names (None where
    the system has no such clock, or the process is gone)."""
    try:
        return time.clock_gettime((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except (OSError, AttributeError):
        return None


def cpu_of(pids: dict[str, int]) -> dict[str, float | None]:
    """cpu_seconds of each named process."""
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_spent(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    """CPU seconds each process spent between two cpu_of readings (None where unreadable)."""
    return {name: None if before[name] is None or after.get(name) is None else after[name] - before[name]
            for name in before}


def cpu_columns(row: dict) -> str:
    """A row's cpu_{coordinator,client,draft,target}_ms as table columns (n/a where unknown)."""
    widths = {"coordinator": 11, "client": 8, "draft": 8, "target": 8}
    return " ".join(f"{'n/a' if row[f'cpu_{n}_ms'] is None else format(row[f'cpu_{n}_ms'], '.3f'):>{w}}"
                    for n, w in widths.items())


def model_pair(args, script: str, **tiny_options) -> tuple[str, str]:
    """(draft, target) of a benchmark: a tiny random pair built here (--tiny, built with
    `tiny_options`), the --draft-model and --target-model given, or the fetched pair."""
    if args.tiny:
        from specdec_cli.tiny import build_pair

        root = Path(tempfile.mkdtemp(prefix="specdec-bench-"))
        draft, target = build_pair(root, "llama", **tiny_options)
        return str(draft), str(target)
    if args.draft_model and args.target_model:
        return args.draft_model, args.target_model
    from specdec_cli.model_pair import FetchError, default_pair

    try:
        pair = default_pair()
    except FetchError as exc:
        raise SystemExit(f"{script}: {exc} (or give --draft-model/--target-model, or --tiny)")
    return str(pair["draft"]), str(pair["target"])
