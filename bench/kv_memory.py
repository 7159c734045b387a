"""KV memory: bytes a session's K/V cache holds per token, against the model's theoretical size.

Usage:
  python bench/kv_memory.py                        # the fetched real pair, else a tiny random model
  python bench/kv_memory.py --model DIR [--dtype bfloat16] [--lengths 100,1000,4000]

Theory: layers x 2 (K and V) x num_key_value_heads x head_dim x dtype bytes per token, read
from the model's config. The model is loaded and run through the services' own code path
(specdec.runtime: load_model, TorchEngine, SessionCaches): each session is prefilled in
prefill_chunk steps, decodes --decode-steps tokens one at a time, then rolls back
--rollback tokens the way a rejected draft does (`TorchEngine.begin` with a shorter prefix).
Per session it reports the tokens held, the bytes the cache accounts for it (what
specdec_kv_cache_bytes sums and the --kv-cache-bytes budget is checked against), the bytes its
tensors' storages actually allocate, the theoretical bytes, and the ratios. Allocated above
theory is the buffers' growth slack (a growth reserves a sixteenth more, at least 4 tokens: see
specdec/runtime/kv_cache.py) plus the tokens a rollback gave back. Prints a table,
writes bench/results/kv_memory.json and kv_memory.png.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
TOLERANCE = 0.10  # the target: within 10% of theory


def kv_geometry(config: Any) -> dict[str, int]:
    """(layers, kv_heads, head_dim) of a transformers config (Llama/Qwen/Mistral style, GPT-2)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return {"layers": int(layers), "kv_heads": int(kv_heads), "head_dim": int(head_dim)}


def theoretical_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """layers x 2 (K and V) x kv_heads x head_dim x bytes per element."""
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def model_bytes_per_token(model_dir: str, dtype: str) -> int:
    """The theoretical K/V bytes of one token of a saved model at `dtype` (its config only)."""
    from transformers import AutoConfig

    return theoretical_bytes_per_token(**kv_geometry(AutoConfig.from_pretrained(model_dir)),
                                       dtype_bytes=DTYPE_BYTES[dtype])


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def cache_tensors(entry: Any) -> list[Any]:
    """The tensors holding a SessionCache's K/V (its buffer, or its DynamicCache's layers)."""
    kv = entry.kv
    if hasattr(kv, "data"):  # KVBuffer
        return [kv.data]
    return [getattr(layer, name, None) for layer in getattr(kv.cache, "layers", []) for name in ("keys", "values")]


def summarise(label: str, held: int, accounted: int, allocated: int, per_token: int) -> dict:
    theory = held * per_token
    return {"session": label, "tokens_held": held, "accounted_bytes": accounted, "allocated_bytes": allocated,
            "theoretical_bytes": theory, "accounted_over_theory": accounted / theory if theory else float("nan"),
            "allocated_over_theory": allocated / theory if theory else float("nan"),
            "allocated_per_token": allocated / held if held else float("nan"),
            "within_tolerance": bool(theory) and allocated <= (1 + TOLERANCE) * theory}


# ---- running sessions through the engine ------------------------------------------------------

def run_session(engine: Any, session_id: str, length: int, decode_steps: int, rollback: int,
                per_token: int, rng: random.Random) -> list[dict]:
    """Prefill `length` tokens, decode, roll back; a measurement after each phase."""
    high = min(engine.vocab_size, engine.embedding_size)
    sequence = [rng.randrange(1, high) for _ in range(length)]
    held = 0
    while held < length:  # the services' chunked prefill: one prefill_chunk per step
        held, _ = engine.prefill_step(session_id, sequence, length)
    entry = engine.caches.get(session_id)
    out = [measure(engine, session_id, f"{length}: prefill", per_token)]
    for _ in range(decode_steps):
        engine.forward(session_id, entry, [rng.randrange(1, high)], 1)
        engine.finish(session_id)
    out.append(measure(engine, session_id, f"{length}: +{decode_steps} decode", per_token))
    keep = len(entry) - rollback
    # a rejected draft: the next call assumes the shorter prefix and the engine crops to it
    entry, _ = engine.begin(session_id, keep, entry.hashes.at(keep), [rng.randrange(1, high)])
    engine.finish(session_id)
    out.append(measure(engine, session_id, f"{length}: -{rollback} rollback", per_token))
    return out


def measure(engine: Any, session_id: str, label: str, per_token: int) -> dict:
    entry = engine.caches.get(session_id)
    return summarise(label, len(entry), entry.accounted, storage_bytes(cache_tensors(entry)), per_token)


def measure_model(model_dir: str, role: str, dtype: str, device: str, lengths: list[int], decode_steps: int,
                  rollback: int) -> dict:
    from specdec.runtime.kv_cache import SessionCaches
    from specdec.runtime.loader import load_model
    from specdec.runtime.torch.engine import TorchEngine

    loaded = load_model(model_dir, dtype, device)
    engine = TorchEngine(loaded, SessionCaches(1024, 1 << 62), 16)
    geometry = kv_geometry(loaded.model.config)
    per_token = theoretical_bytes_per_token(**geometry, dtype_bytes=DTYPE_BYTES[dtype])
    rng = random.Random(0)
    longest = engine.context_length - decode_steps - 1
    rows: list[dict] = []
    skipped = [n for n in lengths if n > longest]
    sessions = [f"s{i}" for i, n in enumerate(lengths) if n <= longest]
    for session_id, length in zip(sessions, (n for n in lengths if n <= longest)):
        rows.extend(run_session(engine, session_id, length, decode_steps, rollback, per_token, rng))
    entries = [engine.caches.get(s) for s in sessions]
    total = summarise("all sessions", sum(len(e) for e in entries), engine.caches.total_bytes(),
                      sum(storage_bytes(cache_tensors(e)) for e in entries), per_token)
    return {"role": role, "model": model_dir, "dtype": dtype, "device": device, **geometry,
            "theoretical_bytes_per_token": per_token,
            "runner_bytes_per_token": engine.kv_spec.bytes_per_token if engine.kv_spec else None,
            "cache_kind": "buffer" if engine.kv_spec else "DynamicCache",
            "context_length": engine.context_length, "skipped_lengths": skipped, "sessions": rows, "total": total}


def pick_models(args) -> tuple[list[tuple[str, str]], str]:
    """([(role, model dir)], what they are)."""
    if args.model:
        return [("model", args.model)], "given"
    from specdec_cli.model_pair import FetchError, default_pair

    try:
        pair = default_pair()
        return [("draft", str(pair["draft"])), ("target", str(pair["target"]))], "the fetched real pair"
    except FetchError:
        from specdec_cli import tiny

        root = Path(tempfile.mkdtemp(prefix="specdec-kv-"))
        draft, target = tiny.build_pair(root, width=64, layers=4, context=max(args.lengths_list) + 64)
        print(f"no real pair fetched: using a TINY RANDOM pair (width 64, target 4 layers) under {root}")
        return [("draft", str(draft)), ("target", str(target))], "tiny random pair (width 64, 4 / 1 layers)"


# ---- report -----------------------------------------------------------------------------------

def table(models: list[dict]) -> str:
    lines = []
    for m in models:
        lines.append(f"\n{m['role']}: {m['model']} ({m['dtype']}, {m['cache_kind']}): {m['layers']} layers x 2 x "
                     f"{m['kv_heads']} kv heads x {m['head_dim']} head dim x {DTYPE_BYTES[m['dtype']]} B = "
                     f"{m['theoretical_bytes_per_token']} B/token (engine: {m['runner_bytes_per_token']})")
        lines.append(f"{'session':<24} {'tokens':>7} {'accounted':>12} {'allocated':>12} {'theory':>12} "
                     f"{'acc/theory':>10} {'alloc/theory':>12} {'B/token':>9}")
        for row in m["sessions"] + [m["total"]]:
            flag = "" if row["allocated_over_theory"] <= 1 + TOLERANCE else "  > +10%"
            lines.append(f"{row['session']:<24} {row['tokens_held']:>7} {row['accounted_bytes']:>12} "
                         f"{row['allocated_bytes']:>12} {row['theoretical_bytes']:>12} "
                         f"{row['accounted_over_theory']:>10.3f} {row['allocated_over_theory']:>12.3f} "
                         f"{row['allocated_per_token']:>9.0f}{flag}")
        if m["skipped_lengths"]:
            lines.append(f"skipped (longer than the context of {m['context_length']}): {m['skipped_lengths']}")
    lines.append("accounted = what the cache counts against --kv-cache-bytes (specdec_kv_cache_bytes); allocated "
                 "= the storages' bytes; theory = tokens held x theoretical B/token. Above 1: the buffer's "
                 "growth slack (a growth reserves 1/16 more, at least 4 tokens) and tokens a rollback gave back")
    return "\n".join(lines)


def plot(models: list[dict], path: Path, what: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for m in models:
        rows = m["sessions"]
        ax.plot([r["tokens_held"] for r in rows], [r["allocated_over_theory"] for r in rows], marker="o",
                linestyle="", label=f"{m['role']} allocated")
        ax.plot([r["tokens_held"] for r in rows], [r["accounted_over_theory"] for r in rows], marker="x",
                linestyle="", label=f"{m['role']} accounted")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.axhline(1.0 + TOLERANCE, color="red", linestyle="--", linewidth=1, label="theory + 10%")
    ax.set_xscale("log")
    ax.set_xlabel("tokens held by the session")
    ax.set_ylabel("KV bytes / theoretical bytes")
    ax.set_title(f"specdec KV memory per session ({what})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="one model directory (default: the fetched pair, else tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", default="100,1000,4000", help="prompt tokens of each session")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--rollback", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    args.lengths_list = [int(n) for n in args.lengths.split(",")]
    if args.rollback > args.decode_steps:
        parser.error("--rollback must be at most --decode-steps")
    models, what = pick_models(args)
    results = [measure_model(path, role, args.dtype, args.device, args.lengths_list, args.decode_steps,
                             args.rollback) for role, path in models]
    print(table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_memory.json").write_text(json.dumps({"models": what, "tolerance": TOLERANCE, "results": results},
                                                   indent=2))
    drawn = plot(results, out / "kv_memory.png", what)
    print(f"wrote {out / 'kv_memory.json'}" + (f" and {out / 'kv_memory.png'}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
