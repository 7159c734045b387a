"""torch's matrix-vector paths against the machine's memory bandwidth: what bounds a decode step.

Usage:
  python bench/matvec.py [--threads 2] [--rows 8960] [--cols 1536] [--repeats 200]

A decode step of a transformer is a chain of matrix-vector products (one token times each
weight matrix), so the GB/s torch reaches on one of them bounds the step. For a weight of the
target's MLP shape (8960 × 1536 by default) it times, with the same threads: F.linear in
bfloat16 and float32, torch.mv, a torch.compile'd F.linear, and the weight-only int8 kernel
(`aten._weight_int8pack_mm`, what `--quantize int8` uses), each as the bytes of its weight over
its median time, beside the bandwidth measured in the same run (bench/engines.py's probe).
Writes bench/results/matvec.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.engines import bandwidth_gbs  # noqa: E402


def median_seconds(run: Callable[[], object], repeats: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paths(rows: int, cols: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (one product, bytes of weight it reads)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=generator).to(torch.bfloat16)  # [out, in]
    x = torch.randn(1, cols, generator=generator).to(torch.bfloat16)  # [1, in]
    weight32, x32 = weight.float(), x.float()
    weight8 = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)  # [out, in]
    scale = torch.rand(rows, generator=generator).to(torch.bfloat16)  # [out]
    compiled = torch.compile(F.linear)
    out = {"F.linear bfloat16": (lambda: F.linear(x, weight), weight.nbytes),
           "torch.mv bfloat16": (lambda: torch.mv(weight, x[0]), weight.nbytes),
           "F.linear float32": (lambda: F.linear(x32, weight32), weight32.nbytes),
           "int8 weight-only": (lambda: torch.ops.aten._weight_int8pack_mm(x, weight8, scale), weight8.nbytes)}
    try:
        compiled(x, weight)
        out["torch.compile F.linear bfloat16"] = (lambda: compiled(x, weight), weight.nbytes)
    except Exception as exc:  # no C++ compiler for inductor: leave the row out, say why
        print(f"torch.compile unavailable here: {type(exc).__name__}: {str(exc)[:120]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8960)
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    bandwidth = bandwidth_gbs(args.threads)
    torch.set_num_threads(args.threads)
    rows = []
    for name, (run, size) in paths(args.rows, args.cols).items():
        seconds = median_seconds(run, args.repeats)
        rows.append({"path": name, "weight_bytes": size, "seconds": seconds, "gbs": size / seconds / 1e9,
                     "fraction": size / seconds / 1e9 / bandwidth})
    lines = [f"{args.rows} x {args.cols} weight, {args.threads} threads, cpu {torch.backends.cpu.get_cpu_capability()};"
             f" memory bandwidth measured here: {bandwidth:.1f} GB/s",
             f"{'path':<32} {'weight MB':>9} {'ms':>8} {'GB/s':>6} {'of bw':>6}"]
    lines += [f"{r['path']:<32} {r['weight_bytes'] / 1e6:>9.1f} {r['seconds'] * 1e3:>8.3f} {r['gbs']:>6.1f} "
              f"{r['fraction']:>6.0%}" for r in rows]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matvec.txt").write_text(text + "\n")
    (out / "matvec.json").write_text(json.dumps({"bandwidth_gbs": bandwidth, "threads": args.threads,
                                                 "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                                 "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
