"""One frozen config dataclass per service, read once from CLI flags and env.

Every field is a flag (``--max-sessions``) with an environment equivalent
(``SPECDEC_<SERVICE>_MAX_SESSIONS``); a flag wins over the env, the env over the
default. The object is built once in the CLI and passed down: no globals.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Mapping, TypeVar

from specdec.types import (Backend, CoreSharing, CudaGraphs, DiscoveryKind, DraftAhead, KVCacheType, Source,
                           Quantization, RpcTransport, Trees)

DTYPES = ("float64", "float32", "bfloat16", "float16")
TARGET_QUANTIZATIONS = (Quantization.NONE.value, Quantization.INT8.value, Quantization.INT4.value)  # no auto

C = TypeVar("C")


def choices_of(names: type[StrEnum]) -> tuple[str, ...]:
    """A setting's choices, as the flag and the environment spell them."""
    return tuple(member.value for member in names)


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None, many: bool = False) -> Any:
    """A config field with its help text (and optional choices). many: the flag takes one or more
    values (`--flag a b`), kept comma-separated as the environment variable spells them."""
    return field(default=default, metadata={"help": help, "choices": choices, "many": many})


@dataclass(frozen=True)
class ServerTlsConfig:
    """TLS on a service's own port; all three services have these fields."""

    tls_cert_file: str = opt("", "PEM certificate (chain) this server presents; with --tls-key-file "
                             "turns TLS on (default: plaintext)")
    tls_key_file: str = opt("", "PEM private key of --tls-cert-file (unencrypted)")
    tls_client_ca_file: str = opt("", "PEM CA: require client certificates signed by it (mutual TLS)")


@dataclass(frozen=True)
class ModelServiceConfig(ServerTlsConfig):
    """What the draft and the target service share."""

    model: str = opt("", "model directory, hub id or .gguf file (required)")
    backend: str = opt("auto", "engine: llama.cpp (a .gguf file, served quantised as it is, through "
                       "llama-cpp-python), torch (transformers: a directory, a hub id, or a .gguf file "
                       "dequantised to --dtype), graph (Llama / Qwen2 / Mistral checkpoints on specdec's "
                       "static-shape model over a paged K/V pool of --kv-cache-bytes, CUDA graphs captured "
                       "at start on CUDA), or auto (llama.cpp for a .gguf file when llama-cpp-python is "
                       "installed, graph on CUDA for the architectures it covers, else torch)",
                       choices_of(Backend))
    cuda_graphs: str = opt("auto", "graph backend: capture CUDA graphs of its buckets at start — auto (on a CUDA "
                           "device, unless the environment's SPECDEC_CUDA_GRAPHS says on or off), on, or off "
                           "(every bucket runs eagerly: the same code and shapes, slower; a bucket that fails "
                           "to capture runs eagerly anyway). The buckets trade padding for fewer graphs: rows "
                           "1, 4, 16 and --max-batch-size, query columns 1, 5, 9, 16, keys per row 512 tokens "
                           "times 1, 4, 16 ... up to the context — 32 graphs a target for a 2k context, 64 for "
                           "32k (seconds of start-up, one shared logits buffer), at most 3/4 of the rows and of "
                           "the keys read being padding (docs/design.md, Engines)", choices_of(CudaGraphs))
    dtype: str = opt("bfloat16", "weight dtype (torch and graph backends)", DTYPES)
    device: str = opt("cpu", "torch device: cpu, cuda, cuda:1 ... (llama.cpp: cpu, or any other value to "
                      "offload every layer to the GPU llama-cpp-python was built for)")
    tensor_parallel_size: int = opt(1, "graph backend: split the model over N rank processes started by this "
                                    "service (Megatron-style tensor parallelism; cuda:0..N-1, or N CPU "
                                    "processes with --device cpu); N must divide the attention heads")
    threads: int = opt(0, "CPU threads of the model (0 = the backend's default: torch's own, or every core "
                       "for llama.cpp)")
    kv_cache_type: str = opt("f16", "element type of the K/V cache (llama.cpp backend)", choices_of(KVCacheType))
    kv_cache_tokens: int = opt(0, "K/V cells the llama.cpp backend allocates at start, shared by all "
                               "sessions (0 = --kv-cache-bytes / the bytes of one token, at most 32768)")
    host: str = opt("127.0.0.1", "address to bind; 0.0.0.0 in a container")
    port: int = opt(0, "port to listen on (0 = the service default)")
    metrics_port: int = opt(0, "Prometheus /metrics port (0 = off)")
    max_sessions: int = opt(256, "most sessions whose KV cache is kept (LRU beyond)")
    kv_cache_bytes: int = opt(4 << 30, "memory budget for all KV caches in bytes (LRU beyond); the graph "
                              "backend allocates its pool of this size at start (at most what "
                              "--max-sessions sessions of the full context take)")
    kv_cache_memory_fraction: float = opt(0.0, "graph backend on CUDA: the K/V pool takes this fraction "
                                          "(0 < f <= 1) of the GPU's free memory once the model is loaded and "
                                          "an estimate of what CUDA-graph capture takes (its shared outputs "
                                          "and largest bucket's activations) is set aside, instead of "
                                          "--kv-cache-bytes (0 = off); leave room for another service on the "
                                          "same GPU")
    max_speculative_tokens: int = opt(16, "most draft tokens per call")
    kv_store: str = opt("", "shared store of K/V chunks: redis://[:PASSWORD@]HOST:PORT/DB (rediss:// for "
                        "TLS), memory:// (this process only), or empty (off). A session this replica "
                        "lacks, and a new session's prompt, load the chunks found there instead of "
                        "prefilling them (torch backend with K/V buffers, graph backend)")
    kv_store_ttl_s: float = opt(3600.0, "seconds a K/V chunk is kept in --kv-store after its last write")
    kv_chunk_tokens: int = opt(256, "tokens per K/V chunk of the prefix cache and --kv-store (the same on "
                               "every replica of a model: keys depend on it)")
    prefix_cache_bytes: int = opt(256 << 20, "memory for recently used K/V chunks, in addition to "
                                  "--kv-cache-bytes, so sessions that share a prompt prefix on this "
                                  "replica prefill it once (0 = off)")
    prefill_chunk: int = opt(512, "longest input run in one forward; longer prompts are prefilled in "
                             "chunks, with other sessions' calls in between")
    max_queue: int = opt(256, "calls waiting for the model at most; more get RESOURCE_EXHAUSTED")
    batch_wait_ms: float = opt(2.0, "longest a call waits for other sessions' calls to share its forward "
                               "(0 = no waiting; calls that queue behind a running batch still batch)")
    max_batch_size: int = opt(32, "most sessions in one batched forward (1 = no batching)")
    max_batch_tokens: int = opt(4096, "most tokens in one batched forward, padding included (sessions x "
                                "longest input); a single longer call still runs alone")
    max_message_bytes: int = opt(16 << 20, "largest gRPC message accepted or sent")
    trust_remote_code: bool = opt(False, "allow model code from the checkpoint (hub models only)")
    prepack: bool = opt(True, "reorder a bfloat16 model's linear weights once at load into oneDNN's "
                        "blocked layout, where this CPU takes it (torch backend, CPU): the same products, "
                        "read faster; --no-prepack runs F.linear on the weights as loaded")


@dataclass(frozen=True)
class DraftConfig(ModelServiceConfig):
    """Config of the draft service."""

    proposal_top_k: int = opt(32, "the draft samples from its top-K truncated distribution (K)")
    quantize: str = opt("auto", "weights of the draft's linear layers: int8 (weight-only int8, CPU "
                        "only: shorter draft steps; its proposals change a little, the output does "
                        "not), int4 (weight-only 4-bit in groups of 32, CPU only), none, or auto (int8 on "
                        "a CPU in bfloat16/float16/float32, else none)",
                        choices_of(Quantization))


@dataclass(frozen=True)
class TargetConfig(ModelServiceConfig):
    """Config of the target service."""

    quantize: str = opt("none", "weights of the target's linear layers: none, or, as an explicit choice, "
                        "int8 or int4 (weight-only, CPU only: shorter steps, but the model served is "
                        "then the quantized one, and so is the output)", TARGET_QUANTIZATIONS)
    heads: str = opt("", "directory of Medusa-style heads trained for this model (`specdec distill "
                     "--heads K`): Verify then proposes the next round's tokens from the target's own "
                     "hidden state (torch and graph backends; heads of another model are refused at "
                     "start); empty = none")


@dataclass(frozen=True)
class CoordinatorConfig(ServerTlsConfig):
    """Config of the coordinator."""

    draft: str = opt("127.0.0.1:50052", "draft replicas: host:port, comma-separated (static discovery)")
    target: str = opt("127.0.0.1:50053", "target replicas: host:port, comma-separated (static discovery)")
    discovery: str = opt("static", "how replicas are found: the --draft/--target lists, or the "
                         "EndpointSlices of --draft-service/--target-service", choices_of(DiscoveryKind))
    draft_service: str = opt("", "Kubernetes Service of the draft replicas (--discovery kubernetes)")
    target_service: str = opt("", "Kubernetes Service of the target replicas (--discovery kubernetes)")
    namespace: str = opt("", "namespace of those Services (default: the coordinator's own, else the "
                         "kubeconfig context's)")
    draft_port: int = opt(50052, "gRPC port of the draft pods (--discovery kubernetes)")
    target_port: int = opt(50053, "gRPC port of the target pods (--discovery kubernetes)")
    host: str = opt("127.0.0.1", "address to bind; 0.0.0.0 in a container")
    port: int = opt(50051, "port to listen on")
    metrics_port: int = opt(0, "Prometheus /metrics port (0 = off)")
    tokenizer: str = opt("", "tokenizer directory or hub id (default: the target's model id)")
    session_store: str = opt("memory", "session store: memory, or redis://[:PASSWORD@]HOST:PORT/DB "
                             "(rediss:// for TLS), redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB] "
                             "or redis+cluster://HOST:PORT[,HOST:PORT...]")
    session_durability: str = opt("none", "when a round's commit counts as stored: none (the primary "
                                  "has it; a failover may lose it), or replicas=N[,timeout_ms=T] "
                                  "(WAIT N T: N replicas have it, else the request fails UNAVAILABLE, "
                                  "retryable; T defaults to 1000)")
    session_ttl_s: float = opt(86400.0, "seconds a session is kept after its last write (Redis)")
    session_lease_s: float = opt(30.0, "a request's hold on its session (renewed every third of this "
                                 "while it runs) lapses after this long unrenewed (Redis)")
    session_holder_ttl_s: float = opt(6.0, "a killed coordinator's sessions are free again after at "
                                      "most this long: each coordinator refreshes a liveness key in "
                                      "Redis every third of this, and the next request takes over a "
                                      "lease whose coordinator's key lapsed (Redis)")
    max_concurrent_generations: int = opt(64, "requests generating at once; more get RESOURCE_EXHAUSTED")
    draft_timeout_s: float = opt(10.0, "budget of one Propose call; slower or failing drafts make the "
                                 "round target-only (a request that timed out backs off the draft "
                                 "for 1, 2, 4, ... rounds)")
    draft_cold_deadline_s: float = opt(30.0, "budget of the Propose calls to a draft replica until it "
                                       "has answered one (its first call may run cold: a long "
                                       "prompt's prefill, first allocations, a busy machine); then "
                                       "--draft-timeout-s")
    draft_retry_s: float = opt(5.0, "a failing draft replica is skipped for at least this long (rounds "
                               "are target-only while no draft replica is usable)")
    target_retry_s: float = opt(60.0, "how long to keep retrying an unreachable or timed-out target "
                                "before failing the request with UNAVAILABLE (DEADLINE_EXCEEDED when "
                                "its calls ran out of time)")
    default_max_new_tokens: int = opt(128, "max_new_tokens when a request leaves it unset")
    max_new_tokens_limit: int = opt(4096, "largest max_new_tokens a request may ask for")
    default_num_speculative_tokens: int = opt(4, "γ of the first rounds of adaptive γ (a request that "
                                              "leaves num_speculative_tokens unset), before acceptance "
                                              "and costs are measured")
    max_num_speculative_tokens: int = opt(16, "largest γ a request may ask for, and the most adaptive γ "
                                          "picks")
    default_proposer: str = opt("auto", "proposal source when a request leaves proposer unset: auto "
                                "(per round, prompt lookup, the draft model, the target's heads or none, "
                                "whichever pays most), draft, ngram (prompt lookup only), none or heads "
                                "(the target's heads only)", choices_of(Source))
    head_candidates: int = opt(4, "where the target serves Medusa-style heads (--heads), every Verify "
                               "of a request that may use them (proposer heads or auto) asks for each "
                               "head's this many likeliest tokens, proposed as a token tree in the next "
                               "round (0: never ask; at most 32)")
    ngram_max: int = opt(3, "longest n-gram prompt lookup matches against the session's history "
                         "(it tries n = this .. 1)")
    ngram_max_tokens: int = opt(16, "most tokens one prompt lookup proposes")
    load_governor: bool = opt(True, "while 2+ generations run, compare the coordinator's tokens/s with "
                              "and without speculation in short trials and keep the better for two "
                              "minutes, longer while the same verdict repeats decisively (requests "
                              "that fix γ or the proposer are left alone)")
    draft_hints: bool = opt(True, "under proposer auto, send prompt lookup's tokens with a draft-model "
                            "round as hints: the draft keeps those it agrees with at no extra step")
    draft_min_confidence: float = opt(0.4, "adaptive γ: the draft stops proposing after a token it "
                                      "gave less than this probability, so γ is a ceiling it fills "
                                      "only where it is sure (0 = always exactly γ; a fixed γ is "
                                      "always exactly γ)")
    trees: str = opt("off", "auto: adaptive draft-model rounds propose a token tree instead of a chain "
                     "where the cost model expects more tokens per second of it (a flat verify cost, "
                     "an unsure draft; the draft must grow trees and the target verify them); off: "
                     "chains, unless a request asks for a tree (tree_nodes); a request's tree_nodes "
                     "= 1 turns trees off for it",
                     choices_of(Trees))
    draft_ahead: str = opt("auto", "while a draft-model round is verified, ask the draft to go on past its "
                           "drafts (guessing the target's bonus token) for the next round; when the target "
                           "accepts them all and its bonus is the guess, the next round needs no draft "
                           "call. It pays where the draft and the target run on separate hardware (the "
                           "draft works while the target verifies) and loses where they share the same "
                           "cores: auto measures which (short alternating epochs with and without, per "
                           "load band, the winner held for 10 minutes and 10x the trial's rounds, and longer), on "
                           "and off fix it",
                           choices_of(DraftAhead))
    tiers_share_cores: str = opt("auto", "whether the draft and the target compete for the same CPU "
                                 "cores; when they do, the draft never works beside a verification "
                                 "(no calls made ahead under --draft-ahead auto, no prompt sent "
                                 "alongside a first round that does not use it). auto: they do when "
                                 "the first draft and target replicas report the same kernel, "
                                 "overlapping cores and more threads than those cores",
                                 choices_of(CoreSharing))
    draft_cost_ratio: float = opt(0.0, "c = draft step time / target verify time assumed by adaptive "
                                  "γ instead of measuring round timings (0 = measure)")
    max_prompt_tokens: int = opt(0, "longest prompt in tokens (0 = the model context)")
    rpc_timeout_s: float = opt(60.0, "deadline of a call of ordinary size to the draft / target "
                               "service: one forward of up to 512 input tokens (a round, or one "
                               "chunk of a long prefill). A call with more input (a long prompt, a "
                               "session restored after a restart) gets this per 512 tokens, or 3x "
                               "what the replica's measured pace says, whichever is longer, counted "
                               "again from each prefill chunk a streamed call finished; a streamed "
                               "call that hears neither its answer nor a progress message (the "
                               "service sends a heartbeat while it works) for this long is given "
                               "up (a stopped service)")
    rpc_transport: str = opt("stream", "how Propose and Verify travel: stream (multiplexed on one "
                             "long-lived gRPC stream per replica: less per-call overhead; a replica "
                             "without it gets unary calls) or unary (one gRPC call each)",
                             choices_of(RpcTransport))
    max_message_bytes: int = opt(16 << 20, "largest gRPC message accepted or sent")
    upstream_ca_file: str = opt("", "PEM CA that signed the draft's and target's certificates; "
                                "turns on TLS to them (default: plaintext)")
    upstream_cert_file: str = opt("", "PEM client certificate presented to draft and target (mutual TLS)")
    upstream_key_file: str = opt("", "PEM private key of --upstream-cert-file")
    upstream_server_name: str = opt("", "name checked in the tiers' certificates instead of the host "
                                    "of --draft / --target")
    api_key_file: str = opt("", "file holding the API key clients must send as metadata "
                            "'authorization: Bearer <key>' (default: no key; health and reflection "
                            "stay open)")
    http_port: int = opt(0, "OpenAI-compatible HTTP API port: /v1/completions, /v1/chat/completions, "
                         "/v1/models, /health, on --host with the TLS and API key of the gRPC port "
                         "(0 = off; -1 = any free port)")
    served_model_name: str = opt("", "the model name(s) the OpenAI-compatible API answers to and GET "
                                 "/v1/models lists, the first in responses unless a request names "
                                 "another (default: the target's model: a hub id as it is, a path's "
                                 "base name less .gguf); several: space-separated after the flag, "
                                 "comma-separated in the environment", many=True)
    http_max_body_bytes: int = opt(1 << 20, "largest HTTP request body the OpenAI-compatible API accepts "
                                   "(larger ones get 413)")
    record_dir: str = opt("", "append training records to JSON-lines files in this directory: per "
                          "finished request its tokens and which proposals the target rejected (see "
                          "docs/operations.md#recording); never a request with a cache_salt; empty = off")
    record_max_bytes: int = opt(1 << 30, "most bytes of records --record-dir holds, its files together; "
                                "past it new records are dropped until files are moved away")
    record_stream: str = opt("", "add the training records to this Redis stream, in the Redis of "
                             "--session-store (which must be a Redis URL); empty = off")
    record_max_len: int = opt(100000, "most records --record-stream keeps (older ones are trimmed)")


def names_of(value: str) -> tuple[str, ...]:
    """The values of a field of several (opt's many): comma-separated, blanks dropped."""
    return tuple(name.strip() for name in value.split(",") if name.strip())


def help_of(cls: type, name: str) -> str:
    """The help text of one field of `cls` (a command that passes the field on to a service)."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(prefix: str, name: str) -> str:
    return f"SPECDEC_{prefix.upper()}_{name.upper()}"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(kind: type, text: str) -> Any:
    if kind is bool:
        return _parse_bool(text)
    return kind(text)


def add_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str) -> None:
    """Add one flag per field of `cls`; defaults are resolved later (env, then default)."""
    for f in dataclasses.fields(cls):
        env = env_name(prefix, f.name)
        help_text = f"{f.metadata.get('help', '')} (env {env}; default {f.default!r})"
        if f.type in ("bool", bool):
            parser.add_argument(_flag(f.name), dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, nargs="+" if f.metadata.get("many") else None,
                                choices=f.metadata.get("choices"), help=help_text)


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def from_sources(cls: type[C], prefix: str, args: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> C:
    """Build `cls` from parsed flags (None = not given), then env, then defaults."""
    args = args or {}
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind = _TYPES[f.type] if isinstance(f.type, str) else f.type
        raw = args.get(f.name)
        source = _flag(f.name)
        if raw is None and env_name(prefix, f.name) in env:
            raw, source = env[env_name(prefix, f.name)], env_name(prefix, f.name)
        if raw is None:
            continue
        if isinstance(raw, list):  # a flag of several values (opt's many)
            raw = ",".join(raw)
        try:
            values[f.name] = raw if isinstance(raw, bool) else _convert(kind, str(raw))
        except ValueError as exc:
            raise SystemExit(f"invalid value for {source}: {raw!r} ({exc})") from None
        choices = f.metadata.get("choices")
        if choices and values[f.name] not in choices:
            raise SystemExit(f"invalid value for {source}: {raw!r} (choose from {', '.join(choices)})")
    return cls(**values)
