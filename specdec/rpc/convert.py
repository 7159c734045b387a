"""Protobuf <-> domain conversion for the types the services share."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specdec.cores import CpuPlacement
from specdec.errors import InvalidArgument
from specdec.types import ModelDescription, SamplingParams, SparseDist, TokenLogprobs
from specdec.v1 import common_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take their defaults; the result is validated."""
    params = SamplingParams(
        temperature=pb.temperature if pb.HasField("temperature") else SamplingParams.temperature,
        top_k=pb.top_k if pb.HasField("top_k") else 0,
        top_p=pb.top_p if pb.HasField("top_p") else SamplingParams.top_p,
    )
    params.validate()
    return params


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                     top_p=params.top_p)


def dist_from_pb(pb: common_pb2.SparseDistribution) -> SparseDist:
    return SparseDist(tuple(pb.token_ids), tuple(pb.probs))


def dist_to_pb(dist: SparseDist) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(token_ids=dist.token_ids, probs=dist.probs)


def logprobs_to_pb(entry: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=entry.token_id, logprob=entry.logprob,
                                    top_token_ids=[token for token, _ in entry.top],
                                    top_logprobs=[logprob for _, logprob in entry.top])


def logprobs_from_pb(pb: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(pb.token_id, pb.logprob, tuple(zip(pb.top_token_ids, pb.top_logprobs)))


def model_info_to_pb(desc: ModelDescription) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=desc.model_id,
        vocab_size=desc.vocab_size,
        tokenizer_fingerprint=desc.tokenizer_fingerprint,
        tokenizer_vocab_size=desc.tokenizer_vocab_size,
        eos_token_ids=desc.eos_token_ids,
        max_context_length=desc.max_context_length,
        dtype=desc.dtype,
        device=desc.device,
        max_speculative_tokens=desc.max_speculative_tokens,
        cpu=None if desc.cpu is None else common_pb2.CpuPlacement(
            boot_id=desc.cpu.boot_id, cores=sorted(desc.cpu.cores), threads=desc.cpu.threads),
        verifies_trees=desc.verifies_trees,
        num_heads=desc.num_heads,
        heads_id=desc.heads_id,
        checkpoint_id=desc.checkpoint_id,
    )


def description_for(request: Any, description: ModelDescription,
                    fingerprint: Callable[[int], str]) -> ModelDescription:
    """What a Draft/TargetService GetModelInfo request asks for: the description, its tokenizer
    fingerprint over the ids below request.fingerprint_vocab_size when that is set."""
    if not request.HasField("fingerprint_vocab_size"):
        return description
    limit = request.fingerprint_vocab_size
    if limit < 1:
        raise InvalidArgument(f"fingerprint_vocab_size must be >= 1 (or unset), got {limit}")
    return dataclasses.replace(description, tokenizer_fingerprint=fingerprint(limit))


def model_info_from_pb(pb: common_pb2.ModelInfo) -> ModelDescription:
    return ModelDescription(
        model_id=pb.model_id,
        vocab_size=pb.vocab_size,
        tokenizer_fingerprint=pb.tokenizer_fingerprint,
        tokenizer_vocab_size=pb.tokenizer_vocab_size,
        eos_token_ids=tuple(pb.eos_token_ids),
        max_context_length=pb.max_context_length,
        dtype=pb.dtype,
        device=pb.device,
        max_speculative_tokens=pb.max_speculative_tokens,
        cpu=_placement_from_pb(pb.cpu) if pb.HasField("cpu") else None,
        verifies_trees=pb.verifies_trees,
        num_heads=pb.num_heads,
        heads_id=pb.heads_id,
        checkpoint_id=pb.checkpoint_id,
    )


def _placement_from_pb(pb: common_pb2.CpuPlacement) -> CpuPlacement | None:
    """A reported placement, or None when it is not one (a service of another version)."""
    try:
        return CpuPlacement(pb.boot_id, frozenset(pb.cores), pb.threads)
    except ValueError:
        return None
