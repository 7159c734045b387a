"""The rank processes of a tensor-parallel graph engine (--tensor-parallel-size N > 1).

What this module decides:
- The service process is rank 0: it serves gRPC, owns the scheduling and the block tables, and
  starts ranks 1..N-1 itself (`python -m specdec.runtime.graph.ranks`, one process each, on
  cuda:r or the CPU), which load only their own shards (shards.py) and a pool of the same number
  of blocks, holding their own K/V heads.
- Every forward's inputs reach the other ranks as two broadcasts from rank 0: a fixed header
  (the op, `keep`, the batch's rows × tokens × blocks × tree width) and one flat payload (the
  ForwardBatch's tensors as int64), then all ranks run the same forward in lockstep, their
  all-reduces inside it. A tree's kept path is the same: its slot moves are broadcast, and each
  rank moves its own pool's rows.
- The header waits on the default group (no deadline: a service may be idle for hours); the
  payload and the all-reduces run on a second group whose collectives fail after
  COLLECTIVE_TIMEOUT_S, so a hung rank fails the forward.
- A rank that dies or hangs never hangs the service: rank 0 polls its children and exits
  (status 70) with a log line naming the rank that exited; a failed collective exits it too. A
  rank whose parent is gone exits by itself.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

import torch

from specdec.runtime.graph.batch import ForwardBatch
from specdec.runtime.graph.paged_kv import PagedKV
from specdec.runtime.graph.parallel import COLLECTIVE_TIMEOUT_S, TensorParallel, init_group, shard_plan

log = logging.getLogger(__name__)

OP_STOP, OP_POOL, OP_FORWARD, OP_MOVE, OP_READ, OP_WRITE = range(6)  # what a header asks the ranks to do
HEADER = 8  # int64 words of a header: [op, then the op's numbers]
IDLE_TIMEOUT = datetime.timedelta(days=365)  # the header's wait: as long as the service is idle
EXIT_RANK_FAILED = 70  # the service's exit status when a rank died or a collective failed
POLL_S = 0.5  # how often rank 0 looks at its children, and a rank at its parent


def pack_batch(batch: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    """A batch -> ([R, Q, B, W], one flat int64 payload of its tensors in field order)."""
    R, Q = batch.tokens.shape  # the shape of every tensor follows from [R, Q, B, W]
    B, W = batch.block_tables.shape[1], batch.window_mask.shape[2]
    payload = torch.cat([batch.tokens.reshape(-1), batch.positions.reshape(-1), batch.slots.reshape(-1),
                         batch.key_index.reshape(-1), batch.block_tables.reshape(-1), batch.kv_lens.reshape(-1),
                         batch.window_start.reshape(-1), batch.window_mask.reshape(-1).long()])
    return [R, Q, B, W], payload


def payload_size(R: int, Q: int, B: int, W: int) -> int:
    return 4 * R * Q + R * B + 2 * R + R * Q * W


def unpack_batch(payload: torch.Tensor, R: int, Q: int, B: int, W: int) -> ForwardBatch:
    """pack_batch's payload [payload_size] -> the ForwardBatch (views of it)."""
    parts = payload.split([R * Q] * 4 + [R * B, R, R, R * Q * W])
    return ForwardBatch(parts[0].view(R, Q), parts[1].view(R, Q), parts[2].view(R, Q), parts[3].view(R, Q),
                        parts[4].view(R, B), parts[5], parts[6], parts[7].view(R, Q, W).bool())


class Leader:
    """Rank 0's end of the group: sends each op to the other ranks, watches their processes."""

    def __init__(self, parallel: TensorParallel | None, procs: Sequence[subprocess.Popen], device: torch.device):
        self.parallel = parallel  # rank 0's place in the group (None until it joined)
        self.procs = list(procs)  # ranks 1..N-1, in order
        self.device = device  # where the broadcast tensors live (the CUDA device for NCCL)
        self.stopped = False

    def send(self, header: Sequence[int], payload: torch.Tensor | None = None) -> None:
        """Broadcast a header (the default group), then its payload (the collective group)."""
        import torch.distributed as dist

        words = torch.zeros(HEADER, dtype=torch.long, device=self.device)
        words[:len(header)] = torch.tensor(list(header), dtype=torch.long)
        try:
            dist.broadcast(words, 0)
            if payload is not None:
                self.parallel.broadcast(payload.to(self.device))
        except RuntimeError as exc:
            self.fail(f"a broadcast to the ranks failed: {exc}")

    def forward(self, batch: ForwardBatch, keep: int | None) -> None:
        shape, payload = pack_batch(batch)
        self.send([OP_FORWARD, -1 if keep is None else keep, *shape], payload)

    def watch(self) -> None:
        """Exit the service when a rank process exits (a daemon thread)."""
        def run() -> None:
            while not self.stopped:
                for rank, proc in enumerate(self.procs, start=1):
                    if proc.poll() is not None and not self.stopped:
                        self.fail(f"tensor-parallel rank {rank} of {len(self.procs) + 1} exited with status "
                                  f"{proc.returncode}")
                time.sleep(POLL_S)

        threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def fail(self, why: str) -> None:
        """A rank is lost: log which, end the others, exit the service non-zero."""
        log.error("%s; the service stops (status %d)", why, EXIT_RANK_FAILED)
        self.stopped = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        logging.shutdown()
        os._exit(EXIT_RANK_FAILED)

    def stop(self) -> None:
        """Tell the ranks to exit, wait a little, end the ones still running, leave the group."""
        if self.stopped:
            return
        self.stopped = True
        if self in LEADERS:
            LEADERS.remove(self)
        try:
            words = torch.zeros(HEADER, dtype=torch.long, device=self.device)
            import torch.distributed as dist

            dist.broadcast(words, 0)  # OP_STOP
        except Exception:  # noqa: BLE001 - a rank already gone: it is killed below
            pass
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


LEADERS: list[Leader] = []  # this process's running groups (one per tensor-parallel engine)


def stop_all() -> None:
    """Stop every group this process leads (at exit, and after a test)."""
    for leader in list(LEADERS):
        leader.stop()


atexit.register(stop_all)


class LeaderModel:
    """Rank 0's GraphModel: every forward is first broadcast to the other ranks."""

    def __init__(self, model: Any, leader: Leader):
        self.inner = model
        self.leader = leader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def hidden_states(self, batch: ForwardBatch, pools: list[torch.Tensor], keep: int | None = None) -> torch.Tensor:
        self.leader.forward(batch, keep)
        try:
            return self.inner.hidden_states(batch, pools, keep)
        except RuntimeError as exc:
            if "gloo" in str(exc).lower() or "nccl" in str(exc).lower() or "timed out" in str(exc).lower():
                self.leader.fail(f"a collective of the forward failed (a rank died or hung): {exc}")
            raise

    def forward(self, batch: ForwardBatch, pools: list[torch.Tensor], keep: int | None = None) -> torch.Tensor:
        return self.inner.logits(self.hidden_states(batch, pools, keep))


def rows_at(kv: PagedKV, slots: Sequence[int]) -> torch.Tensor:
    """The K/V of pool slots -> [layers, 2, kv_heads, n, head_dim] (a K/V chunk's layout)."""
    index = torch.tensor(list(slots), dtype=torch.long, device=kv.spec.device)
    rows = [pool.view(2, -1, kv.spec.kv_heads, kv.spec.head_dim)[:, index] for pool in kv.pools]
    return torch.stack(rows).transpose(2, 3).contiguous()


def write_rows(kv: PagedKV, slots: Sequence[int], chunk: torch.Tensor) -> None:
    """Write chunk [layers, 2, kv_heads, n, head_dim] into pool slots."""
    index = torch.tensor(list(slots), dtype=torch.long, device=kv.spec.device)
    rows = chunk.to(device=kv.spec.device, dtype=kv.spec.dtype).transpose(2, 3)  # [layers, 2, n, kv_heads, dim]
    for layer, pool in enumerate(kv.pools):
        pool.view(2, -1, kv.spec.kv_heads, kv.spec.head_dim)[:, index] = rows[layer]


class LeaderKV(PagedKV):
    """Rank 0's pool: a tree's kept path moves the rows of every rank's pool; a K/V chunk is
    every rank's heads in rank order ([layers, 2, kv_heads/N × N, n, dim]: gathered when read,
    scattered when loaded), so K/V chunks hold the whole model's K/V."""

    def __init__(self, spec, num_blocks: int, leader: Leader):
        super().__init__(spec, num_blocks)
        self.leader = leader

    def move_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.leader.send([OP_MOVE, len(src)], torch.tensor([*src, *dst], dtype=torch.long))
        super().move_slots(src, dst)

    def read(self, session_id: str, begin: int, end: int) -> torch.Tensor:
        import torch.distributed as dist

        local = super().read(session_id, begin, end)  # checked first: [layers, 2, kv_heads/N, n, dim]
        slots = self.slots_of(self._session(session_id), range(begin, end))
        self.leader.send([OP_READ, len(slots)], torch.tensor(slots, dtype=torch.long))
        parts = [torch.empty_like(local) for _ in range(self.leader.parallel.size)]
        dist.gather(local, parts, dst=0, group=self.leader.parallel.group)
        return torch.cat(parts, dim=2)  # [layers, 2, kv_heads/N × N, n, dim]

    def extend(self, session_id: str, chunk: torch.Tensor) -> None:
        import torch.distributed as dist

        size = self.leader.parallel.size
        if chunk.shape[2] != self.spec.kv_heads * size:
            raise ValueError(f"a chunk of {chunk.shape[2]} K/V heads for {size} ranks of {self.spec.kv_heads}")
        slots = self.append(session_id, chunk.shape[3])
        self.leader.send([OP_WRITE, len(slots)], torch.tensor(slots, dtype=torch.long))
        parts = [p.to(device=self.spec.device, dtype=self.spec.dtype).contiguous()
                 for p in chunk.split(self.spec.kv_heads, dim=2)]
        mine = torch.empty_like(parts[0])
        dist.scatter(mine, parts, src=0, group=self.leader.parallel.group)
        write_rows(self, slots, mine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> torch.device:
    """cuda:r of what the process sees for a CUDA service, the CPU otherwise."""
    return torch.device(f"cuda:{rank}") if torch.device(device).type == "cuda" else torch.device("cpu")


def start_ranks(model: str, dtype: str, device: str, size: int, init: str, threads: int) -> list[subprocess.Popen]:
    """Ranks 1..size-1 as child processes (they inherit the environment, PYTHONPATH included)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return [subprocess.Popen([sys.executable, "-m", "specdec.runtime.graph.ranks", str(rank), str(size), init,
                              model, dtype, device, str(threads), str(os.getpid())], env=env)
            for rank in range(1, size)]


def join_group(rank: int, size: int, init: str, device: torch.device, heads: int, kv_heads: int,
               intermediate: int) -> TensorParallel:
    """Join the group (header waits without deadline) and make the collective group (with one)."""
    import torch.distributed as dist

    init_group(rank, size, init, device, timeout_s=IDLE_TIMEOUT.total_seconds())
    collective = dist.new_group(timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TensorParallel(shard_plan(heads, kv_heads, intermediate, rank, size), collective)


def watch_parent(parent: int) -> None:
    """Exit this rank when the service that started it is gone (a daemon thread)."""
    def run() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(EXIT_RANK_FAILED)

    threading.Thread(target=run, name="tp-parent", daemon=True).start()


def serve_rank(rank: int, size: int, init: str, model: str, dtype: str, device: str, threads: int,
               parent: int) -> None:
    """A rank other than 0: load the shards, then run what rank 0 broadcasts until OP_STOP."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from specdec.runtime.loader import TORCH_DTYPES
    from specdec.runtime.graph.shards import load_shard

    watch_parent(parent)
    torch.set_num_threads(max(1, threads))
    where = rank_device(device, rank)
    config = AutoConfig.from_pretrained(model)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    parallel = join_group(rank, size, init, where, heads, kv, config.intermediate_size)
    graph = load_shard(model, TORCH_DTYPES[dtype], where, rank, size, parallel)
    kv_pool: PagedKV | None = None
    words = torch.zeros(HEADER, dtype=torch.long, device=where)
    with torch.inference_mode():
        while True:
            dist.broadcast(words, 0)
            op, *args = words.tolist()
            if op == OP_STOP:
                break
            if op == OP_POOL:
                kv_pool = PagedKV(graph.pool_spec(args[1]), args[0])
            elif op == OP_FORWARD:
                keep, R, Q, B, W = args[:5]
                payload = parallel.broadcast(torch.empty(payload_size(R, Q, B, W), dtype=torch.long, device=where))
                graph.hidden_states(unpack_batch(payload, R, Q, B, W), kv_pool.pools, None if keep < 0 else keep)
            elif op == OP_MOVE:
                n = args[0]
                moves = parallel.broadcast(torch.empty(2 * n, dtype=torch.long, device=where)).tolist()
                kv_pool.move_slots(moves[:n], moves[n:])
            elif op in (OP_READ, OP_WRITE):
                slots = parallel.broadcast(torch.empty(args[0], dtype=torch.long, device=where)).tolist()
                spec = kv_pool.spec
                if op == OP_READ:
                    dist.gather(rows_at(kv_pool, slots), None, dst=0, group=parallel.group)
                else:
                    mine = torch.empty(spec.layers, 2, spec.kv_heads, len(slots), spec.head_dim, dtype=spec.dtype,
                                       device=where)
                    dist.scatter(mine, None, src=0, group=parallel.group)
                    write_rows(kv_pool, slots, mine)
    dist.destroy_process_group()


def tensor_parallel_engine(config: Any) -> Any:
    """A GraphEngine whose model is split over config.tensor_parallel_size ranks: this process is
    rank 0, the others are started here (and ended with it). ModelLoadError, before any process
    starts, for counts that do not divide or too few CUDA devices."""
    import functools
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from specdec.runtime.graph.buckets import Buckets, session_counts
    from specdec.runtime.graph.engine import GraphEngine
    from specdec.runtime.graph.model import arch_config
    from specdec.runtime.graph.parallel import check_tensor_parallel
    from specdec.runtime.graph.shards import load_shard
    from specdec.runtime.loader import TORCH_DTYPES, LoadedModel
    from specdec.tokenizer import ModelLoadError, load_tokenizer

    size = config.tensor_parallel_size
    if not os.path.isdir(config.model):
        raise ModelLoadError(f"--tensor-parallel-size reads each rank's shards from a checkpoint directory; "
                             f"{config.model!r} is not one (download it first)")
    hf_config = AutoConfig.from_pretrained(config.model)
    arch = arch_config(hf_config)
    check_tensor_parallel(arch.heads, arch.kv_heads, hf_config.intermediate_size, size)
    device = rank_device(config.device, 0)
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ModelLoadError(f"--tensor-parallel-size {size} needs {size} CUDA devices; this process sees "
                             f"{torch.cuda.device_count()}")
    for flag, value in (("--heads", getattr(config, "heads", "")),):
        if value:
            raise ModelLoadError(f"{flag} is not served at --tensor-parallel-size {size} yet; drop {flag} "
                                 "or serve with --tensor-parallel-size 1")
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = start_ranks(config.model, config.dtype, config.device, size, init, config.threads or 1)
    leader = Leader(None, procs, device)
    LEADERS.append(leader)
    leader.watch()  # a rank that fails to start ends the service too
    try:
        leader.parallel = join_group(0, size, init, device, arch.heads, arch.kv_heads,
                                     hf_config.intermediate_size)
        parallel = leader.parallel
        model = LeaderModel(load_shard(config.model, TORCH_DTYPES[config.dtype], device, 0, size, parallel), leader)
        try:
            generation = GenerationConfig.from_pretrained(config.model)
        except OSError:
            generation = None
        loaded = LoadedModel(SimpleNamespace(config=hf_config, generation_config=generation),
                             load_tokenizer(config.model, config.trust_remote_code), config.model,
                             TORCH_DTYPES[config.dtype], device)
        engine = GraphEngine(loaded, config.max_sessions, config.kv_cache_memory_fraction or config.kv_cache_bytes,
                             config.max_speculative_tokens, config.prefill_chunk,
                             buckets=Buckets(rows=session_counts(config.max_batch_size)),
                             capture=False, model=model, kv_type=functools.partial(LeaderKV, leader=leader))
        leader.send([OP_POOL, engine.kv.num_blocks, engine.kv_spec.block_size])
        # K/V chunks hold every rank's heads, keyed for N (the config names it)
        engine.chunk_spec = dataclasses.replace(engine.kv_spec, kv_heads=engine.kv_spec.kv_heads * size)
        hf_config.tensor_parallel_size = size
    except BaseException:
        leader.stopped = True
        LEADERS.remove(leader)
        for proc in procs:
            proc.kill()
            proc.wait()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    log.info("%s: tensor parallel over %d ranks (%s), rank 0 here", config.model, size,
             "NCCL" if device.type == "cuda" else "gloo")
    return engine


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=f"rank {sys.argv[1]}: %(levelname)s %(message)s")
    serve_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6],
               int(sys.argv[7]), int(sys.argv[8]))
