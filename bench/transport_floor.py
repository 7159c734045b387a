"""The transport floor of a round: a round's messages with no work behind them.

Three processes on loopback, as in bench/overhead.py: a draft and a target whose ProposeStream
and VerifyStream answer every call at once (a fixed response of the real message types, through
specdec.rpc.streaming as the real services answer), and a coordinator whose Generate makes, per
round, one Propose and one Verify call on its call streams (only Verify at γ = 0) and streams one
chunk. No model, batch scheduler, engine, policy, store or metrics: the wall time per round is
what gRPC, the call streams and the event loops cost alone, the floor that the orchestration
overhead measured by bench/overhead.py is compared with.

Run alone: python bench/transport_floor.py [--requests 15] [--max-new-tokens 128]
(bench/overhead.py runs it too and prints it beside its own tables).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.processes import cpu_columns, cpu_of, cpu_spent, free_port  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.rpc.streaming import CallStream, serve_calls  # noqa: E402
from specdec.v1 import (  # noqa: E402
    common_pb2, coordinator_pb2, coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc,
)

SESSION = "5f0c2a9e4b7d4e21a3c8d9f01b2e3c4d"  # a session id of the real length


class FloorDraft(draft_pb2_grpc.DraftServiceServicer):
    async def ProposeStream(self, requests, context):
        async def answer(request, deadline):
            return draft_pb2.ProposeResponse(draft_tokens=range(11, 11 + request.num_speculative_tokens),
                                             cached_len=request.prefix_len + 1)

        async for response in serve_calls(requests, context, answer, draft_pb2.ProposeStreamResponse):
            yield response


class FloorTarget(target_pb2_grpc.TargetServiceServicer):
    async def VerifyStream(self, requests, context):
        async def answer(request, deadline):
            return target_pb2.VerifyResponse(num_accepted=len(request.draft_tokens), next_token=7,
                                             is_bonus=True, cached_len=request.prefix_len + 1)

        async for response in serve_calls(requests, context, answer, target_pb2.VerifyStreamResponse):
            yield response


class FloorCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, draft: str, target: str):
        self.channels = [grpc.aio.insecure_channel(address) for address in (draft, target)]
        draft_stub = draft_pb2_grpc.DraftServiceStub(self.channels[0])
        target_stub = target_pb2_grpc.TargetServiceStub(self.channels[1])
        self.propose = CallStream(lambda: draft_stub.ProposeStream(), draft_pb2.ProposeStreamRequest,
                                  self.channels[0], "floor draft")
        self.verify = CallStream(lambda: target_stub.VerifyStream(), target_pb2.VerifyStreamRequest,
                                 self.channels[1], "floor target")

    async def Generate(self, request, context):
        gamma, held, generated = request.num_speculative_tokens, 16, 0
        sampling = common_pb2.SamplingParams(temperature=0.0)
        while generated < request.max_new_tokens:
            drafts: list[int] = []
            if gamma:
                proposal = await self.propose.call(draft_pb2.ProposeRequest(
                    session_id=SESSION, prefix_len=held, prefix_hash=held, new_tokens=[7],
                    num_speculative_tokens=gamma, sampling=sampling, seed=held), 10.0, True)
                drafts = list(proposal.draft_tokens)
            verdict = await self.verify.call(target_pb2.VerifyRequest(
                session_id=SESSION, prefix_len=held, prefix_hash=held, new_tokens=[7], draft_tokens=drafts,
                sampling=sampling, seed=held), 10.0, True)
            tokens = [*drafts[:verdict.num_accepted], verdict.next_token]
            held, generated = held + len(tokens), generated + len(tokens)
            yield coordinator_pb2.GenerateResponse(session_id=SESSION, token_ids=tokens, text="x" * 3 * len(tokens))


async def serve(kind: str, port: int, draft: str = "", target: str = "") -> None:
    server = grpc.aio.server()
    if kind == "draft":
        draft_pb2_grpc.add_DraftServiceServicer_to_server(FloorDraft(), server)
    elif kind == "target":
        target_pb2_grpc.add_TargetServiceServicer_to_server(FloorTarget(), server)
    else:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(FloorCoordinator(draft, target), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # SERVING
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await server.stop(1.0)


def measure(gammas: list[int], requests: int = 15, max_new_tokens: int = 128) -> dict:
    """Per γ: wall time per round as the client sees it (p50, p99, ms) and each process's CPU
    per round (ms; None where the system cannot tell), over `requests` streams after one warm-up
    stream."""
    ports = {name: free_port() for name in ("draft", "target", "coordinator")}
    argv = {"draft": [], "target": [],
            "coordinator": [f"127.0.0.1:{ports['draft']}", f"127.0.0.1:{ports['target']}"]}
    children = {name: subprocess.Popen([sys.executable, __file__, "--serve", name, str(ports[name]), *argv[name]],
                                       stdin=subprocess.PIPE) for name in ports}
    out: dict = {}
    try:
        for name in ports:
            wait_healthy(f"127.0.0.1:{ports[name]}", 120, list(children.values()))
        with grpc.insecure_channel(f"127.0.0.1:{ports['coordinator']}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for gamma in gammas:
                request = coordinator_pb2.GenerateRequest(max_new_tokens=max_new_tokens, num_speculative_tokens=gamma)
                list(stub.Generate(request, timeout=120))  # warm-up
                pids = {"client": os.getpid(), **{name: child.pid for name, child in children.items()}}
                before, gaps = cpu_of(pids), []
                for _ in range(requests):
                    stamps = [time.perf_counter() for _ in stub.Generate(request, timeout=120)]
                    gaps += [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
                spent, rounds = cpu_spent(before, cpu_of(pids)), max(1, len(gaps))
                gaps.sort()
                out[gamma] = {
                    "rounds": len(gaps), "p50": gaps[len(gaps) // 2], "p99": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))],
                    **{f"cpu_{name}_ms": None if s is None else 1000 * s / rounds for name, s in spent.items()}}
    finally:
        for name in ("coordinator", "draft", "target"):  # the callers first: no stream is cut under them
            children[name].stdin.close()
            children[name].wait(30)
    return out


def report(floor: dict) -> None:
    print("\ntransport floor: a round's messages with no work behind them (bench/transport_floor.py), ms per round")
    print(f"{'γ':>3} {'rounds':>7} {'wall p50':>9} {'wall p99':>9} | CPU {'coordinator':>11} {'client':>8} "
          f"{'draft':>8} {'target':>8}")
    for gamma, r in floor.items():
        print(f"{gamma:>3} {r['rounds']:>7} {r['p50']:>9.3f} {r['p99']:>9.3f} |     {cpu_columns(r)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=15)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gammas", default="4,0")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)  # child: kind port [draft target]
    args = parser.parse_args()
    if args.serve:
        kind, port, *addresses = args.serve
        asyncio.run(serve(kind, int(port), *addresses))
        return 0
    report(measure([int(g) for g in args.gammas.split(",")], args.requests, args.max_new_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
