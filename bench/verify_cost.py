"""The target's verification cost curve: one forward of n tokens after a history, n = 1..64.

Usage:
  python bench/verify_cost.py [--target-model T] [--dtype bfloat16] [--history 512]
                              [--sizes 1,2,4,8,12,16,24,32,48,64] [--repeats 5] [--tiny]
  python bench/verify_cost.py --heads DIR [DIR ...] --sizes 1,4,8,16   # ... and each heads' proposals

A tree verification costs one forward over its nodes, so where this curve is flat a round can
verify a tree of several branches for the price of a chain. The target runs in this process on
the engine the services use (specdec.runtime.torch.engine.TorchEngine, its K/V buffers), each size as
a tree of that many nodes (two branches) after a --history-token session; sizes are interleaved
over --repeats rounds and the median counts. With --heads, after each forward every heads
directory (trained for this target) proposes 4 candidates a head from one hidden state, as a
Verify that asks for them does (TargetHeads.proposals: the heads, the output layer or their
proposal vocabulary's rows, softmax, top-k, one host read): its time beside the forward's. Prints
a table; writes verify_cost.json (and a PNG with matplotlib) under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def heads_of(target: str, dtype: str, directory: str):
    """The heads in `directory` as a target service serves them (target_heads.TargetHeads), on
    a copy of the target loaded with them (their rows packed as the service packs them)."""
    from specdec.runtime.loader import load_model
    from specdec.runtime.target_heads import TargetHeads

    loaded = load_model(target, dtype, heads=directory)
    return TargetHeads.of(loaded.heads, loaded.model.get_output_embeddings())


def two_branches(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Tokens and parents of an n-node tree of two chains under the root (a chain when n is 1)."""
    left = (n + 1) // 2
    parents = [0] + list(range(1, left))
    if n > left:
        parents += [0] + list(range(left + 1, n))
    return tuple(range(1, 1 + n)), tuple(parents)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-model", default="")
    parser.add_argument("--draft-model", default="", help=argparse.SUPPRESS)  # model_pair's other half
    parser.add_argument("--tiny", action="store_true", help="a tiny random model built here (smoke test)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--history", type=int, default=512, help="tokens the session holds before the forward")
    parser.add_argument("--sizes", default="1,2,4,8,12,16,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", nargs="+", default=[], help="heads directories for this target: time their "
                                                                "proposals after each forward")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()

    import torch

    from bench.processes import model_pair
    from specdec.runtime.kv_cache import SessionCaches
    from specdec.runtime.loader import load_model
    from specdec.runtime.torch.engine import TorchEngine
    from specdec.runtime.session_kv import Row
    from specdec.maths.tree import TokenTree

    if args.threads:
        torch.set_num_threads(args.threads)
    target = args.target_model or model_pair(args, "bench/verify_cost.py", context=4096, layers=4, width=64)[1]
    sizes = [int(s) for s in args.sizes.split(",")]
    engine = TorchEngine(load_model(target, args.dtype), SessionCaches(4, 1 << 34), max(sizes))
    vocab = min(engine.vocab_size, engine.embedding_size)
    history = [(7 * i) % (vocab - 1) + 1 for i in range(args.history)]
    entry = engine.new_entry()
    engine.forward("", entry, history, 1)
    heads = {directory: heads_of(target, args.dtype, directory) for directory in args.heads}
    state = torch.randn(1, engine.model.config.hidden_size, dtype=engine.loaded.dtype)  # [1, hidden]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    heads_times: dict[str, list[float]] = {directory: [] for directory in heads}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for n in sizes:
            tokens, parents = two_branches(n)
            row = Row("", entry, [history[-1], *tokens], n + 1, TokenTree(tokens, parents))
            entry.crop(len(history) - 1)
            started = time.perf_counter()
            engine.forward_batch([row])
            times[n].append(time.perf_counter() - started)
            for directory, served in heads.items():
                started = time.perf_counter()
                served.proposals(state, [4])
                heads_times[directory].append(time.perf_counter() - started)
    medians = {n: statistics.median(t[1:]) for n, t in times.items()}
    heads_medians = {d: statistics.median(t[len(sizes):]) for d, t in heads_times.items()}
    base = medians[sizes[0]]
    lines = [f"verification cost: {target} ({args.dtype}, {torch.get_num_threads()} threads), "
             f"after {args.history} tokens", f"{'nodes':>7} {'ms':>9} {'× 1 node':>10} {'ms/token':>9}"]
    for n in sizes:
        lines.append(f"{n:>7} {medians[n] * 1000:>9.1f} {medians[n] / base:>10.2f} {medians[n] * 1000 / (n + 1):>9.2f}")
    for directory, seconds in heads_medians.items():
        vocab = heads[directory].vocab_ids
        lines.append(f"heads {directory} ({'all ids' if vocab is None else f'{vocab.numel()} ids'}): proposals "
                     f"{seconds * 1000:.1f} ms, {seconds / base:.2f}× a 1-node verification")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps(
        {"target_model": target, "dtype": args.dtype, "threads": torch.get_num_threads(), "history": args.history,
         "repeats": args.repeats, "seconds": {str(n): medians[n] for n in sizes},
         "tries": {str(n): t[1:] for n, t in times.items()},
         "heads_proposal_seconds": heads_medians}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(sizes, [medians[n] * 1000 for n in sizes], marker="o")
        ax.set_xlabel("tokens verified in one forward (tree nodes)")
        ax.set_ylabel("ms")
        ax.set_title("target verification cost")
        fig.tight_layout()
        fig.savefig(out / "verify_cost.png")
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"wrote {out / 'verify_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
