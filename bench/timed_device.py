"""The timed device, a BENCHMARK TOOL (never a serving backend): the draft and target services
with model calls that take the time a GPU would, while their tokens stay real and exact.

Each service runs its tiny model on the CPU, as usual, and its engine's forwards are wrapped
(`TimedForwards`): a forward of R rows × k new tokens on c cached tokens each is held until the
cost table's time for it (bench/pace_tables.py) has passed since it began. The hold sleeps, so
the model thread gives up the GIL as a host thread waiting on a GPU does, and spins the last
`spin_s` (time.sleep overshoots by about 70 µs on an idle Linux box, far more on a loaded one).
A forward whose real compute already took longer than the table's time is not held; it is
counted (`overruns`) and reported, since the device then runs slower than the table says. The
draft's γ-step loop is its γ forwards, each held on its own. Only forwards are timed: the
acceptance step, the draws, the scheduler's work stay host work, as on a GPU host.

  python bench/timed_device.py --serve target --model DIR --table h200-7b --port 50051 --stats s.json

runs one service so (bench/pace.py starts both, `start_services`); on stdin EOF it writes its
counters to --stats and stops. --gpu-json FILE takes the target's times from a bench/gpu.py run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pace_tables import TABLES, CostTable, DevicePair, from_gpu_json  # noqa: E402
from bench.processes import free_port  # noqa: E402

SPIN_S = 100e-6  # the last part of a hold is spun, not slept


def hold_until(deadline: float, spin_s: float = SPIN_S, clock: Callable[[], float] = time.perf_counter) -> None:
    """Return at `deadline` (perf_counter seconds) or just after: sleep until spin_s before it,
    then spin."""
    left = deadline - clock()
    if left > spin_s:
        time.sleep(left - spin_s)
    while clock() < deadline:
        pass


def forward_shape(rows: Sequence[Any]) -> tuple[int, int, int]:
    """(rows, new tokens per row, cached tokens per row) of a batched forward, as the device runs
    it: padded to its longest row, on the rows' mean cached length (before the forward)."""
    if not rows:
        return 0, 0, 0
    tokens = max(len(row.tokens) for row in rows)
    context = sum(len(row.entry) for row in rows) // len(rows)
    return len(rows), tokens, context


@dataclass
class TimedForwards:
    """Wraps an engine's forward_batch and forward_hidden (on the instance) so each takes at
    least the table's time; counts what it held and where the real compute ran over."""

    table: CostTable
    spin_s: float = SPIN_S
    calls: int = 0
    overruns: int = 0  # forwards whose real compute exceeded the table's time
    table_s: float = 0.0  # the table's time, summed
    compute_s: float = 0.0  # the real compute, summed
    late_s: list[float] = field(default_factory=list)  # per held forward: how far past the table's time it returned
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, engine: Any) -> Any:
        for name in ("forward_batch", "forward_hidden"):
            if hasattr(engine, name):
                setattr(engine, name, self.timed(getattr(engine, name)))
        return engine

    def timed(self, forward: Callable) -> Callable:
        def held(rows, *args, **kwargs):
            start = time.perf_counter()
            wanted = self.table.seconds(*forward_shape(rows))
            out = forward(rows, *args, **kwargs)
            done = time.perf_counter()
            overrun = done - start > wanted
            if not overrun:
                hold_until(start + wanted, self.spin_s)
            end = time.perf_counter()
            with self.lock:
                self.calls += 1
                self.overruns += overrun
                self.table_s += wanted
                self.compute_s += done - start
                if not overrun:
                    self.late_s.append(end - start - wanted)
            return out
        return held

    def stats(self) -> dict:
        late = sorted(self.late_s)
        pick = (lambda q: 1e6 * late[min(len(late) - 1, int(q * len(late)))]) if late else (lambda q: None)
        return {"table": self.table.name, "calls": self.calls, "overruns": self.overruns,
                "table_ms": 1e3 * self.table_s, "compute_ms": 1e3 * self.compute_s,
                "late_us_p50": pick(0.5), "late_us_p99": pick(0.99)}


def device_pair(table: str, gpu_json: str = "", shape: str = "7b") -> DevicePair:
    """The named ready table, or its target replaced by a bench/gpu.py curve."""
    if table not in TABLES:
        raise SystemExit(f"unknown table {table!r}; choose from {', '.join(TABLES)}")
    return from_gpu_json(gpu_json, shape, base=table) if gpu_json else TABLES[table]


def serve(args: argparse.Namespace) -> int:
    """Child process: one model service with its forwards timed; on stdin EOF write the counters."""
    from draft_service import server as draft_server
    from specdec.config import DraftConfig, TargetConfig
    from target_service import server as target_server

    pair = device_pair(args.table, args.gpu_json, args.gpu_shape)
    start, config = (draft_server.start, DraftConfig) if args.serve == "draft" else (target_server.start, TargetConfig)
    server, _, servicer = start(config(model=args.model, dtype=args.dtype, port=args.port))
    timer = TimedForwards(pair.draft if args.serve == "draft" else pair.target, args.spin_us * 1e-6)
    timer.install(servicer.engine)  # after the warm-up: only served calls are held
    print("serving", flush=True)
    sys.stdin.read()
    Path(args.stats).write_text(json.dumps(timer.stats()))
    server.stop(None).wait()
    return 0


class TimedServices:
    """The draft and the target on the timed device, each a process of its own on loopback."""

    def __init__(self, models: dict[str, Path], table: str, root: Path, dtype: str = "float32",
                 gpu_json: str = "", spin_us: float = SPIN_S * 1e6, env: dict | None = None):
        self.root = root
        self.ports = {name: free_port() for name in ("draft", "target")}
        self.children = {name: subprocess.Popen(
            [sys.executable, __file__, "--serve", name, "--model", str(models[name]), "--dtype", dtype,
             "--table", table, "--gpu-json", gpu_json, "--spin-us", str(spin_us), "--port", str(self.ports[name]),
             "--stats", str(root / f"timed-{name}.json")], stdin=subprocess.PIPE, env=env)
            for name in ("draft", "target")}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        from specdec.rpc.health import wait_healthy

        for name in ("draft", "target"):
            wait_healthy(self.address(name), timeout_s, list(self.children.values()))

    def close(self) -> dict:
        """Stop both; their counters (a service that wrote none: {})."""
        for child in self.children.values():
            if child.poll() is None:
                child.stdin.close()
        for child in self.children.values():
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
        out = {}
        for name in self.children:
            path = self.root / f"timed-{name}.json"
            out[name] = json.loads(path.read_text()) if path.is_file() else {}
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=("draft", "target"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--table", default="h200-7b", help=f"the cost table: {', '.join(TABLES)}")
    parser.add_argument("--gpu-json", default="", help="take the target's times from this bench/gpu.py JSON")
    parser.add_argument("--gpu-shape", default="7b", help="the shape of --gpu-json to take")
    parser.add_argument("--spin-us", type=float, default=SPIN_S * 1e6, help="spin the last this many µs of a hold")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stats", required=True)
    return serve(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
