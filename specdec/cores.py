"""Whether two model services compete for the same CPU cores.

Where the draft and the target run on separate hardware, the draft's work beside a
verification (a call made ahead, the prompt sent alongside a first round) is free. Where both
run their forwards on the same cores, it slows the verification it runs beside: on two shared
cores llama.cpp's verification took twice as long or more (docs/benchmarks.md), since each
engine runs as many threads as there are cores.

A model service that computes on the CPU reports where (`CpuPlacement`): the kernel's boot id
(one per running kernel: containers on one node share it, two machines never do), the physical
cores it may run on (its CPU affinity, one CPU id per core: hyperthreads of a core share its
arithmetic) and the threads its forwards use. Two services compete when they run under the same
kernel on overlapping cores with more threads between them than those cores: two services of
one thread each on two cores do not, two engines sized to every core of one host do. A service
on an accelerator reports no placement and competes with nothing. Two VMs on one physical host
are not seen; `--tiers-share-cores yes` says so, and `no` overrides the reports.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CpuPlacement:
    """Where a service's forwards run on a host's CPU."""

    boot_id: str            # the running kernel's boot id (the host name where there is none)
    cores: frozenset[int]   # the physical cores it may run on, each as its lowest CPU id
    threads: int            # threads its forwards use

    def __post_init__(self) -> None:
        if not self.boot_id or not self.cores or self.threads < 1:
            raise ValueError(f"a CPU placement needs a boot id, cores and >= 1 thread, got {self}")


def boot_id() -> str:
    """This kernel's boot id, or the host name where the kernel does not publish one."""
    try:
        return BOOT_ID_PATH.read_text(encoding="ascii").strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def allowed_cpus() -> frozenset[int]:
    """The CPU ids this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU ids from the kernel's list format: "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def core_of(cpu: int, topology: Path = CPU_TOPOLOGY) -> int:
    """The physical core of a CPU id, named by its lowest sibling (the CPU itself where the
    kernel publishes no topology)."""
    try:
        siblings = parse_cpu_list((topology / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
    except (OSError, ValueError):
        return cpu
    return min(siblings, default=cpu)


def this_placement(threads: int) -> CpuPlacement:
    """Where a service of this process whose forwards use `threads` threads runs."""
    return CpuPlacement(boot_id(), frozenset(core_of(cpu) for cpu in allowed_cpus()), max(1, threads))


def compete(a: CpuPlacement | None, b: CpuPlacement | None) -> bool:
    """Whether forwards of the two run at once slow each other: the same kernel, overlapping
    cores, more threads than those cores. None (an accelerator) competes with nothing."""
    if a is None or b is None or a.boot_id != b.boot_id or not a.cores & b.cores:
        return False
    return a.threads + b.threads > len(a.cores | b.cores)
