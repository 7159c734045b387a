"""bench/gpu.py's time keeping: every step gets its share of what is left of the deadline (by
weight), ends as ok, partial, skipped or error, and the document is rewritten after each; a
watchdog writes what was measured and exits when the run overstays the deadline."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
import traceback
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable

from bench.gpu_steps import Clock

GRACE_S = 30.0  # past the deadline by this much, the watchdog writes what it has and exits
# a step's weight (its share of the time left, against the weights of the steps still to run) and
# the least limit worth starting it with, in seconds; a shape over 5 GB weighs WEIGHT_BIG times more
WEIGHTS = {"bandwidth": (0.2, 0), "build": (1.0, 0), "engine": (1.0, 5), "hf": (0.6, 5),
           "selfdraft": (3.0, 15), "concurrency": (2.0, 10), "indep": (2.0, 15)}
WEIGHT_BIG = 1.6


class Status(StrEnum):
    """How a step ended."""

    OK = "ok"
    PARTIAL = "partial"  # it ran out of time part-way: what it measured is kept, what it left out is named
    SKIPPED = "skipped"  # not run: no time left, a part it needs is missing, or an engine is unavailable
    ERROR = "error"  # it raised: the message is kept, the run goes on


class Skip(Exception):
    """A step cannot run here; the message says why."""


@dataclass
class Planner:
    """Shares the time left among the steps still to run, by weight."""

    deadline: float  # monotonic time the whole run must end by
    weight_left: float  # the summed weights of the steps not yet run or skipped

    def limit(self, weight: float, now: float | None = None) -> float:
        """This step's share of the time left (it is then counted as run)."""
        left = self.deadline - (time.monotonic() if now is None else now)
        share = max(0.0, left) * weight / max(weight, self.weight_left)
        self.weight_left = max(0.0, self.weight_left - weight)
        return share


class Run:
    """One bench/gpu.py run: its document, its steps, its services, the file it writes."""

    def __init__(self, args: argparse.Namespace, document: dict):
        self.args = args
        self.doc = document
        self.out = Path(args.out)
        self.live: list = []  # `specdec up` processes running now (the watchdog ends them)
        self.planner = Planner(time.monotonic() + args.deadline_s, 0.0)

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.doc, indent=2, ensure_ascii=False, default=str)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.out)

    def step(self, name: str, kind: str, big: bool, fn: Callable[[Clock], Any]) -> Any:
        """Run fn under its share of the time left; record how it ended; None unless it ran."""
        weight, least = WEIGHTS[kind]
        asked = kind in getattr(self.args, "steps", WEIGHTS)
        weight *= (WEIGHT_BIG if big else 1.0) if asked else 0.0  # a step not asked for takes no share
        limit = self.planner.limit(weight) if asked else 0.0
        record = {"name": name, "status": Status.SKIPPED, "seconds": 0.0, "limit_s": limit}
        self.doc["steps"].append(record)
        result = None
        if not asked:
            record["reason"] = "not asked for (--steps)"
        elif limit < least:
            record["reason"] = f"no time left: its share is {limit:.0f} s, it needs {least} s"
        else:
            clock = Clock(limit)
            print(f"[{self.elapsed():.0f}s] {name} (limit {limit:.0f} s)", flush=True)
            try:
                result = fn(clock)
                record["status"] = Status.PARTIAL if clock.cut else Status.OK
                if clock.cut:
                    record["reason"] = "out of time, left out: " + ", ".join(clock.cut)
            except Skip as exc:
                record["reason"] = str(exc)
            except Exception as exc:  # noqa: BLE001 - a failed step is recorded; the others still run
                traceback.print_exc()
                record.update(status=Status.ERROR, reason=f"{type(exc).__name__}: {exc}"[:500])
            record["seconds"] = time.monotonic() - clock.started
        print(f"[{self.elapsed():.0f}s] {name}: {record['status']}"
              + (f" ({record['reason']})" if record.get("reason") else ""), flush=True)
        self.write()
        return result

    def elapsed(self) -> float:
        return time.monotonic() - (self.planner.deadline - self.args.deadline_s)

    def watchdog(self) -> threading.Timer:
        """Past the deadline and GRACE_S: write what was measured, end the services, exit."""
        def fire() -> None:
            print(f"bench/gpu.py: {self.args.deadline_s + GRACE_S:.0f} s passed: writing what was measured "
                  "and exiting", flush=True)
            self.doc["aborted"] = f"stopped {GRACE_S:.0f} s past the deadline, in step {self.doc['steps'][-1]['name']}"
            for proc in list(self.live):
                proc.terminate()
            for _ in range(3):  # the main thread may be changing the document
                with contextlib.suppress(RuntimeError):
                    self.write()
                    break
            os._exit(3)

        timer = threading.Timer(self.args.deadline_s + GRACE_S, fire)
        timer.daemon = True
        timer.start()
        return timer
