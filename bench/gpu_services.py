"""bench/gpu.py's service sets: one `specdec up` on the target and a draft, started within the
limit of the step that needs it, its services' logs kept in a file and read back for what each
service did at start-up (specdec_cli/serve.py makes those lines visible at the default level):
the graph engine's K/V pool, its CUDA graphs captured (how many, how long, how many failed), the
device memory the service holds after capture, and its start-up time."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import gpu_steps

# the lines of specdec/runtime/graph/engine.py and specdec_cli/serve.py this reads (model path first)
POOL = re.compile(r"INFO \S+: (?P<model>\S+): graph engine on (?P<device>\S+), paged K/V pool of (?P<blocks>\d+) "
                  r"blocks x \d+ tokens \(\d+ bytes per token, (?P<pool_bytes>\d+) bytes; (?P<reserve>\d+) bytes "
                  r"set aside for capture\), (?P<buckets>\d+) forward buckets, CUDA graphs (?P<graphs>on|off)")
CAPTURED = re.compile(r"INFO \S+: (?P<model>\S+): (?P<captured>\d+) CUDA graphs captured in (?P<seconds>[\d.]+) s "
                      r"\((?P<failed>\d+) failed, running eagerly\)(?:; device memory (?P<allocated>\d+) bytes "
                      r"allocated, (?P<reserved>\d+) reserved)?")
READY = re.compile(r"INFO \S+: (?P<kind>draft|target) service ready in (?P<seconds>[\d.]+) s \((?P<model>[^,\s]+),")
INTS = ("blocks", "pool_bytes", "reserve", "buckets", "captured", "failed", "allocated", "reserved")


def service_figures(log_text: str, models: dict[str, str]) -> dict[str, dict]:
    """What each service logged at start-up, per role (models: role -> model path)."""
    roles = {path: role for role, path in models.items()}
    out: dict[str, dict] = {}
    for pattern, prefix in ((POOL, "pool"), (CAPTURED, "capture"), (READY, "startup")):
        for match in pattern.finditer(log_text):
            role = roles.get(match["model"])
            if role is None:
                continue
            fields = {k: (int(v) if k in INTS else float(v) if k == "seconds" else v)
                      for k, v in match.groupdict().items() if k != "model" and v is not None}
            out.setdefault(role, {})[prefix] = fields
    return out


class Up:
    """One `specdec up` on the target and a draft, started by the first step that needs it."""

    def __init__(self, run: Any, models: dict, draft: str, port: int, options: SimpleNamespace):
        self.run, self.models, self.draft, self.port, self.options = run, models, draft, port, options
        self.stack = contextlib.ExitStack()
        self.proc: subprocess.Popen | None = None  # the `specdec up` process once started
        self.error: Exception | None = None  # why it could not be started
        self.address = f"127.0.0.1:{port}"
        self.log_path = ""  # the services' logs
        self.startup_s: float | None = None  # from starting `specdec up` to its coordinator serving

    def start(self, timeout_s: float) -> subprocess.Popen:
        """The process (started now, within timeout_s, unless it was); what failed when it was started."""
        if self.error is not None:
            raise self.error
        if self.proc is None:
            try:
                # beside the JSON: the models' directory is deleted once the shape is measured
                name = f"services-{self.models['target'].shape}-{self.draft}.log"
                self.log_path = str(Path(self.run.out).parent / name)
                Path(self.log_path).unlink(missing_ok=True)  # an earlier run's
                started = time.monotonic()
                self.proc = self.stack.enter_context(gpu_steps.services(
                    self.models[self.draft].path, self.models["target"].path, self.options, self.run.live,
                    timeout_s, self.log_path))
                self.startup_s = time.monotonic() - started
                print(f"[{self.run.elapsed():.0f}s] services of the target and the {self.draft} up in "
                      f"{self.startup_s:.0f} s", flush=True)
            except Exception as exc:  # noqa: BLE001 - kept for the step that needs these services
                self.error = exc
                raise
        return self.proc

    def figures(self) -> dict:
        """The set's start-up time and what each service logged (empty before it started)."""
        if not self.log_path or not Path(self.log_path).is_file():
            return {}
        paths = {"target": self.models["target"].path, self.draft: self.models[self.draft].path}
        text = Path(self.log_path).read_text(errors="replace")
        return {"startup_s": self.startup_s, "log": self.log_path, "services": service_figures(text, paths),
                "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}"[:500]}

    def close(self) -> None:
        self.stack.close()


def start_together(ups: list[Up], timeout_s: float) -> None:
    """Start every set at once (each loads its models while the others do: one start-up's wait,
    not one each), each within timeout_s; a set that fails keeps its error for its own step."""
    ups = [up for up in ups if up.proc is None and up.error is None]

    def start(up: Up) -> None:
        with contextlib.suppress(Exception):  # kept in up.error
            up.start(timeout_s)

    threads = [threading.Thread(target=start, args=(up,)) for up in ups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
