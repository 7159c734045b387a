"""gRPC servicer of the draft tier: protobuf in, the engine's drafting on the model worker,
protobuf out. It calls the engine contract (specdec/runtime/engine.py) and nothing else."""

from __future__ import annotations

from typing import Callable

from specdec.rpc.convert import description_for, dist_to_pb, model_info_to_pb, sampling_from_pb
from specdec.rpc.status import map_errors
from specdec.rpc.streaming import serve_calls
from specdec.runtime.serving.calls import deadline_of, run_call
from specdec.runtime.engine import Drafting, ModelEngine
from specdec.runtime.serving.scheduler import BatchScheduler
from specdec.types import ModelDescription
from specdec.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine: ModelEngine, drafting: Drafting, description: ModelDescription,
                 scheduler: BatchScheduler, fingerprint: Callable[[int], str]):
        self.engine = engine
        self.drafting = drafting  # the engine's γ-step loop
        self.description = description
        self.scheduler = scheduler
        self.worker = scheduler.worker
        self.fingerprint = fingerprint  # tokenizer fingerprint over the ids below a size

    @map_errors
    async def GetModelInfo(self, request, context):
        description = description_for(request, self.description, self.fingerprint)
        return draft_pb2.DraftServiceGetModelInfoResponse(info=model_info_to_pb(description))

    @map_errors
    async def Propose(self, request: draft_pb2.ProposeRequest, context):
        return await self.propose(request, deadline_of(context))

    async def ProposeStream(self, requests, context):
        """Propose calls multiplexed on one stream, each run as `propose` (see specdec/rpc/streaming.py)."""
        async for answer in serve_calls(requests, context, self.propose, draft_pb2.ProposeStreamResponse):
            yield answer

    async def propose(self, request: draft_pb2.ProposeRequest,
                      deadline: float | None) -> draft_pb2.ProposeResponse:
        """One Propose call, unary or streamed (domain errors propagate); not started after
        `deadline` (time.monotonic())."""
        call = self.drafting.call(
            request.session_id, request.prefix_len, request.prefix_hash, list(request.new_tokens),
            request.num_speculative_tokens, sampling_from_pb(request.sampling), request.seed,
            list(request.hint_tokens), request.min_confidence, request.uncommitted_tokens,
            request.cache_salt, request.tree_nodes,
        )
        proposal = await run_call(self.scheduler, self.engine, call, deadline)
        return draft_pb2.ProposeResponse(
            draft_tokens=proposal.draft_tokens,
            draft_probs=[dist_to_pb(d) for d in proposal.draft_probs],
            cached_len=proposal.cached_len,
            num_hint_tokens_kept=proposal.hints_kept,
            restored_tokens=proposal.restored_tokens,
            draft_parents=proposal.parents,
        )

    @map_errors
    async def Release(self, request, context):
        self.scheduler.forget(request.session_id)
        return draft_pb2.DraftServiceReleaseResponse(released=self.engine.release(request.session_id))
