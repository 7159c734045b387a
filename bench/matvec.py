"""torch's matrix-vector paths against the machine's memory bandwidth: what bounds a decode step.

Usage:
  python bench/matvec.py [--threads 2] [--rows 8960] [--cols 1536] [--tokens 1,5,16] [--repeats 100]

A decode step of a transformer is a chain of matrix-vector products (one token times each
weight matrix), and a verification of γ+1 tokens a chain of thin matrix products, so the GB/s
torch reaches on one of them bounds the step. For a weight of the target's MLP shape
(8960 × 1536 by default) and each --tokens count it times, with the same threads:

- F.linear in bfloat16 and float32, and bfloat16 with oneDNN turned off
  (`torch.backends.mkldnn.flags(enabled=False)`: which kernel plain F.linear takes here);
- torch.mv (one token only);
- oneDNN's packed bfloat16 linear: the weight reordered once (`mkldnn._reorder_linear_weight`)
  and run by `mkldnn._linear_pointwise`, what `--prepack` does to a bfloat16 torch model;
- `torch.utils.mkldnn.to_mkldnn` of an nn.Linear (the older MKLDNN-tensor route);
- a torch.compile'd F.linear, and a torch.compile'd nn.Linear with inductor's
  `freezing = True` (the weights become constants inductor may prepack);
- weight-only int8 (`aten._weight_int8pack_mm`, `--quantize int8`) and int4
  (`aten._weight_int4pack_mm_for_cpu`, groups of --group-size, `--quantize int4`).

Each is the bytes of its weight (scales included) over its median time, beside the bandwidth
measured in the same run (bench/engines.py's probe, before and after; the higher of the two). Every path has its own weight and the
paths are interleaved within each repeat, so no weight is still in the last-level cache when
it is read again (a decode step never finds its weights there either). Writes
bench/results/matvec.{txt,json}.
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
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.engines import bandwidth_gbs  # noqa: E402
from specdec.runtime.quantize import int4_pack, int8_pack  # noqa: E402

Product = tuple[Callable[[], object], int]  # (one product, bytes of weight it reads)


def dense_paths(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Product]:
    """The unpacked products: weight [out, in] bfloat16, x [tokens, in] bfloat16."""
    weight_plain, weight_mv, weight32 = weight.clone(), weight.clone(), weight.float()  # own copies: cold caches
    x32 = x.float()

    def without_onednn() -> torch.Tensor:
        with torch.backends.mkldnn.flags(enabled=False):
            return F.linear(x, weight_plain)

    out = {"F.linear bfloat16": (lambda: F.linear(x, weight), weight.nbytes),
           "F.linear bfloat16, oneDNN off": (without_onednn, weight_plain.nbytes),
           "F.linear float32": (lambda: F.linear(x32, weight32), weight32.nbytes)}
    if x.shape[0] == 1:
        out["torch.mv bfloat16"] = (lambda: torch.mv(weight_mv, x[0]), weight_mv.nbytes)
    return out


def onednn_paths(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Product]:
    """oneDNN's packed bfloat16 linear, where this CPU and build take it (else no rows, said why)."""
    out = {}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.clone(), None)  # blocked layout
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        out["oneDNN packed bfloat16"] = (
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), weight.nbytes)
    except (RuntimeError, AttributeError) as exc:
        print(f"oneDNN packed linear unavailable here: {type(exc).__name__}: {str(exc)[:120]}")
    try:
        import torch.utils.mkldnn as mkldnn_utils

        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(weight)
        module = mkldnn_utils.to_mkldnn(linear)
        module(x)
        out["to_mkldnn nn.Linear bfloat16"] = (lambda: module(x), weight.nbytes)
    except (RuntimeError, AttributeError) as exc:
        print(f"to_mkldnn unavailable here: {type(exc).__name__}: {str(exc)[:120]}")
    return out


def compiled_paths(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Product]:
    """torch.compile'd products, plain and with inductor's freezing (compiled here, timed later)."""
    out = {}
    try:
        compiled_weight = weight.clone()
        compiled = torch.compile(F.linear, dynamic=False)
        compiled(x, compiled_weight)
        out["torch.compile F.linear bfloat16"] = (lambda: compiled(x, compiled_weight), weight.nbytes)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16).requires_grad_(False)
        linear.weight.copy_(weight)
        frozen = torch.compile(linear, dynamic=False)
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            frozen(x)

        def run_frozen() -> torch.Tensor:
            with torch.no_grad():
                return frozen(x)

        out["torch.compile, freezing, bfloat16"] = (run_frozen, weight.nbytes)
    except Exception as exc:  # no C++ compiler for inductor: leave the rows out, say why
        print(f"torch.compile unavailable here: {type(exc).__name__}: {str(exc)[:120]}")
    return out


def quantized_paths(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> dict[str, Product]:
    """Weight-only int8 (per output row) and int4 (per group of `group_size` inputs) of `weight`."""
    weight8, scale8 = int8_pack(weight)  # [out, in] int8, [out]
    weight4, scales4 = int4_pack(weight, group_size)  # packed, [in / group, out, 2]
    return {"int8 weight-only": (lambda: torch.ops.aten._weight_int8pack_mm(x, weight8, scale8),
                                 weight8.nbytes + scale8.nbytes),
            f"int4 weight-only, groups of {group_size}": (
                lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight4, group_size, scales4),
                weight4.nbytes + scales4.nbytes)}


def paths(rows: int, cols: int, tokens: int, group_size: int) -> dict[str, Product]:
    """name -> (one product of `tokens` rows, bytes of weight it reads); each path its own weight."""
    generator = torch.Generator().manual_seed(tokens)
    weight = (torch.randn(rows, cols, generator=generator) * 0.02).to(torch.bfloat16)  # [out, in]
    x = torch.randn(tokens, cols, generator=generator).to(torch.bfloat16)  # [tokens, in]
    return {**dense_paths(weight, x), **onednn_paths(weight, x), **compiled_paths(weight, x),
            **quantized_paths(weight, x, group_size)}


def interleaved_times(products: dict[str, Product], repeats: int, warmup: int = 5) -> dict[str, list[float]]:
    """Seconds of each product in each repeat, the products run in turn within a repeat."""
    for run, _ in products.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in products}
    for _ in range(repeats):
        for name, (run, _) in products.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def relative_spread(times: list[float]) -> float:
    """Interquartile range over the median: how noisy one path's repeats were."""
    quartiles = statistics.quantiles(times, n=4)
    return (quartiles[2] - quartiles[0]) / statistics.median(times)


def table(rows: list[dict], tokens: list[int]) -> list[str]:
    """One line per path: GB/s and fraction of bandwidth at each token count."""
    names = list(dict.fromkeys(r["path"] for r in rows))
    by = {(r["path"], r["tokens"]): r for r in rows}
    head = f"{'path':<36} {'weight MB':>9}" + "".join(f" {f'{t} tok ms':>10} {'GB/s':>6} {'of bw':>6}" for t in tokens)
    lines = [head]
    for name in names:
        size = next(r["weight_bytes"] for r in rows if r["path"] == name)
        line = f"{name:<36} {size / 1e6:>9.1f}"
        for t in tokens:
            r = by.get((name, t))
            line += (f" {r['seconds'] * 1e3:>10.3f} {r['gbs']:>6.1f} {r['fraction']:>6.0%}" if r
                     else f" {'':>10} {'':>6} {'':>6}")
        lines.append(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8960, help="output features of the weight")
    parser.add_argument("--cols", type=int, default=1536, help="input features of the weight")
    parser.add_argument("--tokens", default="1,5,16", help="rows of the activation, comma-separated")
    parser.add_argument("--group-size", type=int, default=32, help="int4 quantization group")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    bandwidth_before = bandwidth_gbs(args.threads)
    torch.set_num_threads(args.threads)
    rows = []
    for count in tokens:
        products = paths(args.rows, args.cols, count, args.group_size)
        times = interleaved_times(products, args.repeats)
        for name, (_, size) in products.items():
            seconds = statistics.median(times[name])
            rows.append({"path": name, "tokens": count, "weight_bytes": size, "seconds": seconds,
                         "gbs": size / seconds / 1e9, "iqr_over_median": relative_spread(times[name])})
    bandwidth_after = bandwidth_gbs(args.threads)
    bandwidth = max(bandwidth_before, bandwidth_after)  # other work on the cores only lowers a probe
    for row in rows:
        row["fraction"] = row["gbs"] / bandwidth
    lines = [f"{args.rows} x {args.cols} weight, {args.threads} threads, cpu {torch.backends.cpu.get_cpu_capability()};"
             f" memory bandwidth measured here: {bandwidth_before:.1f} GB/s before, {bandwidth_after:.1f} after"
             f" (fractions are of the higher);\nmedians of {args.repeats} interleaved repeats; interquartile range / median:"
             f" {statistics.median(r['iqr_over_median'] for r in rows):.0%} typical,"
             f" {max(r['iqr_over_median'] for r in rows):.0%} worst"] + table(rows, tokens)
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matvec.txt").write_text(text + "\n")
    (out / "matvec.json").write_text(json.dumps({"bandwidth_gbs": bandwidth, "bandwidth_before_gbs": bandwidth_before,
                                                 "bandwidth_after_gbs": bandwidth_after,
                                                 "threads": args.threads, "tokens": tokens,
                                                 "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                                 "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
