"""The speed-up suite: specdec's proposers against target-only and HF transformers' methods.

Usage:
  python bench/speedup.py                                  # the fetched real pair (specdec models fetch)
  python bench/speedup.py --draft-model D --target-model T [--dtype bfloat16]
  python bench/speedup.py --tiny --quick                   # a tiny random pair: a smoke run
  python bench/speedup.py --threads 1 --draft-ahead on     # draft and target on a core each
  python bench/speedup.py --no-hf --draft-model D.gguf --target-model T.gguf --llama-server PATH
  python bench/speedup.py --tree on                        # token-tree rows beside the chains
  python bench/speedup.py --tree auto                      # the coordinator's --trees auto: the policy chooses
  python bench/speedup.py --no-hf --methods auto --prompts email-formal,lru-cache   # auto alone, in that order
  python bench/speedup.py --heads DIR                      # the target serves Medusa-style heads: a heads row

Ten chat prompts in five kinds (bench/prompts.py), greedy, --max-new-tokens (default 128)
each, EOS ignored so every method generates the same number of tokens. Side by side in one
run, on the same checkpoints, dtype and thread count, prompt by prompt:

  specdec target-only (proposer none) · specdec auto (adaptive γ, per-round source) ·
  specdec draft model at fixed γ = 1..6 · specdec prompt lookup only (adaptive γ) ·
  HF generate plain · HF assisted generation with the draft (its default schedule, and a
  constant γ = 3) · HF prompt lookup (prompt_lookup_num_tokens=10) · with --llama-server PATH
  and GGUF files: llama.cpp's own server, plain and with the draft (bench/llama_server.py)

The services run as processes on loopback (`specdec up`); the HF methods in this process.
Rates are decode rates: tokens after the first streamed chunk over the time after it, so
start-up and prefill cancel out. Per prompt: tokens/s, speed-up over target-only, ratio to the
best HF method, the draft's α and c and the Leviathan bound for them. A table is printed;
speedup.json, speedup.txt and speedup.png go to bench/results/. --quick runs one prompt per
kind and fewer methods. --draft-ahead sets the coordinator's --draft-ahead: auto (its default:
it measures whether the draft drafting the next round while the target verifies pays), on or
off; with --threads 1 the draft and the target each have a core of their own, as on separate
machines, while each HF method runs on one core. With calls made ahead, a draft call is off
the critical path, so the c reported (the draft's time per drafted token on the critical path)
falls and its Leviathan bound no longer describes the run. Before the suite, --settle N
adaptive requests of --max-new-tokens run on the first prompt (default 3), so auto's
measurements (the cost model, the draft-ahead verdict) describe a coordinator that has run a
while, as a serving one has. --tree on adds rows of fixed token trees (tree γ=G n=N) and auto
with trees of 8 nodes; --tree auto starts the coordinator with --trees auto, so auto's rounds
are trees where its cost model expects them to pay, beside auto held to chains (tree_nodes=1).
Each prompt's line and the second table give tokens per target pass beside the speed-up.
--heads DIR serves the target with those heads (`specdec distill --heads K` writes them) and
adds the row "specdec heads" (proposer heads: every round a tree of the heads' candidates, no
draft call); auto may then choose heads rounds too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llama_server, report  # noqa: E402
from bench.hf_methods import Timed, methods as hf_methods  # noqa: E402
from bench.processes import model_pair  # noqa: E402
from bench.prompts import PROMPTS, QUICK, Prompt  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

DRAFT_GAMMAS = (1, 2, 3, 4, 5, 6)
QUICK_DRAFT_GAMMAS = (2, 4)
TREES = ((2, 4), (4, 8), (4, 12))  # (γ: depth, tree_nodes) of the --tree on rows
QUICK_TREES = ((2, 4), (4, 8))
AUTO_TREE_NODES = 8  # auto's rows with --tree on: adaptive γ, trees of this many tokens
AUTO_CHAINS = f"{report.AUTO} chains"  # --tree auto: auto held to chains (tree_nodes = 1), beside auto


def specdec_methods(quick: bool, tree: str = "off", heads: bool = False) -> dict[str, dict]:
    """name -> the GenerateRequest fields that select it."""
    pb = coordinator_pb2
    out = {report.TARGET_ONLY: {"proposer": pb.PROPOSER_NONE},
           report.AUTO: {"proposer": pb.PROPOSER_AUTO},
           report.LOOKUP: {"proposer": pb.PROPOSER_NGRAM}}
    for gamma in QUICK_DRAFT_GAMMAS if quick else DRAFT_GAMMAS:
        out[f"{report.DRAFT_PREFIX}{gamma}"] = {"proposer": pb.PROPOSER_DRAFT, "num_speculative_tokens": gamma}
    if tree == "on":
        for gamma, nodes in QUICK_TREES if quick else TREES:
            out[f"{report.TREE_PREFIX}{gamma} n={nodes}"] = {
                "proposer": pb.PROPOSER_DRAFT, "num_speculative_tokens": gamma, "tree_nodes": nodes}
        out[f"{report.AUTO}+tree{AUTO_TREE_NODES}"] = {"proposer": pb.PROPOSER_AUTO,
                                                    "tree_nodes": AUTO_TREE_NODES}
    if tree == "auto":  # the coordinator runs --trees auto: auto's own row chooses trees
        out[AUTO_CHAINS] = {"proposer": pb.PROPOSER_AUTO, "tree_nodes": 1}
    if heads:  # the target serves heads: rounds of their candidates' tree, no draft call
        out[report.HEADS] = {"proposer": pb.PROPOSER_HEADS}
    return out


def select_methods(methods: dict[str, dict], names: str) -> dict[str, dict]:
    """The methods `names` asks for (comma-separated, without "specdec "; "" = all), and always
    target-only (the speed-ups are over it) and auto (the settling runs and each prompt's line)."""
    if not names:
        return methods
    wanted = [f"specdec {name.strip()}" for name in names.split(",")]
    unknown = [name for name in wanted if name not in methods]
    if unknown:
        raise SystemExit(f"bench/speedup.py: no method {', '.join(unknown)}; this run has "
                         f"{', '.join(m.removeprefix('specdec ') for m in methods)}")
    return {name: fields for name, fields in methods.items()
            if name in (report.TARGET_ONLY, report.AUTO) or name in wanted}


def run_specdec(stub, ids: list[int], new_tokens: int, fields: dict) -> tuple[Timed, dict]:
    """One streamed greedy generation; (timings, stats)."""
    from google.protobuf.json_format import MessageToDict

    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=new_tokens, ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0.0),
        **fields)
    request.token_ids.ids.extend(ids)
    timed = Timed([], time.perf_counter())
    last = None
    for chunk in stub.Generate(request, timeout=3600):
        if chunk.token_ids:
            timed.chunks.append((time.perf_counter(), len(chunk.token_ids)))
            timed.token_ids.extend(chunk.token_ids)
        last = chunk
    timed.ended = time.perf_counter()
    stats = MessageToDict(last.stats, preserving_proto_field_name=True,
                          always_print_fields_with_no_presence=True)
    return timed, stats


def record(tries: list[tuple[Timed, dict | None]]) -> dict:
    """A method's run on one prompt: the median try by decode rate (its stats with it), and
    every try's rate."""
    rates = [timed.decode_tokens_per_second for timed, _ in tries]
    timed, stats = sorted(tries, key=lambda t: t[0].decode_tokens_per_second)[len(tries) // 2]
    row = {"decode_tps": timed.decode_tokens_per_second, "decode_tps_tries": rates,
           "total_seconds": timed.total_seconds, "first_token_seconds": timed.first_token_seconds,
           "tokens": len(timed.token_ids), "token_ids": timed.token_ids,
           "same_tokens_every_try": all(t.token_ids == timed.token_ids for t, _ in tries)}
    if stats is not None:
        row["stats"] = stats
    return row


def model_paths(args) -> tuple[str, str]:
    return model_pair(args, "bench/speedup.py", context=4096, layers=4, width=64)


def start_services(draft: str, target: str, args, timeout_s: float = 900.0, stderr: Any = None) -> subprocess.Popen:
    """`specdec up` on draft and target, once its coordinator answers SERVING (at most timeout_s;
    the process is ended when it does not); its stderr (the services' logs) to `stderr`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "SPECDEC_COORDINATOR_DRAFT_AHEAD": args.draft_ahead,
           "SPECDEC_COORDINATOR_TREES": "auto" if args.tree == "auto" else "off"}
    command = [sys.executable, "-m", "specdec_cli", "up", "--port", str(args.port), "--dtype", args.dtype,
               "--device", args.device, "--draft-model", draft, "--target-model", target,
               "--draft-quantize", args.draft_quantize, "--http-port", "0"]
    if getattr(args, "heads", ""):  # (bench/gpu_steps.py passes its own namespace, without heads)
        command += ["--target-heads", args.heads]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env, cwd=ROOT)
    try:
        wait_healthy(f"127.0.0.1:{args.port}", timeout_s, [proc])
    except BaseException:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    return proc


def chat_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The prompt's token ids exactly as the coordinator renders `messages`."""
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in prompt.messages],
                                         tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--target-model", default="")
    parser.add_argument("--tiny", action="store_true", help="a tiny random pair built here (smoke test)")
    parser.add_argument("--quick", action="store_true", help="one prompt per kind, fewer methods")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-quantize", default="auto", choices=("auto", "none", "int8"),
                        help="the draft's linear layers in weight-only int8 (the draft service's --quantize; "
                             "auto = int8 on a CPU), for specdec's draft AND HF's assistant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads everywhere (0 = torch's default)")
    parser.add_argument("--port", type=int, default=50071)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="tries per method and prompt (the median counts)")
    parser.add_argument("--prompts", default="",
                        help="comma-separated prompt names, run in that order (default: the suite)")
    parser.add_argument("--methods", default="",
                        help="comma-separated specdec methods as the table names them without 'specdec ' "
                             "(e.g. 'prompt lookup,draft γ=4'; default: all); target-only and auto always run")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers methods")
    parser.add_argument("--draft-ahead", default="auto", choices=("auto", "on", "off"),
                        help="the coordinator's --draft-ahead (the draft works while the target verifies)")
    parser.add_argument("--settle", type=int, default=3,
                        help="adaptive requests run before the suite, so auto's measurements have settled")
    parser.add_argument("--tree", default="off", choices=("off", "on", "auto"),
                        help="on: rows of draft rounds proposing token trees (tree γ=G n=N) and auto with trees; "
                             "auto: the coordinator's --trees auto (auto's rounds are trees where they pay), "
                             "beside auto held to chains")
    parser.add_argument("--heads", default="",
                        help="a heads directory the target serves (specdec distill --heads K): adds the "
                             "'heads' row (proposer heads)")
    parser.add_argument("--llama-server", default="",
                        help="a llama-server binary: llama.cpp's server on the same GGUF files, plain and "
                             "with the draft, as peers (ports --port+3, --port+4)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()

    import torch

    from specdec.runtime.loader import load_model

    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)
    prompts = list(QUICK if args.quick else PROMPTS)
    if args.prompts:
        by_name = {p.name: p for p in PROMPTS}
        unknown = [name for name in args.prompts.split(",") if name not in by_name]
        if unknown:
            raise SystemExit(f"bench/speedup.py: no prompt {', '.join(unknown)}; the suite has {', '.join(by_name)}")
        prompts = [by_name[name] for name in args.prompts.split(",")]
    draft_path, target_path = model_paths(args)
    if args.no_hf:  # the tokenizer only (a .gguf file would be dequantised for nothing)
        from specdec.tokenizer import load_tokenizer

        tokenizer, hf_model, peers = load_tokenizer(target_path), None, {}
    else:
        hf_target = load_model(target_path, args.dtype, args.device)
        hf_draft = load_model(draft_path, args.dtype, args.device, quantize=args.draft_quantize)
        for loaded in (hf_target, hf_draft):
            loaded.model.generation_config.eos_token_id = None
        tokenizer, hf_model, peers = hf_target.tokenizer, hf_target.model, hf_methods(hf_draft.model)
    if args.quick:
        peers.pop(next((m for m in peers if "γ=" in m), ""), None)
    ours = select_methods(specdec_methods(args.quick, args.tree, bool(args.heads)), args.methods)
    if args.llama_server and not (draft_path.endswith(".gguf") and target_path.endswith(".gguf")):
        raise SystemExit("bench/speedup.py: --llama-server needs .gguf files as --draft-model/--target-model")
    proc = start_services(draft_path, target_path, args)
    stack = contextlib.ExitStack()
    results = []
    try:
        if args.llama_server:
            served = stack.enter_context(llama_server.methods(args.llama_server, draft_path, target_path,
                                                              args.port + 3, args.threads))
            peers.update({name: (lambda _, ids, n, run=run: run(ids, n)) for name, run in served.items()})
        method_names = list(ours) + list(peers)
        with grpc.insecure_channel(f"127.0.0.1:{args.port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            warm = chat_ids(tokenizer, prompts[0])
            for fields in ours.values():  # warm-up: caches, allocators, the shared cost model
                run_specdec(stub, warm, 16, fields)
            for _ in range(args.settle):  # a coordinator that has run a while: its verdicts are in
                run_specdec(stub, warm, args.max_new_tokens, ours[report.AUTO])
            for run in peers.values():
                run(hf_model, warm, 16)
            for prompt in prompts:
                ids = chat_ids(tokenizer, prompt)
                tries: dict[str, list] = {name: [] for name in method_names}
                for _ in range(args.repeats):  # methods interleaved: slow drifts hit them alike
                    for name, fields in ours.items():
                        tries[name].append(run_specdec(stub, ids, args.max_new_tokens, fields))
                    for name, run in peers.items():
                        tries[name].append((run(hf_model, ids, args.max_new_tokens), None))
                runs = {name: record(tries[name]) for name in method_names}
                summary = report.analyse_prompt(runs)
                results.append({"name": prompt.name, "kind": prompt.kind, "prompt_tokens": len(ids),
                                "summary": summary, "runs": runs})
                auto = runs[report.AUTO]
                print(f"{prompt.name}: target-only {summary['target_only_tps']:.2f} tok/s, auto "
                      f"{auto['speedup']:.2f}x at {auto['stats']['tokens_per_round']:.2f} tokens per target pass "
                      f"({auto['stats'].get('tree_rounds', 0)} of {auto['stats']['rounds']} rounds trees)",
                      flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
        stack.close()
    text = report.table(results, method_names) + "\n\n" + report.passes_table(results, method_names)
    totals = report.overall(results)
    print(text)
    print(json.dumps(totals, indent=2, ensure_ascii=False))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {"draft_model": draft_path, "target_model": target_path, "dtype": args.dtype,
                "draft_quantize": args.draft_quantize,
                "device": args.device, "threads": args.threads, "draft_ahead": args.draft_ahead,
                "tree": args.tree, "settle": args.settle, "heads": args.heads,
                "max_new_tokens": args.max_new_tokens, "llama_server": args.llama_server,
                "repeats": args.repeats,
                "tiny": args.tiny, "quick": args.quick, "methods": method_names, "overall": totals,
                "prompts": [{**p, "runs": {m: {k: v for k, v in r.items() if k != "token_ids"}
                                           for m, r in p["runs"].items()}} for p in results]}
    (out / "speedup.json").write_text(json.dumps(document, indent=2, ensure_ascii=False))
    (out / "speedup.txt").write_text(text + "\n" + json.dumps(totals, indent=2, ensure_ascii=False) + "\n")
    if not report.plot(results, method_names, out / "speedup.png"):
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
    print(f"wrote {out / 'speedup.json'}, {out / 'speedup.txt'}, {out / 'speedup.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
