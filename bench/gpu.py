"""specdec on one GPU without network, in one command that fits a 10-minute run.

Usage:
  python bench/gpu.py --tokenizer DIR --shapes 1.5b,7b --out $OUT/gpu.json      # on the GPU machine
  python bench/gpu.py --device cpu --quick                                      # a smoke run anywhere

No checkpoint can reach a GPU machine lent without network, so this builds random-weight
models of Qwen2.5's real shapes in a temporary directory (bench/gpu_models.py: the target; a
"self-draft" sharing its embeddings, first layers and head, its later layers' output projections
zeroed so the pair agrees, α ≈ 1; an unrelated 0.5B-shaped draft, α ≈ 0) with the Qwen2.5
tokenizer files `specdec models fetch` leaves in its cache (--tokenizer; on a CPU without them,
a tiny shape and specdec_cli.tiny's tokenizer), then measures, in one run:

  the device's copy bandwidth, hence each shape's memory roofline (weight bytes / bandwidth);
  per engine (--backends: torch, graph), in a process of its own: the decode step and the
  verification curve (1..33 new tokens on a cached history) against that roofline;
  HF transformers' eager `generate` in a process of its own, the peer;
  specdec through the real services (`specdec up`, as bench/speedup.py starts them): target-only,
  the self-draft at γ 2/4/8 and auto, the independent draft under auto; target-only with 1, 16
  and 64 concurrent sessions (bench/concurrency.py's load).

Every step runs under its own time limit, its share of what is left of --deadline-s, so the run
ends in time: a step that no longer fits is skipped and a measurement cut short says so; every
wait (a step's process, the services' start-up) is bounded by that limit. Every step that touches
the device runs in a process of its own (bench/gpu_isolated.py): a CUDA fault loses that step
only. Each service set's start-up time, and what each service logged at start (the graph
engine's K/V pool, CUDA graphs captured, capture time, device memory after) are in the JSON
(bench/gpu_services.py); --cuda-graphs off runs the graph engine without capture. Prints a
table and writes one JSON (--out) after every step, so a run stopped from outside still leaves
what it measured; ratios (of the roofline, of target-only, of one session) and issue 32's
targets come from figures of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench import gpu_models, gpu_report, gpu_steps, report, speedup  # noqa: E402
from bench.gpu_budget import WEIGHT_BIG, WEIGHTS, Run, Skip  # noqa: E402
from bench.gpu_isolated import run_isolated  # noqa: E402
from bench.gpu_services import Up, start_together  # noqa: E402
from bench.gpu_steps import Clock, Engine  # noqa: E402
from bench.prompts import PROMPTS  # noqa: E402
from specdec.config import choices_of  # noqa: E402
from specdec.runtime.graph.capture import capture_setting  # noqa: E402
from specdec.types import Backend, CudaGraphs  # noqa: E402
from specdec.v1 import coordinator_pb2_grpc  # noqa: E402

GAMMAS = (2, 4, 8)  # the self-draft's fixed γs
LEVELS = "1,16,64"  # concurrent sessions, target-only
SIZES = "1,2,3,5,9,17,33"  # new tokens per forward of the verification curve (γ + 1)
PROMPT = "lru-cache"  # bench/prompts.py's prompt of the specdec and HF runs
# ---- one shape --------------------------------------------------------------------------------

def engine_step(run: Run, shape: dict, models: dict, name: str, clock: Clock) -> dict:
    """One engine's decode step and verification curve, in a process of its own."""
    args = run.args
    result = run_isolated("engine", {"name": name, "path": models["target"].path, "tokenizer": args.tokenizer,
                                     "dtype": args.dtype, "device": args.device, "history": args.history,
                                     "sizes": args.sizes, "repeats": args.repeats,
                                     "capture": capture_setting(args.cuda_graphs)}, clock, run.live)
    result["curve"]["ms"] = {int(k): v for k, v in result["curve"]["ms"].items()}  # JSON made the sizes strings
    if "roofline" in shape:
        gpu_report.engine_ratios(result, shape["roofline"])
    else:
        result["decode_ms"] = result["curve"]["ms"].get(1)
    return result


def hf_step(run: Run, models: dict, ids: list[int], clock: Clock) -> dict:
    """HF transformers' eager generate, in a process of its own."""
    return run_isolated("hf", {"path": models["target"].path, "dtype": run.args.dtype, "device": run.args.device,
                               "ids": ids, "max_new_tokens": run.args.max_new_tokens}, clock, run.live)


def prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """The prompt as the coordinator renders it (bench/speedup.py's chat_ids); its messages' text
    run together where the tokenizer has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        return speedup.chat_ids(tokenizer, prompt)
    return list(tokenizer("\n".join(content for _, content in prompt.messages), add_special_tokens=False)["input_ids"])


def service_options(args: argparse.Namespace, port: int) -> SimpleNamespace:
    """What bench/speedup.py's start_services reads (the backend and --cuda-graphs go by the
    environment: SPECDEC_UP_BACKEND, SPECDEC_UP_CUDA_GRAPHS)."""
    return SimpleNamespace(port=port, dtype=args.dtype, device=args.device, threads=args.threads,
                           draft_ahead="auto", tree="off", draft_quantize="none")


def run_shape(run: Run, name: str) -> None:
    args = run.args
    big = gpu_models.SHAPES[name].hidden >= 3000
    shape: dict = {}
    run.doc["shapes"][name] = shape
    root = Path(tempfile.mkdtemp(prefix=f"specdec-gpu-{name}-", dir=args.workdir or None))

    def build(clock: Clock) -> dict:
        started = time.perf_counter()
        built = run_isolated("build", {"root": str(root), "shape": name, "tokenizer": args.tokenizer,
                                       "dtype": args.dtype, "device": args.device,
                                       "draft_layers": args.draft_layers}, clock, run.live)
        shape["build_s"] = time.perf_counter() - started
        return {role: gpu_models.BuiltModel(**fields) for role, fields in built.items()}

    models = run.step(f"{name}: build models", "build", big, build)
    skip_rest = None if models else "its models were not built"
    if models:
        shape["models"] = {role: dataclasses.asdict(m) for role, m in models.items()}
        bandwidth = run.doc["bandwidth"].get("copy_GBps")
        if bandwidth:  # without it the figures stand, without their fractions of the roofline
            shape["roofline"] = gpu_report.roofline(models["target"].weight_bytes, bandwidth)
    tokenizer = gpu_models.load_tokenizer(args.tokenizer)
    prompt = next(p for p in PROMPTS if p.name == PROMPT)
    ids = prompt_ids(tokenizer, prompt)
    hf_tokens = None
    shape["engines"] = {}
    for engine in args.backends:
        def measure(clock: Clock, engine: str = engine) -> dict:
            if skip_rest:
                raise Skip(skip_rest)
            return engine_step(run, shape, models, engine, clock)

        result = run.step(f"{name}: engine {engine}", "engine", big, measure)
        last = run.doc["steps"][-1]
        shape["engines"][engine] = result or {"status": last["status"], "reason": last.get("reason", "")}

    def hf(clock: Clock) -> dict:
        if skip_rest:
            raise Skip(skip_rest)
        return hf_step(run, models, ids, clock)

    result = run.step(f"{name}: hf generate", "hf", big, hf)
    if result:
        shape["hf_generate"] = {k: v for k, v in result.items() if k != "token_ids"}
        hf_tokens = result["token_ids"]
    services_for(run, name, shape, models, ids, big, skip_rest, hf_tokens)
    shape["ratios"] = gpu_report.shape_ratios(shape)
    if not args.keep_models:  # the next shape's models need the disk
        shutil.rmtree(root, ignore_errors=True)
    shape["models_kept_in"] = str(root) if args.keep_models else None
    run.write()


def services_for(run: Run, name: str, shape: dict, models: dict | None, ids: list[int], big: bool,
                 skip_rest: str | None, hf_tokens: list[int] | None) -> None:
    """The specdec steps: the self-draft's methods and the concurrent sessions on one `specdec up`,
    the independent draft's on another."""
    args = run.args

    def runs_on(up: Up, chosen: dict[str, dict], clock: Clock) -> dict[str, dict]:
        if skip_rest:
            raise Skip(skip_rest)
        if up is own:  # the independent draft's set loads while this one does (both within this step's limit)
            start_together([own, other] if "indep" in args.steps else [own], clock.left())
        up.start(clock.left())
        with grpc.insecure_channel(up.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            return gpu_steps.specdec_runs(stub, ids, args.max_new_tokens, chosen, args.settle, clock)

    def selfdraft(clock: Clock) -> dict:
        runs = runs_on(own, gpu_steps.methods(GAMMAS), clock)
        if hf_tokens is not None and report.TARGET_ONLY in runs:  # HF generate, compared token for token
            runs[gpu_steps.HF_PLAIN] = {**shape["hf_generate"], "token_ids": hf_tokens}
        return gpu_steps.with_analysis(runs)

    def sessions(clock: Clock) -> list[dict]:
        if skip_rest:
            raise Skip(skip_rest)
        return gpu_steps.concurrency_levels(own.address, args.levels, args.concurrency_tokens,
                                            own.start(clock.left()), clock)

    own = Up(run, models or {}, "selfdraft", args.port, service_options(args, args.port))
    other = Up(run, models or {}, "indep", args.port + 10, service_options(args, args.port + 10))
    shape["services"] = {}
    try:
        shape["selfdraft"] = run.step(f"{name}: specdec self-draft", "selfdraft", big, selfdraft)
        shape["concurrency"] = run.step(f"{name}: concurrent sessions", "concurrency", big, sessions)
    finally:
        shape["services"]["selfdraft"] = own.figures()
        own.close()
    try:
        shape["indep"] = run.step(f"{name}: specdec independent draft", "indep", big,
                                  lambda clock: gpu_steps.with_analysis(runs_on(other, gpu_steps.methods(()), clock)))
    finally:
        shape["services"]["indep"] = other.figures()
        other.close()
    run.write()


# ---- the command ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer", default="",
                        help="directory of Qwen2.5's tokenizer files (default: the one `specdec models fetch` "
                             "left in its cache; on a CPU without one, specdec_cli.tiny's tokenizer and a tiny shape)")
    parser.add_argument("--shapes", default="",
                        help=f"target shapes, comma-separated, run in that order: {', '.join(gpu_models.SHAPES)} "
                             "(default: 1.5b,7b on a GPU; small on a CPU with the tokenizer, tiny without)")
    parser.add_argument("--backends", default=",".join(choices_of(Engine)),
                        help="engines measured in-process, comma-separated: " + ", ".join(choices_of(Engine)))
    parser.add_argument("--service-backend", default="auto", choices=choices_of(Backend),
                        help="the services' --backend (`specdec up`)")
    parser.add_argument("--cuda-graphs", default="auto", choices=choices_of(CudaGraphs),
                        help="capture CUDA graphs in the graph engine, in-process and in the services "
                             "(their --cuda-graphs); off runs every bucket eagerly")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads here and in each service (0 = torch's default)")
    parser.add_argument("--dtype", default="", help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--steps", default=",".join(WEIGHTS),
                        help="kinds of step to run, comma-separated (the others are skipped): " + ", ".join(WEIGHTS))
    parser.add_argument("--quick", action="store_true", help="fewer repeats and tokens, shorter history")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="the whole run ends by then")
    parser.add_argument("--draft-layers", type=int, default=2, help="layers of the self-draft")
    parser.add_argument("--history", type=int, default=0, help="cached tokens of the curve (default 512; quick 128)")
    parser.add_argument("--sizes", default=SIZES, help="new tokens per forward of the verification curve")
    parser.add_argument("--repeats", type=int, default=0, help="timed passes of the curve (default 20; quick 5)")
    parser.add_argument("--max-new-tokens", type=int, default=0,
                        help="tokens per specdec and HF run (default 64; quick 32, 16 on a CPU)")
    parser.add_argument("--levels", default=LEVELS, help="concurrent sessions, target-only, comma-separated")
    parser.add_argument("--concurrency-tokens", type=int, default=0,
                        help="tokens per concurrent session (default 32; quick 16, 8 on a CPU)")
    parser.add_argument("--settle", type=int, default=-1,
                        help="auto runs before the measured ones (default 1; quick 0)")
    parser.add_argument("--port", type=int, default=50171, help="the coordinator's (services take the next two; "
                                                                 "the independent draft's set +10)")
    parser.add_argument("--workdir", default="", help="where the models are built (default: the system's temp)")
    parser.add_argument("--keep-models", action="store_true",
                        help="keep each shape's models (default: deleted once the shape is measured)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    args = parser.parse_args(argv)
    return resolve(args, parser)


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill the defaults that depend on the device, the tokenizer and --quick; refuse what cannot run."""
    cpu = args.device == "cpu"
    if not args.tokenizer:
        from specdec_cli.model_pair import PAIR, model_dir

        fetched = model_dir(PAIR[0])
        if (fetched / "tokenizer.json").is_file():
            args.tokenizer = str(fetched)
        elif cpu:
            args.tokenizer = gpu_models.TINY_TOKENIZER
        else:
            parser.error(f"no tokenizer: give --tokenizer DIR (Qwen2.5's tokenizer files; `specdec models fetch` "
                         f"leaves them in {fetched}), or run with --device cpu")
    elif not (Path(args.tokenizer) / "tokenizer.json").is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    tiny = args.tokenizer == gpu_models.TINY_TOKENIZER
    args.shapes = [s for s in (args.shapes or ("tiny" if tiny else "small" if cpu else "1.5b,7b")).split(",") if s]
    unknown = [s for s in args.shapes if s not in gpu_models.SHAPES]
    if unknown:
        parser.error(f"--shapes: no shape {', '.join(unknown)}; choose from {', '.join(gpu_models.SHAPES)}")
    args.steps = [k for k in args.steps.split(",") if k]
    unknown = [k for k in args.steps if k not in WEIGHTS]
    if unknown:
        parser.error(f"--steps: no step {', '.join(unknown)}; choose from {', '.join(WEIGHTS)}")
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in args.backends if b not in choices_of(Engine)]
    if unknown:
        parser.error(f"--backends: no engine {', '.join(unknown)}; choose from {', '.join(choices_of(Engine))}")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    args.levels = [int(n) for n in args.levels.split(",")]
    quick = args.quick
    args.history = args.history or (128 if quick else 512)
    args.repeats = args.repeats or (5 if quick else 20)
    args.max_new_tokens = args.max_new_tokens or ((16 if cpu else 32) if quick else 64)
    args.concurrency_tokens = args.concurrency_tokens or ((8 if cpu else 16) if quick else 32)
    args.settle = args.settle if args.settle >= 0 else (0 if quick else 1)
    args.copy_bytes = (64 << 20 if quick else 256 << 20) if cpu else 4 << 30
    if args.deadline_s <= 0:
        parser.error("--deadline-s must be > 0")
    return args


def machine(device: str) -> dict:
    import transformers

    out = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cpu_count": os.cpu_count()}
    with contextlib.suppress(OSError):
        out["cpu"] = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name")), "")
    return out  # the device's name, CUDA and memory come from the bandwidth step: no CUDA context here


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    document = {"command": "python bench/gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": args.device, "dtype": args.dtype, "machine": machine(args.device),
                "tokenizer": args.tokenizer, "shapes_asked": args.shapes, "backends": args.backends,
                "service_backend": args.service_backend, "steps_asked": args.steps, "cuda_graphs": args.cuda_graphs,
                "threads": args.threads,
                "quick": args.quick,
                "deadline_s": args.deadline_s,
                "history": args.history, "sizes": args.sizes, "repeats": args.repeats,
                "max_new_tokens": args.max_new_tokens, "levels": args.levels,
                "concurrency_tokens": args.concurrency_tokens, "gammas": list(GAMMAS), "prompt": PROMPT,
                "bandwidth": {}, "shapes": {}, "steps": [], "targets": []}
    run = Run(args, document)
    for service in ("DRAFT", "TARGET"):  # for the services `specdec up` starts: every level in one forward
        os.environ[f"SPECDEC_{service}_MAX_BATCH_SIZE"] = str(max(args.levels))
    os.environ["SPECDEC_UP_BACKEND"] = args.service_backend
    os.environ["SPECDEC_UP_CUDA_GRAPHS"] = args.cuda_graphs
    per_shape = [w * (WEIGHT_BIG if gpu_models.SHAPES[s].hidden >= 3000 else 1.0)
                 for s in args.shapes for w in shape_weights(args)]
    run.planner.weight_left = (WEIGHTS["bandwidth"][0] if "bandwidth" in args.steps else 0.0) + sum(per_shape)
    timer = run.watchdog()
    try:
        bandwidth = run.step("copy bandwidth", "bandwidth", False,
                             lambda clock: run_isolated("bandwidth", {"device": args.device, "nbytes": args.copy_bytes,
                                                                      "repeats": 10}, clock, run.live))
        document["machine"].update((bandwidth or {}).pop("device", {}))
        document["bandwidth"] = bandwidth or {}
        for name in args.shapes:
            try:
                run_shape(run, name)
            except Exception as exc:  # noqa: BLE001 - outside any step: the next shape still runs
                traceback.print_exc()
                document["shapes"].setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        timer.cancel()
    document["targets"] = gpu_report.targets(document["shapes"])
    document["seconds"] = run.elapsed()
    run.write()
    print(gpu_report.table(document))
    print(f"wrote {run.out}")
    return 0


def shape_weights(args: argparse.Namespace) -> list[float]:
    """The weights of one shape's steps, in order."""
    kinds = ["build"] + ["engine"] * len(args.backends) + ["hf", "selfdraft", "concurrency", "indep"]
    return [WEIGHTS[k][0] if k in args.steps else 0.0 for k in kinds]


if __name__ == "__main__":
    sys.exit(main())
