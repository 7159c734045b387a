"""The engines against the machine's memory bandwidth: one decode step and one (γ+1)-token
verification of each model, on each backend and dtype available here.

Usage:
  python bench/engines.py                       # the fetched real pair (specdec models fetch)
  python bench/engines.py --tiny                # a tiny random pair: a smoke run
  python bench/engines.py --threads 2 --gamma 4 --repeats 15
  python bench/engines.py --dtypes bfloat16 --prepack on,off --quantize none,int8,int4

A decode step reads every weight once, so at small batch it is bound by memory: its ideal time
is (bytes of weights) / (bandwidth). The bandwidth is measured in the same run (a large tensor
read by torch with the same threads, before and after the steps; the higher of the two, since
other work on the cores only lowers a probe), and each step's fraction of it is reported. Per backend,
model and dtype: weight bytes, decode-step and verify times (median of --repeats, the two
interleaved), GB/s each reaches and its fraction of the measured bandwidth. The torch variants of
one model (--prepack on/off: oneDNN-packed bfloat16 linears or F.linear; --quantize: weight-only
int8 or int4 linears, a different model) are loaded together and their repeats interleaved, so
their ratios come from the same moments of the run. A table is printed;
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
from specdec.runtime.engines import llama_cpp_installed, engine_from_config  # noqa: E402
from specdec.types import Quantization  # noqa: E402

PROMPT_TOKENS = 64
DEFAULT_DTYPES = "bfloat16,float32"


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


def weight_bytes(engine) -> int:
    """Bytes of weights one forward reads: a torch model's parameters and buffers but its input
    embeddings (a forward gathers a few rows of them) unless the head is that same tensor; or the
    GGUF's tensors."""
    if hasattr(engine, "llama"):
        return int(engine.llama.llama_model_size(engine.model))
    model = engine.model
    embeddings = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)  # a packed or quantized head has none
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t is not embeddings or head is t]
    seen, total = set(), 0
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.data_ptr()  # a oneDNN-packed tensor has no data pointer
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def session_prompt(engine, gamma: int) -> tuple[object, list[int]]:
    """A session of PROMPT_TOKENS tokens begun on `engine` -> (its cache entry, those tokens and
    the γ+1 after them)."""
    high = min(engine.embedding_size, engine.vocab_size) - 1
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, high, (PROMPT_TOKENS + gamma + 1,), generator=generator).tolist()
    entry, feed = engine.begin("bench", 0, 0, prompt[:PROMPT_TOKENS])
    engine.forward("bench", entry, feed, 1)
    return entry, prompt


def time_steps(engines: list, gamma: int, repeats: int) -> list[tuple[float, float]]:
    """Per engine, median seconds of one decode step (1 token) and one verification (γ+1 tokens)
    of a session holding PROMPT_TOKENS tokens; each rolled back after timing, the steps of all
    engines interleaved within each repeat."""
    sessions = [session_prompt(engine, gamma) for engine in engines]
    steps, verifies = [[] for _ in engines], [[] for _ in engines]
    for _ in range(repeats + 1):  # the first of each warms up
        for engine, (entry, prompt), step, verify in zip(engines, sessions, steps, verifies):
            for tokens, sink in ((prompt[PROMPT_TOKENS:PROMPT_TOKENS + 1], step),
                                 (prompt[PROMPT_TOKENS:], verify)):
                start = time.perf_counter()
                engine.forward("bench", entry, tokens, len(tokens))
                sink.append(time.perf_counter() - start)
                entry.crop(PROMPT_TOKENS)
    for engine in engines:
        engine.release("bench")
    return [(statistics.median(s[1:]), statistics.median(v[1:])) for s, v in zip(steps, verifies)]


def torch_variants(args) -> list[dict]:
    """The torch variants of one model --prepack and --quantize ask for: packing only changes an
    unquantized model, so a quantized one is a single variant."""
    variants = []
    for quantize in args.quantize.split(","):
        prepacks = [p == "on" for p in args.prepack.split(",")] if quantize == Quantization.NONE else [False]
        variants += [{"quantize": quantize, "prepack": prepack} for prepack in prepacks]
    return variants


def configurations(args) -> list[list[dict]]:
    """Groups of (backend, dtype, role, model, variant) rows for what is available here; the rows of
    a group are measured together."""
    groups = []
    if args.tiny:
        from specdec_cli.tiny import build_pair
        from tests.gguf_writer import write_llama_gguf

        root = Path(tempfile.mkdtemp(prefix="specdec-engines-"))
        draft, target = build_pair(root, "llama", context=4096, layers=4, width=64)
        dirs = {"draft": str(draft), "target": str(target)}
        ggufs = {role: str(write_llama_gguf(path, root / f"{role}.gguf")) for role, path in dirs.items()}
        dtypes = ["float32"] if args.dtypes == DEFAULT_DTYPES else args.dtypes.split(",")
    else:
        from specdec_cli.model_pair import default_gguf_pair, default_pair

        dirs = {k: str(v) for k, v in default_pair().items()}
        ggufs = {k: str(v) for k, v in default_gguf_pair().items()}
        dtypes = args.dtypes.split(",")
    for role in args.roles.split(","):
        for dtype in dtypes:
            groups.append([{"backend": "torch", "dtype": dtype, "role": role, "model": dirs[role], **variant}
                           for variant in torch_variants(args)])
        if llama_cpp_installed() and not args.no_llama_cpp:
            groups.append([{"backend": "llama.cpp", "dtype": "gguf", "role": role, "model": ggufs[role],
                            "quantize": "gguf", "prepack": False}])
    return groups


def load(row: dict, args):
    config = TargetConfig(model=row["model"], backend=row["backend"], dtype=row["dtype"] if row["dtype"] != "gguf"
                          else "float32", threads=args.threads, max_speculative_tokens=max(16, args.gamma + 1),
                          prepack=row["prepack"], quantize=row["quantize"] if row["backend"] == "torch"
                          else Quantization.NONE)
    return engine_from_config(config)


def measure(group: list[dict], args) -> list[dict]:
    """Load every row of the group, time their steps interleaved, and release them."""
    engines = [load(row, args) for row in group]
    torch.set_num_threads(args.threads)
    times = time_steps(engines, args.gamma, args.repeats)
    rows = []
    for row, engine, (step, verify) in zip(group, engines, times):
        size = weight_bytes(engine)
        rows.append({**row, "weight_bytes": size, "decode_step_s": step, "verify_s": verify,
                     "decode_gbs": size / step / 1e9, "verify_gbs": size / verify / 1e9})
        if hasattr(engine, "close"):
            engine.close()
    return rows


def variant_label(row: dict) -> str:
    if row["backend"] != "torch":
        return ""
    if row["quantize"] != Quantization.NONE:
        return f"{row['quantize']} w-only"
    return "packed" if row["prepack"] else "F.linear"


def table(rows: list[dict], bandwidth: float, gamma: int) -> str:
    lines = [f"memory bandwidth measured here: {bandwidth:.1f} GB/s; verification of γ+1 = {gamma + 1} tokens",
             f"{'backend':<10} {'dtype':<9} {'variant':<12} {'role':<7} {'weights MB':>10} {'step ms':>9} {'GB/s':>6} "
             f"{'of bw':>6} {'verify ms':>10} {'GB/s':>6} {'of bw':>6}"]
    for r in rows:
        lines.append(f"{r['backend']:<10} {r['dtype']:<9} {variant_label(r):<12} {r['role']:<7} "
                     f"{r['weight_bytes'] / 1e6:>10.0f} "
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
    labels = [f"{r['backend']}\n{r['dtype']} {variant_label(r)}\n{r['role']}" for r in rows]
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
    parser.add_argument("--dtypes", default=DEFAULT_DTYPES, help="torch dtypes, comma-separated")
    parser.add_argument("--prepack", default="on,off", help="torch variants of an unquantized model: on "
                        "(oneDNN-packed bfloat16 linears where this CPU takes them), off, or both")
    parser.add_argument("--quantize", default="none", help="torch variants: none, int8, int4 (weight-only "
                        "linears: another model), comma-separated")
    parser.add_argument("--no-llama-cpp", action="store_true", help="torch rows only")
    parser.add_argument("--roles", default="draft,target", help="models of the pair, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    bandwidth_before = bandwidth_gbs(args.threads)
    rows = [row for group in configurations(args) for row in measure(group, args)]
    bandwidth_after = bandwidth_gbs(args.threads)
    bandwidth = max(bandwidth_before, bandwidth_after)  # other work on the cores only lowers a probe
    for row in rows:
        row.update(decode_fraction=row["decode_gbs"] / bandwidth, verify_fraction=row["verify_gbs"] / bandwidth)
    text = (table(rows, bandwidth, args.gamma) + f"\nbandwidth probes: {bandwidth_before:.1f} GB/s before the "
            f"steps, {bandwidth_after:.1f} after; fractions are of the higher")
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines.txt").write_text(text + "\n")
    (out / "engines.json").write_text(json.dumps({"bandwidth_gbs": bandwidth, "bandwidth_before_gbs": bandwidth_before,
                                                  "bandwidth_after_gbs": bandwidth_after,
                                                  "gamma": args.gamma,
                                                  "threads": args.threads, "rows": rows}, indent=2))
    plot(rows, out / "engines.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
