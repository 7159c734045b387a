"""How many CUDA graphs the graph engine captures per service, and its logits outputs' bytes,
before and after issue 48 — computed on any machine (nothing is captured).

Usage:
  python bench/gpu_graphs.py          # a table; --json for the rows

bench/gpu.py's services batch up to 64 sessions and allow 16 speculative tokens; its models'
context is 2048 (bench/gpu_models.CONTEXT); a 32k-context checkpoint is shown beside. Before:
ladders that grew by 2 (rows 1..64, tokens 1, 2, 4, 8, 16, blocks from 8) and one [rows, tokens,
vocab] logits output per bucket. After: specdec/runtime/graph/buckets.py's defaults and one
shared logits buffer per engine. Bytes are bfloat16.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_models import CONTEXT, QWEN_VOCAB  # noqa: E402
from specdec.runtime.graph.buckets import (Buckets, context_blocks, count_graphs, logits_buffer_bytes,  # noqa: E402
                                           loop_steps, per_bucket_logits_bytes, service_buckets)

MAX_BATCH = 64  # bench/gpu.py's services (SPECDEC_*_MAX_BATCH_SIZE: its largest level)
MAX_SPECULATIVE = 16  # the services' default --max-speculative-tokens
BF16 = 2  # bytes per element
CASES = (("7b", CONTEXT), ("1.5b", CONTEXT), ("7b", 32768))  # (shape, context tokens)


def old_buckets(max_batch: int, context: int, block_size: int = 16) -> Buckets:
    """The buckets before issue 48: ladders by 2, every rows count up to max_batch."""
    rows = tuple(r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max(1, max_batch))
    return Buckets(rows=rows, tokens=(1, 2, 4, 8, 16), blocks=context_blocks(-(-context // block_size), 8, 2))


def row(buckets: Buckets, vocab: int, shared: bool) -> dict:
    """One service's counts (target; a draft adds its loop) and logits bytes."""
    steps = loop_steps(MAX_SPECULATIVE)
    return {"target_graphs": count_graphs(buckets).total, "draft_graphs": count_graphs(buckets, steps).total,
            "logits_bytes": (logits_buffer_bytes if shared else per_bucket_logits_bytes)(buckets, vocab, BF16)}


def figures() -> list[dict]:
    """Per case: before and after (graphs per target and per draft service, logits bytes per service)."""
    out = []
    for shape, context in CASES:
        out.append({"shape": shape, "context": context,
                    "before": row(old_buckets(MAX_BATCH, context), QWEN_VOCAB, False),
                    "after": row(service_buckets(MAX_BATCH, context), QWEN_VOCAB, True)})
    return out


def table(rows: list[dict]) -> str:
    lines = ["shape  context  target graphs  draft graphs  graphs per run*  logits per service (bf16)",
             "                before → after before → after  before → after   before → after"]
    for r in rows:
        b, a = r["before"], r["after"]
        per_run = lambda x: 2 * (x["target_graphs"] + x["draft_graphs"])  # noqa: E731 - two service sets
        lines.append(f"{r['shape']:<6} {r['context']:>7}  {b['target_graphs']:>5} → {a['target_graphs']:<5}  "
                     f"{b['draft_graphs']:>5} → {a['draft_graphs']:<5}  {per_run(b):>6} → {per_run(a):<6}  "
                     f"{b['logits_bytes'] / 2**30:6.2f} → {a['logits_bytes'] / 2**30:.2f} GiB")
    lines.append("* bench/gpu.py starts two sets (the self-draft's and the independent draft's), each a target "
                 "and a draft, for each shape")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = figures()
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
