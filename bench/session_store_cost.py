"""What a round's commit costs the session store under each --session-durability setting.

Usage:
  python bench/session_store_cost.py [--rounds 2000] [--tokens 4] [--settings none,replicas=1]
                                     [--topologies sentinel,cluster]

Starts its own Redis on loopback (tests/redis_ha.py): a primary with two replicas and three
sentinels, and a 3-primary Cluster with a replica each; then, per topology and setting, one
session saved --rounds times, --tokens new tokens a round (what the round loop stores before a
round's tokens stream), the settings taking turns 100 saves at a time, and prints the time per
save: median, p99, mean, and the median's excess over the first setting's (a setting no Redis
here can meet, replicas=3, prints its error). Loopback figures on a shared machine are noisy: run it twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.sessions.durability import parse_durability  # noqa: E402
from coordinator.sessions.redis_store import RedisSessionStore  # noqa: E402
from specdec.errors import SpecdecError  # noqa: E402
from tests.redis_ha import ClusterGroup, SentinelGroup  # noqa: E402

GROUPS = {"sentinel": SentinelGroup, "cluster": ClusterGroup}


async def time_saves(url: str, settings: list[str], rounds: int, tokens: int,
                     block: int = 100) -> dict[str, list[float] | str]:
    """Per setting, the seconds of each of `rounds` saves of one session, the settings taking
    turns a block of saves at a time (so a machine's load drifting hits them alike); a setting
    whose save fails keeps the error instead."""
    stores = {s: RedisSessionStore(url, durability=parse_durability(s)) for s in settings}
    leases = {}
    times: dict[str, list[float] | str] = {s: [] for s in settings}
    try:
        for setting, store in stores.items():
            leases[setting] = await store.acquire((await store.create()).session_id)
        for first in range(0, rounds, block):
            for setting, store in stores.items():
                if isinstance(times[setting], str):
                    continue
                lease = leases[setting]
                for i in range(first, min(rounds, first + block)):
                    lease.record.token_ids += [i % 1000] * tokens
                    started = time.perf_counter()
                    try:
                        await store.save(lease.record, lease)
                    except SpecdecError as exc:
                        times[setting] = f"{exc.__class__.__name__}: {exc}"
                        break
                    if first:  # the first block warms connections and scripts
                        times[setting].append(time.perf_counter() - started)
        return times
    finally:
        for setting, store in stores.items():
            if setting in leases:
                await store.delete(leases[setting].session_id)
            await store.close()


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 4),
            "p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1e3, 4),
            "mean_ms": round(statistics.fmean(ordered) * 1e3, 4)}


def run(args) -> list[dict]:
    rows = []
    settings = args.settings.split(",")
    for topology in args.topologies.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            group = GROUPS[topology](Path(tmp)).start()
            try:
                results = asyncio.run(time_saves(group.url, settings, args.rounds, args.tokens))
            finally:
                group.stop()
        base = None
        for setting in settings:
            result = results[setting]
            row = {"topology": topology, "setting": setting,
                   **({"error": result} if isinstance(result, str) else summary(result))}
            if "p50_ms" in row:
                base = row["p50_ms"] if base is None else base
                row["p50_over_first_ms"] = round(row["p50_ms"] - base, 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--settings", default="none,replicas=1")
    parser.add_argument("--topologies", default="sentinel,cluster")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
