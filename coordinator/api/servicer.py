"""gRPC servicer of the coordinator: protobuf in, round-loop call, protobuf out."""

from __future__ import annotations

from specdec.rpc.convert import logprobs_to_pb, sampling_from_pb
from specdec.rpc.status import map_errors
from specdec.types import Source
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

from coordinator.round_loop import RoundLoop
from coordinator.request import GenerationRequest
from coordinator.rounds import FinishReason
from coordinator.stats import GenerationStats

FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.CONTEXT: common_pb2.FINISH_REASON_CONTEXT_LENGTH,
}


PROPOSER_FROM_PB = {
    coordinator_pb2.PROPOSER_UNSPECIFIED: None,
    coordinator_pb2.PROPOSER_AUTO: Source.AUTO,
    coordinator_pb2.PROPOSER_DRAFT: Source.DRAFT,
    coordinator_pb2.PROPOSER_NGRAM: Source.PROMPT_LOOKUP,  # the wire keeps its old name
    coordinator_pb2.PROPOSER_NONE: Source.NONE,
    coordinator_pb2.PROPOSER_HEADS: Source.HEADS,
}


def proposer_from_pb(value: int) -> Source | str | None:
    """The proposer's name; an unknown enum number stays visible for the round loop to refuse."""
    return PROPOSER_FROM_PB.get(value, f"unknown enum value {value}")


def request_from_pb(pb: coordinator_pb2.GenerateRequest) -> GenerationRequest:
    which = pb.WhichOneof("input")
    return GenerationRequest(
        session_id=pb.session_id,
        prompt=pb.prompt if which == "prompt" else None,
        token_ids=tuple(pb.token_ids.ids) if which == "token_ids" else None,
        messages=tuple((m.role, m.content) for m in pb.messages.messages) if which == "messages" else None,
        params=sampling_from_pb(pb.sampling),
        seed=pb.sampling.seed if pb.sampling.HasField("seed") else None,
        max_new_tokens=pb.max_new_tokens if pb.HasField("max_new_tokens") else None,
        num_speculative_tokens=pb.num_speculative_tokens if pb.HasField("num_speculative_tokens") else None,
        stop=tuple(pb.stop),
        ignore_eos=pb.ignore_eos,
        proposer=proposer_from_pb(pb.proposer),
        cache_salt=pb.cache_salt,
        top_logprobs=pb.top_logprobs if pb.HasField("top_logprobs") else None,
        tree_nodes=pb.tree_nodes,
    )


def stats_to_pb(stats: GenerationStats) -> common_pb2.GenerationStats:
    data = stats.to_dict()
    return common_pb2.GenerationStats(**data)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, round_loop: RoundLoop):
        self.round_loop = round_loop

    @map_errors
    async def Generate(self, request, context):
        async for chunk in self.round_loop.generate(request_from_pb(request)):
            yield coordinator_pb2.GenerateResponse(
                session_id=chunk.session_id, text=chunk.text, token_ids=chunk.token_ids,
                finish_reason=FINISH_TO_PB[chunk.finish_reason],
                stats=stats_to_pb(chunk.stats) if chunk.stats else None,
                logprobs=[logprobs_to_pb(entry) for entry in chunk.logprobs],
            )

    @map_errors
    async def Complete(self, request, context):
        response = coordinator_pb2.CompleteResponse()
        async for chunk in self.round_loop.generate(request_from_pb(request.request)):
            response.session_id = chunk.session_id
            response.text += chunk.text
            response.token_ids.extend(chunk.token_ids)
            response.logprobs.extend(logprobs_to_pb(entry) for entry in chunk.logprobs)
            if chunk.finish_reason:
                response.finish_reason = FINISH_TO_PB[chunk.finish_reason]
                response.stats.CopyFrom(stats_to_pb(chunk.stats))
        return response

    @map_errors
    async def GetSession(self, request, context):
        record = await self.round_loop.get_session(request.session_id)
        return coordinator_pb2.GetSessionResponse(
            session_id=record.session_id, token_ids=record.token_ids, requests=record.requests,
            stats=stats_to_pb(GenerationStats.from_dict(record.stats)),
            created_at=record.created_at, updated_at=record.updated_at,
        )

    @map_errors
    async def DeleteSession(self, request, context):
        deleted = await self.round_loop.delete_session(request.session_id)
        return coordinator_pb2.DeleteSessionResponse(deleted=deleted)
