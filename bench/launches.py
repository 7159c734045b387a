"""Kernel launches and host synchronisations per step: a proxy of GPU overhead a CPU can measure.

Usage:
  python bench/launches.py                      # the tiny model and the small real-shape model
  python bench/launches.py --models tiny --repeats 1 --histories 32,256
  python bench/launches.py --gammas 1,4,8 --tree-nodes 8 --out bench/results

A decode step on a GPU that does not run as a captured graph costs a kernel launch per ATen
operation and a stall per host synchronisation; both are counted here with the torch profiler
(bench/launch_counts.py) while the services' own code runs in this process, without gRPC or the
batch scheduler: the target's `specdec.runtime.verification.HostVerification.verify_batch` and the draft's
`specdec.runtime.drafting.HostDrafting.propose_batch` over `specdec.runtime.torch.engine.TorchEngine`
(the torch engine, its K/V buffers) — each engine's own per-round work, as its `drafting()` and
`verification()` hand it to the services — and the same over the graph engine
(`specdec.runtime.graph.engine.GraphEngine`, eager on a CPU; its verification decides a
batch's chains on the device), one session, one call at a time, each call one round of a
session that grows by a token per round (--engines). The llama.cpp engine runs no torch
operations and is not counted.

Per call:
  aten ops   every ATen operation the dispatcher ran, nested ones included
  launches   of them, those that would launch a kernel on a GPU: not a metadata-only op (views,
             empty allocations, dtype queries), not a composite whose work is done by an op
             below it (aten::linear -> aten::mm counts once)
  syncs      host synchronisations a GPU would make, the sum of:
    items    aten::_local_scalar_dense: tensor.item(), int(t), float(t), bool(t) (not under
             aten::_assert_async, which a GPU checks on the device)
    reads    Tensor.tolist(), .cpu(), .numpy(): a device-to-host copy (blocking)
    sized    aten::nonzero, masked_select, unique, repeat_interleave: an output sized by data
    uploads  torch.tensor / torch.as_tensor of host data with a device: a host-to-device copy
             from pageable memory, which blocks the host until the stream has run up to it (host
             data built in pinned memory and copied with non_blocking=True is not counted)
  ms         the call's wall time on this machine, without the profiler (median)

Rows: a draft step (Propose γ=1), a Propose of γ=4 (the per-step cost is the difference over 3),
a target step (a Verify with no drafts, as a target-only round sends), Verify of each --gammas
drafts (rejected: a round of a random draft), a Verify of a --tree-nodes tree, a Propose of such a
tree 4 deep (the draft grows it one forward per depth), and sampled
(temperature 1) calls: Propose γ=4, a target step, Verify γ=4, Verify of the tree (its q
one-hot, as a rank-picked tree's). Each row at each --histories length: counts that grow
with the history are per-call work that grows with the context. Models: `tiny` (specdec_cli.tiny's
llama, width 32, 2 layers, float32) and `qwen-small` (Qwen2.5-0.5B's shape — hidden 896, 14
heads, 2 K/V heads, MLP 4864, vocabulary 151,936 — with 2 layers instead of 24, bfloat16,
random weights): per layer, a real model runs the same operations, so launches scale with its
layers. Prints a table; writes launches.json under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.launch_counts import Counts, profile_call  # noqa: E402

# ---- the models ------------------------------------------------------------------------------

QWEN_SMALL = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_model(name: str, seed: int = 0) -> tuple[Any, dict]:
    """(a random model in eval mode, a description of it) for `tiny` or `qwen-small`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from specdec_cli import tiny

    torch.manual_seed(seed)
    if name == "tiny":
        tokenizer = tiny.byte_level_tokenizer()
        config = tiny.model_config("llama", len(tokenizer), tokenizer.eos_token_id, context=4096, width=32,
                                   layers=2)
        config.initializer_range = 0.5
        dtype = torch.float32
    elif name == "qwen-small":
        config, dtype = Qwen2Config(**QWEN_SMALL), torch.bfloat16
    else:
        raise SystemExit(f"bench/launches.py: no model {name!r}; choose tiny or qwen-small")
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    shape = {"architecture": config.model_type, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
             "vocab": config.vocab_size, "dtype": str(dtype).removeprefix("torch.")}
    return model, shape


def make_engine(model: Any, backend: str = "torch") -> Any:
    """The engine of `backend` (torch: the HF engine over K/V buffers; graph: the static-shape
    model over the paged pool, eager on a CPU) over `model`, as engine_from_config builds it
    (no K/V tier)."""
    from specdec_cli import tiny
    from specdec.runtime.kv_cache import SessionCaches
    from specdec.runtime.loader import LoadedModel
    from specdec.runtime.torch.engine import TorchEngine

    loaded = LoadedModel(model, tiny.byte_level_tokenizer(), "bench", next(model.parameters()).dtype,
                         torch.device("cpu"))
    if backend == "graph":
        from specdec.runtime.graph.engine import GraphEngine

        return GraphEngine(loaded, 64, 1 << 30, 16, 512)
    if backend != "torch":
        raise SystemExit(f"bench/launches.py: no engine {backend!r}; choose torch or graph")
    return TorchEngine(loaded, SessionCaches(64, 1 << 34), max_speculative_tokens=16)


# ---- one session's rounds -----------------------------------------------------------------------


class Session:
    """A session of one service growing by a token per round: each call sends what the service
    lacks (prefix_len = tokens it holds, one new token)."""

    def __init__(self, name: str, history: list[int]):
        from specdec.fingerprint import PrefixHashes

        self.name = name
        self.held = history[:-1]
        self.next = history[-1]
        self.hashes = PrefixHashes(self.held)

    def advance(self, token: int) -> None:
        self.held.append(self.next)
        self.hashes.extend([self.next])
        self.next = token


def random_tokens(n: int, high: int, generator: torch.Generator) -> list[int]:
    return torch.randint(1, high, (n,), generator=generator).tolist()


def tree_parents(nodes: int) -> tuple[int, ...]:
    """A binary tree of `nodes` nodes listed parents first (node i's parent is node (i-1)//2;
    on the wire 0 is the root, j > 0 node j − 1)."""
    return tuple(0 if i < 2 else (i - 2) // 2 + 1 for i in range(nodes))


class Rows:
    """The calls of each row on its own session, for one model at one history length."""

    def __init__(self, engine: Any, history: int, seed: int = 0):
        self.engine = engine
        self.verifier = engine.verification()  # the engine's own per-round work, as the services run it
        self.proposer = engine.drafting(32)
        self.history = history
        self.high = min(engine.vocab_size, engine.embedding_size)
        self.generator = torch.Generator().manual_seed(seed)

    def session(self, name: str) -> Session:
        """A new session whose history the service already holds (prefilled, not counted)."""
        session = Session(name, random_tokens(self.history, self.high, self.generator))
        entry = self.engine.new_entry()
        self.engine.caches.put(name, entry)
        self.engine.forward(name, entry, session.held, 1)
        return session

    def verify(self, session: Session, drafts: int, temperature: float = 0.0, tree: int = 0) -> Callable[[], Any]:
        from specdec.types import SamplingParams, SparseDist

        tokens = random_tokens(drafts, self.high, self.generator)
        q = [SparseDist.one_hot(token) for token in tokens]
        parents = tree_parents(drafts) if tree else ()
        call = self.verifier.call(session.name, len(session.held), session.hashes.at(len(session.held)),
                                  [session.next], tokens, q, SamplingParams(temperature=temperature), 7,
                                  draft_parents=parents)

        def run() -> Any:
            verdict = self.verifier.verify_batch([call])[0]
            if isinstance(verdict, Exception):
                raise verdict
            return verdict
        return run

    def propose(self, session: Session, gamma: int, temperature: float = 0.0, tree: int = 0) -> Callable[[], Any]:
        from specdec.types import SamplingParams

        call = self.proposer.call(session.name, len(session.held), session.hashes.at(len(session.held)),
                                  [session.next], gamma, SamplingParams(temperature=temperature), 7,
                                  tree_nodes=tree)

        def run() -> Any:
            proposal = self.proposer.propose_batch([call])[0]
            if isinstance(proposal, Exception):
                raise proposal
            return proposal
        return run


@dataclass(frozen=True)
class RowSpec:
    name: str
    service: str        # "draft" | "target"
    gamma: int          # draft steps (draft) or drafts verified (target)
    temperature: float = 0.0
    tree: bool = False  # target: verify a tree of `gamma` nodes
    tree_nodes: int = 0  # draft: grow a tree of this many nodes, `gamma` deep


def row_specs(gammas: list[int], tree_nodes: int) -> list[RowSpec]:
    rows = [RowSpec("draft step (propose γ=1)", "draft", 1), RowSpec("propose γ=4", "draft", 4),
            RowSpec("target step (verify, no drafts)", "target", 0)]
    rows += [RowSpec(f"verify γ={g}", "target", g) for g in gammas]
    if tree_nodes:
        rows.append(RowSpec(f"verify tree n={tree_nodes}", "target", tree_nodes, tree=True))
        rows.append(RowSpec(f"propose tree γ=4 n={tree_nodes}", "draft", 4, tree_nodes=tree_nodes))
    rows += [RowSpec("propose γ=4 sampled", "draft", 4, 1.0), RowSpec("target step sampled", "target", 0, 1.0),
             RowSpec("verify γ=4 sampled", "target", 4, 1.0)]
    if tree_nodes:
        rows.append(RowSpec(f"verify tree n={tree_nodes} sampled", "target", tree_nodes, 1.0, tree=True))
    return rows


def measure_row(rows: Rows, spec: RowSpec, repeats: int, warmup: int = 2) -> Counts:
    """Median counts over `repeats` profiled calls, median wall time over as many unprofiled
    ones; every call is the next round of one session."""
    session = rows.session(f"{spec.service}-{spec.name}")

    def one_call() -> Callable[[], Any]:
        if spec.service == "draft":
            return rows.propose(session, spec.gamma, spec.temperature, spec.tree_nodes)
        return rows.verify(session, spec.gamma, spec.temperature, spec.tree)

    def step(result: Any) -> None:
        session.advance(result.next_token if spec.service == "target" else result.draft_tokens[0])

    for _ in range(warmup):
        step(one_call()())
    counted: list[Counts] = []
    for _ in range(repeats):
        result, counts = profile_call(one_call())
        counted.append(counts)
        step(result)
    times = []
    for _ in range(repeats):
        call = one_call()
        started = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - started)
        step(result)
    fields = {name: int(statistics.median(getattr(c, name) for c in counted))
              for name in Counts.__dataclass_fields__ if name != "ms"}
    return Counts(**fields, ms=statistics.median(times) * 1e3)


def per_draft_step(one: Counts, four: Counts) -> dict:
    """What each draft step after the first adds: (propose γ=4 − propose γ=1) / 3."""
    return {name: (getattr(four, name) - getattr(one, name)) / 3 for name in Counts.__dataclass_fields__}


# ---- the run ---------------------------------------------------------------------------------


def run(models: list[str], histories: list[int], gammas: list[int], tree_nodes: int, repeats: int,
        engines: tuple[str, ...] = ("torch",)) -> dict:
    specs = row_specs(gammas, tree_nodes)
    out: dict = {"engines": {engine: {"models": {}} for engine in engines}}
    for name in models:
        model, shape = build_model(name)
        for backend in engines:
            engine = make_engine(model, backend)
            by_history = {}
            for history in histories:
                rows = Rows(engine, history)
                measured = {spec.name: measure_row(rows, spec, repeats) for spec in specs}
                step = per_draft_step(measured[specs[0].name], measured[specs[1].name])
                by_history[str(history)] = {"rows": {k: asdict(v) for k, v in measured.items()},
                                            "per_draft_step": step}
                for session in list(engine.caches._entries):
                    engine.release(session)
            out["engines"][backend]["models"][name] = {"shape": shape, "histories": by_history}
    return out


def table(document: dict) -> str:
    head = (f"{'engine':<6} {'model':<10} {'hist':>5}  {'call':<32} {'aten ops':>8} {'launches':>8} {'syncs':>5} "
            f"{'items':>5} {'reads':>5} {'sized':>5} {'uploads':>7} {'ms':>8}")
    lines = [head, "-" * len(head)]
    for engine, measured_models in document["engines"].items():
        for model, entry in measured_models["models"].items():
            for history, measured in entry["histories"].items():
                rows = dict(measured["rows"])
                rows["per draft step (γ=4 − γ=1)/3"] = measured["per_draft_step"]
                for name, c in rows.items():
                    fmt = (lambda v: f"{v:.1f}") if isinstance(c["aten_ops"], float) else str
                    lines.append(f"{engine:<6} {model:<10} {history:>5}  {name:<32} {fmt(c['aten_ops']):>8} "
                                 f"{fmt(c['launches']):>8} {fmt(c['syncs']):>5} {fmt(c['items']):>5} "
                                 f"{fmt(c['reads']):>5} {fmt(c['sized']):>5} {fmt(c['uploads']):>7} {c['ms']:>8.2f}")
    return "\n".join(lines)


def parse_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,qwen-small", help="comma-separated: tiny, qwen-small")
    parser.add_argument("--engines", default="torch,graph", help="comma-separated: torch, graph")
    parser.add_argument("--histories", type=parse_ints, default=[64, 512],
                        help="tokens each session holds before its first counted call")
    parser.add_argument("--gammas", type=parse_ints, default=[1, 4, 8], help="drafts per Verify row")
    parser.add_argument("--tree-nodes", type=int, default=8, help="nodes of the tree row (0: none)")
    parser.add_argument("--repeats", type=int, default=3, help="profiled (and timed) calls per row")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    document = run([m.strip() for m in args.models.split(",") if m.strip()], args.histories, args.gammas,
                   args.tree_nodes, max(1, args.repeats),
                   tuple(e.strip() for e in args.engines.split(",") if e.strip()))
    document.update(date=datetime.date.today().isoformat(), machine=platform.processor() or platform.machine(),
                    threads=torch.get_num_threads(), torch=torch.__version__, transformers=transformers.__version__,
                    repeats=args.repeats)
    text = table(document)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launches.json").write_text(json.dumps(document, indent=2, ensure_ascii=False))
    (out / "launches.txt").write_text(text + "\n")
    print(f"wrote {out / 'launches.json'}, {out / 'launches.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
