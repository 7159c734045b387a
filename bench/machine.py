"""The machine a benchmark ran on: CPU model, cores, memory, measured memory bandwidth, load.

Usage:
  python bench/machine.py                                   # print it, write bench/results/machine.json
  python bench/machine.py --out docs/figures/machine.json   # the record docs/benchmarks.md cites

A figure is only comparable with another taken on the same machine, and a decode step on a CPU
is bound by how fast it reads its weights, so the bandwidth is measured, not looked up: a 1 GiB
float32 tensor summed by torch (bench/engines.py's probe, the best of --repeats), with one thread
and with every core, --probes times each, spread over the run. Other work on the cores only
lowers a probe, so the highest is the machine's and the spread says how quiet it was; the load
average before and after is recorded too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.engines import bandwidth_gbs  # noqa: E402


def lscpu() -> dict[str, str]:
    """lscpu's fields (empty where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in text.splitlines()) if value}


def memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def vector_extensions(flags: str) -> list[str]:
    """The SIMD extensions that decide which CPU kernels torch and llama.cpp can use."""
    wanted = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx_vnni")
    have = set(flags.split())
    return [flag for flag in wanted if flag in have]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=3, help="bandwidth probes per thread count")
    parser.add_argument("--repeats", type=int, default=7, help="reads per probe (the best counts)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "machine.json"))
    args = parser.parse_args()

    cpu = lscpu()
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    probes: dict[str, list[float]] = {"1": [], str(cores): []}
    for _ in range(args.probes):
        for threads in (1, cores):
            probes[str(threads)].append(round(bandwidth_gbs(threads, repeats=args.repeats), 1))
    load_after = os.getloadavg()
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "cpu_model": cpu.get("Model name", platform.processor()),
        "cpu_family_model": f"{cpu.get('CPU family', '?')}/{cpu.get('Model', '?')}",
        "hypervisor": cpu.get("Hypervisor vendor", ""),
        "cores": cores,
        "l3": cpu.get("L3 cache", ""),
        "vector_extensions": vector_extensions(cpu.get("Flags", "")),
        "memory_gib": round(memory_gib(), 1),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "bandwidth_probes_gbs": probes,
        "bandwidth_gbs": max(max(values) for values in probes.values()),
        "load_average_before": [round(value, 2) for value in load_before],
        "load_average_after": [round(value, 2) for value in load_after],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    for key, value in record.items():
        print(f"{key:22} {value}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
