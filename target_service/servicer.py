"""gRPC servicer of the target tier: protobuf in, the engine's verification on the model worker,
protobuf out. It calls the engine contract (specdec/runtime/engine.py) and nothing else."""

from __future__ import annotations

from typing import Callable

from specdec.rpc.convert import (description_for, dist_from_pb, dist_to_pb, logprobs_to_pb, model_info_to_pb,
                                 sampling_from_pb)
from specdec.rpc.status import map_errors
from specdec.rpc.streaming import serve_calls
from specdec.runtime.serving.calls import deadline_of, run_call
from specdec.runtime.engine import ModelEngine, Verification
from specdec.runtime.serving.scheduler import BatchScheduler
from specdec.types import ModelDescription
from specdec.v1 import target_pb2, target_pb2_grpc


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: ModelEngine, verification: Verification, description: ModelDescription,
                 scheduler: BatchScheduler, fingerprint: Callable[[int], str]):
        self.engine = engine
        self.verification = verification  # the engine's forward plus acceptance
        self.description = description
        self.scheduler = scheduler
        self.worker = scheduler.worker
        self.fingerprint = fingerprint  # tokenizer fingerprint over the ids below a size

    @map_errors
    async def GetModelInfo(self, request, context):
        description = description_for(request, self.description, self.fingerprint)
        return target_pb2.TargetServiceGetModelInfoResponse(info=model_info_to_pb(description))

    @map_errors
    async def Verify(self, request: target_pb2.VerifyRequest, context):
        return await self.verify(request, deadline_of(context))

    async def VerifyStream(self, requests, context):
        """Verify calls multiplexed on one stream, each run as `verify` (see specdec/rpc/streaming.py)."""
        async for answer in serve_calls(requests, context, self.verify, target_pb2.VerifyStreamResponse):
            yield answer

    async def verify(self, request: target_pb2.VerifyRequest,
                     deadline: float | None) -> target_pb2.VerifyResponse:
        """One Verify call, unary or streamed (domain errors propagate); not started after
        `deadline` (time.monotonic())."""
        call = self.verification.call(
            request.session_id, request.prefix_len, request.prefix_hash, list(request.new_tokens),
            list(request.draft_tokens), [dist_from_pb(d) for d in request.draft_probs],
            sampling_from_pb(request.sampling), request.seed, request.cache_salt,
            request.top_logprobs if request.HasField("top_logprobs") else None,
            list(request.draft_parents), request.head_candidates,
        )
        verdict = await run_call(self.scheduler, self.engine, call, deadline)
        return target_pb2.VerifyResponse(
            num_accepted=verdict.num_accepted, next_token=verdict.next_token,
            is_bonus=verdict.is_bonus, accept_probs=verdict.accept_probs,
            cached_len=verdict.cached_len,
            restored_tokens=verdict.restored_tokens,
            logprobs=[logprobs_to_pb(entry) for entry in verdict.logprobs],
            accepted_nodes=verdict.accepted_nodes,
            head_proposals=[dist_to_pb(dist) for dist in verdict.head_proposals],
        )

    @map_errors
    async def Release(self, request, context):
        self.scheduler.forget(request.session_id)
        return target_pb2.TargetServiceReleaseResponse(released=self.engine.release(request.session_id))
