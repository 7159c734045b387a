"""A rank of a tensor-parallel graph model for the tests (python -m tests.tp_ranks RANK N INIT OUT DIR...):
per checkpoint directory, loads its shards, runs a prefill, decode steps, a verification and a
rollback over its own paged pool, and saves the logits and its decoder bytes to OUT (one launch
for every checkpoint: starting ranks is the slow part). tp_logits runs N of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.redis_server import free_port

PREFILL = [5, 17, 33, 2, 41, 8, 60, 12, 9]  # the prompt every rank runs
STEPS = [[21], [7], [88, 3, 14]]  # decode steps, then a 3-token verification


def forwards(runner) -> list[torch.Tensor]:
    """The logits of PREFILL then STEPS in session "s" (a new session) -> per forward [len, vocab]."""
    from specdec.runtime.graph.batch import RowInput

    runner.kv.new_session("s")
    out = []
    for tokens in [PREFILL, *STEPS]:
        out.append(runner.forward([RowInput("s", list(tokens), len(tokens))])[0].clone())
    runner.kv.truncate("s", len(PREFILL) + 1)  # a rollback, then the same step again
    out.append(runner.forward([RowInput("s", [7], 1)])[0].clone())
    return out


def main(rank: int, size: int, init: str, out: str, directories: list[str]) -> None:
    from specdec.runtime.graph.cuda_graphs import CudaGraphRunner
    from specdec.runtime.graph.paged_kv import PagedKV
    from specdec.runtime.graph.parallel import init_group
    from specdec.runtime.graph.shards import decoder_bytes, load_shard

    torch.set_num_threads(1)
    init_group(rank, size, init, "cpu", timeout_s=180)  # a loaded 2-core machine is slow to start ranks
    saved = {}
    for directory in directories:
        model = load_shard(directory, torch.float64, "cpu", rank, size, _parallel(directory, rank, size))
        runner = CudaGraphRunner(model, PagedKV(model.pool_spec(4), 64), capture=False)
        with torch.inference_mode():
            saved[directory] = {"logits": forwards(runner), "decoder_bytes": decoder_bytes(model)}
    torch.save(saved, out)


def _parallel(directory: str, rank: int, size: int):
    from transformers import AutoConfig

    from specdec.runtime.graph.parallel import TensorParallel, shard_plan

    c = AutoConfig.from_pretrained(directory)
    return TensorParallel(shard_plan(c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, rank, size))


def tp_logits(directories: list[Path], size: int, tmp: Path, timeout: float = 240) -> list[dict]:
    """Run `size` ranks on the checkpoints; what each saved, per directory (str), in rank order
    (every process is ended on failure)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tp_ranks", str(r), str(size), init,
                               str(tmp / f"rank{r}.pt"), *map(str, directories)], env=env) for r in range(size)]
    try:
        for proc in procs:
            assert proc.wait(timeout) == 0, f"a rank exited with {proc.returncode}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [torch.load(tmp / f"rank{r}.pt") for r in range(size)]


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
