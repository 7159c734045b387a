"""bench/gpu.py's in-process steps, each in a process of its own.

A CUDA fault (a device-side assert, an illegal address) poisons the process's CUDA context: every
later CUDA call in it fails. So every step that touches the device — the copy bandwidth, building
the models, each engine's curve, HF generate — runs here, in a child started for it alone
(`python bench/gpu_isolated.py PAYLOAD`): a fault loses that step only, and the device memory
the step held goes back when the child exits. The parent never opens a CUDA context of its own.

The child runs one function of STEPS under a Clock of the step's limit and writes its result
(or its error) as JSON; the parent waits at most the limit plus GRACE_S, then kills it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 20.0  # past its limit, a step's process is killed this much later
RESULT = "result.json"  # the child's answer in its temporary directory


class StepFailed(RuntimeError):
    """The step's process ended without an answer (a CUDA fault, a kill, a timeout)."""


def run_isolated(function: str, kwargs: dict, clock: Any, live: list | None = None) -> Any:
    """STEPS[function](clock, **kwargs) in a child process -> its JSON result. What the child's
    clock cut is added to `clock.cut`; the child's exception is raised again here (Skip as
    Skip); `live` holds the child while it runs (the watchdog ends it)."""
    from bench.gpu_budget import Skip

    with tempfile.TemporaryDirectory(prefix="specdec-gpu-step-") as tmp:
        out = Path(tmp) / RESULT
        payload = json.dumps({"function": function, "kwargs": kwargs, "limit_s": max(0.0, clock.left()),
                              "out": str(out)})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), payload], cwd=ROOT, env=env)
        if live is not None:
            live.append(proc)
        try:
            proc.wait(timeout=max(1.0, clock.left()) + GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise StepFailed(f"the step's process ran past its limit of {clock.limit_s:.0f} s and was killed")
        finally:
            if live is not None and proc in live:
                live.remove(proc)
        if not out.is_file():
            raise StepFailed(f"the step's process exited with code {proc.returncode} and no answer "
                             "(a CUDA fault or a crash: only this step is lost)")
        answer = json.loads(out.read_text())
    clock.cut.extend(answer.get("cut", []))
    if "skip" in answer:
        raise Skip(answer["skip"])
    if "error" in answer:
        raise StepFailed(answer["error"])
    return answer["result"]


# ---- the steps (run in the child) ---------------------------------------------------------------

def bandwidth(clock: Any, device: str, nbytes: int, repeats: int) -> dict:
    import torch

    from bench import gpu_steps

    out = gpu_steps.copy_bandwidth(torch.device(device), nbytes, repeats, clock)
    if torch.device(device).type == "cuda":  # what the device is, read here: the parent opens no context
        free, total = torch.cuda.mem_get_info(device)
        out["device"] = {"name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                         "memory_total_bytes": total, "memory_free_bytes": free}
    return out


def build(clock: Any, root: str, shape: str, tokenizer: str, dtype: str, device: str, draft_layers: int) -> dict:
    from bench import gpu_models
    from specdec.runtime.loader import TORCH_DTYPES

    built = gpu_models.build_set(Path(root), shape, tokenizer, TORCH_DTYPES[dtype], device, draft_layers)
    return {role: dataclasses.asdict(model) for role, model in built.items()}


def engine(clock: Any, name: str, path: str, tokenizer: str, dtype: str, device: str, history: int,
           sizes: list[int], repeats: int, capture: bool | None) -> dict:
    import torch

    from bench import gpu_models, gpu_steps
    from bench.gpu_budget import Skip
    from specdec.tokenizer import ModelLoadError

    try:
        opened = gpu_steps.open_engine(name, path, dtype, device, history + max(sizes), capture)
    except (ImportError, ModelLoadError) as exc:
        raise Skip(f"the {name} engine is not available here: {type(exc).__name__}: {exc}") from exc
    high = gpu_models.load_tokenizer(tokenizer).vocab_size
    curve = gpu_steps.curve(opened, torch.device(device), history, sizes, repeats, high, clock)
    return {"curve": curve, "details": {**opened.details, **gpu_steps.device_memory(device)}}


def hf(clock: Any, path: str, dtype: str, device: str, ids: list[int], max_new_tokens: int) -> dict:
    from bench import gpu_steps
    from specdec.runtime.loader import load_model

    model = load_model(path, dtype, device).model
    model.generation_config.eos_token_id = None
    return {**gpu_steps.hf_generate_rate(model, ids, max_new_tokens, clock), **gpu_steps.device_memory(device)}


STEPS: dict[str, Callable[..., Any]] = {"bandwidth": bandwidth, "build": build, "engine": engine, "hf": hf}


def child(payload: dict) -> None:
    """Run one step and write its answer (result, or error / skip, and what its clock cut)."""
    from bench.gpu_budget import Skip
    from bench.gpu_steps import Clock

    clock = Clock(payload["limit_s"])
    try:
        answer: dict = {"result": STEPS[payload["function"]](clock, **payload["kwargs"])}
    except Skip as exc:
        answer = {"skip": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the parent records it as the step's error
        traceback.print_exc()
        answer = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    answer["cut"] = clock.cut
    Path(payload["out"]).write_text(json.dumps(answer, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    child(json.loads(sys.argv[1]))
