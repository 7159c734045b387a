"""The engines against the machine's memory bandwidth: one decode step and one (γ+1)-token
verification of each model, on each backend and dtype available here.

Usage:
  python bench/engines.py                       # the fetched real pair (specdec models fetch)
  python bench/engines.py --tiny                # a tiny random pair: a smoke run
  python bench/engines.py --threads 2 --gamma 4 --repeats 15

A decode step reads every weight once, so at small batch it is bound by memory: its ideal time
is (bytes of weights) / (bandwidth). The bandwidth is measured in the same run (a large tensor
read by torch with the same threads), and each step's fraction of it is reported. Per backend,
model and dtype: weight bytes, decode-step and verify times (median of --repeats, the two
interleaved), GB/s each reaches and its fraction of the measured bandwidth. A table is printed;
engines.json, engines.txt and engines.png go to bench/results/. The decode rates through the
three services (target-only and speculative), beside llama.cpp's own llama-server plain and
with the draft, come from bench/speedup.py, run on the same files:
  python bench/speedup.py --quick --no-hf --draft-model DRAFT.gguf --target-model TARGET.gguf \
      --llama-server PATH
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.config import TargetConfig  # noqa: E402
from specdec.runtime.engines import llama_cpp_installed, runner_from_config  # noqa: E402

PROMPT_TOKENS = 64


def bandwidth_gbs(threads: int, gib: float = 1.0, repeats: int = 7) -> float:
    """Best read bandwidth of a large float32 tensor summed by torch (GB/s)."""
    torch.set_num_threads(threads)
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def weight_bytes(runner) -> int:
    """Bytes of weights one forward reads: a torch model's parameters and buffers, or the GGUF's tensors."""
    if hasattr(runner, "llama"):
        return int(runner.llama.llama_model_size(runner.model))
    model = runner.model
    tensors = list(model.parameters()) + list(model.buffers())
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def time_steps(runner, gamma: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one decode step (1 token) and one verification (γ+1 tokens) of a
    session holding PROMPT_TOKENS tokens; each rolled back after timing, the two interleaved."""
    high = min(runner.embedding_size, runner.vocab_size) - 1
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, high, (PROMPT_TOKENS + gamma + 1,), generator=generator).tolist()
    entry, feed = runner.begin("bench", 0, 0, prompt[:PROMPT_TOKENS])
    runner.forward("bench", entry, feed, 1)
    steps, verifies = [], []
    for _ in range(repeats + 1):  # the first of each warms up
        for tokens, sink in ((prompt[PROMPT_TOKENS:PROMPT_TOKENS + 1], steps),
                             (prompt[PROMPT_TOKENS:], verifies)):
            start = time.perf_counter()
            runner.forward("bench", entry, tokens, len(tokens))
            sink.append(time.perf_counter() - start)
            entry.crop(PROMPT_TOKENS)
    runner.release("bench")
    return statistics.median(steps[1:]), statistics.median(verifies[1:])


def configurations(args) -> list[dict]:
    """(backend, dtype, role, model) rows for what is available here."""
    rows = []
    if args.tiny:
        from specdec.tiny import build_pair
        from tests.gguf_writer import write_llama_gguf

        root = Path(tempfile.mkdtemp(prefix="specdec-engines-"))
        draft, target = build_pair(root, "llama", context=4096, layers=4, width=64)
        dirs = {"draft": str(draft), "target": str(target)}
        ggufs = {role: str(write_llama_gguf(path, root / f"{role}.gguf")) for role, path in dirs.items()}
        dtypes = ["float32"]
    else:
        from specdec.models import default_gguf_pair, default_pair

        dirs = {k: str(v) for k, v in default_pair().items()}
        ggufs = {k: str(v) for k, v in default_gguf_pair().items()}
        dtypes = args.dtypes.split(",")
    for role in ("draft", "target"):
        for dtype in dtypes:
            rows.append({"backend": "torch", "dtype": dtype, "role": role, "model": dirs[role]})
        if llama_cpp_installed():
            rows.append({"backend": "llama.cpp", "dtype": "gguf", "role": role, "model": ggufs[role]})
    return rows


def measure(row: dict, args, bandwidth: float) -> dict:
    config = TargetConfig(model=row["model"], backend=row["backend"], dtype=row["dtype"] if row["dtype"] != "gguf"
                          else "float32", threads=args.threads, max_speculative_tokens=max(16, args.gamma + 1))
    runner = runner_from_config(config)
    torch.set_num_threads(args.threads)
    size = weight_bytes(runner)
    step, verify = time_steps(runner, args.gamma, args.repeats)
    if hasattr(runner, "close"):
        runner.close()
    return {**row, "weight_bytes": size, "decode_step_s": step, "verify_s": verify,
            "decode_gbs": size / step / 1e9, "verify_gbs": size / verify / 1e9,
            "decode_fraction": size / step / 1e9 / bandwidth, "verify_fraction": size / verify / 1e9 / bandwidth}


def table(rows: list[dict], bandwidth: float, gamma: int) -> str:
    lines = [f"memory bandwidth measured here: {bandwidth:.1f} GB/s; verification of γ+1 = {gamma + 1} tokens",
             f"{'backend':<10} {'dtype':<9} {'role':<7} {'weights MB':>10} {'step ms':>9} {'GB/s':>6} "
             f"{'of bw':>6} {'verify ms':>10} {'GB/s':>6} {'of bw':>6}"]
    for r in rows:
        lines.append(f"{r['backend']:<10} {r['dtype']:<9} {r['role']:<7} {r['weight_bytes'] / 1e6:>10.0f} "
                     f"{r['decode_step_s'] * 1e3:>9.2f} {r['decode_gbs']:>6.1f} {r['decode_fraction']:>6.0%} "
                     f"{r['verify_s'] * 1e3:>10.2f} {r['verify_gbs']:>6.1f} {r['verify_fraction']:>6.0%}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['backend']}\n{r['dtype']}\n{r['role']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.2), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["decode_fraction"] * 100 for r in rows], 0.4, label="decode step")
    ax.bar([x + 0.2 for x in xs], [r["verify_fraction"] * 100 for r in rows], 0.4, label="verification")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("% of measured memory bandwidth")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random pair built here (smoke test)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="torch dtypes, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    bandwidth = bandwidth_gbs(args.threads)
    rows = [measure(row, args, bandwidth) for row in configurations(args)]
    text = table(rows, bandwidth, args.gamma)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines.txt").write_text(text + "\n")
    (out / "engines.json").write_text(json.dumps({"bandwidth_gbs": bandwidth, "gamma": args.gamma,
                                                  "threads": args.threads, "rows": rows}, indent=2))
    plot(rows, out / "engines.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
