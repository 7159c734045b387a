"""gRPC servicer of the draft tier: protobuf in, domain call, protobuf out."""

from __future__ import annotations

from typing import Callable

from specdec.errors import InvalidArgument
from specdec.rpc.convert import description_for, dist_to_pb, model_info_to_pb, sampling_from_pb
from specdec.rpc.status import map_errors
from specdec.types import ModelDescription
from specdec.v1 import draft_pb2, draft_pb2_grpc

from draft_service.proposer import Proposer


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, proposer: Proposer, description: ModelDescription,
                 fingerprint: Callable[[int], str]):
        self.proposer = proposer
        self.description = description
        self.fingerprint = fingerprint  # tokenizer fingerprint over the ids below a size

    @map_errors
    def GetModelInfo(self, request, context):
        description = description_for(request, self.description, self.fingerprint)
        return draft_pb2.DraftServiceGetModelInfoResponse(info=model_info_to_pb(description))

    @map_errors
    def Propose(self, request: draft_pb2.ProposeRequest, context):
        gamma = request.num_speculative_tokens
        limit = self.description.max_speculative_tokens
        if not 1 <= gamma <= limit:
            raise InvalidArgument(f"num_speculative_tokens must be in [1, {limit}], got {gamma}")
        proposal = self.proposer.propose(
            request.session_id, request.prefix_len, list(request.new_tokens), gamma,
            sampling_from_pb(request.sampling), request.seed,
        )
        return draft_pb2.ProposeResponse(
            draft_tokens=proposal.draft_tokens,
            draft_probs=[dist_to_pb(d) for d in proposal.draft_probs],
            cached_len=proposal.cached_len,
        )

    @map_errors
    def Release(self, request, context):
        return draft_pb2.DraftServiceReleaseResponse(released=self.proposer.release(request.session_id))
