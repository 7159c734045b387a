"""A Lua script, then `WAIT N T`, on one connection: WAIT counts the replicas that have the
writes of its own connection, so the two must share one (redis-py's pools hand out any).

One server or a Sentinel's primary: a non-transactional pipeline (one connection). A Redis
Cluster: a connection of the node owning the keys' slot, taken from that node's pool; MOVED
refreshes the slot map and tries again, ASK sends ASKING first to the node named, TRYAGAIN (the
keys split by a migration) waits a moment; nothing of the write is applied before the answer
that sends it elsewhere, so trying again never writes twice.
"""

from __future__ import annotations

import asyncio

from redis.exceptions import AskError, ConnectionError as RedisConnectionError, MovedError, ResponseError, TryAgainError

from specdec.redis_url import REDIS_ERRORS, Topology

REDIRECTS = 5        # MOVED / ASK / TRYAGAIN followed at most this often for one write
TRY_AGAIN_S = 0.05   # the pause before a write the slot's migration refused is sent again


async def eval_and_wait(client, topology: Topology, script: str, keys: list[str], args: list,
                        replicas: int, timeout_ms: int) -> tuple[object, int]:
    """(the script's answer, the replicas WAIT counted). Raises what redis-py raises."""
    if topology is not Topology.CLUSTER:
        async with client.pipeline(transaction=False) as pipe:
            pipe.execute_command("EVAL", script, len(keys), *keys, *args)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            result, acked = await pipe.execute()
        return result, int(acked)
    node, asking = client.get_node_from_key(keys[0]), False
    for _ in range(REDIRECTS):
        commands = [("ASKING",)] if asking else []
        commands += [("EVAL", script, len(keys), *keys, *args), ("WAIT", replicas, timeout_ms)]
        try:
            replies = await _on_one_connection(node, commands)
        except REDIS_ERRORS as exc:
            if isinstance(exc, (RedisConnectionError, OSError, TimeoutError)):
                await _refresh(client)  # the node is down: a replica may be promoted meanwhile
            raise
        result, acked = replies[-2], replies[-1]
        if isinstance(result, MovedError):
            await _refresh(client)
            node, asking = client.get_node_from_key(keys[0]), False
        elif isinstance(result, AskError):
            node, asking = client.get_node(result.host, result.port) or node, True
        elif isinstance(result, TryAgainError):
            await asyncio.sleep(TRY_AGAIN_S)
        elif isinstance(result, Exception):
            raise result
        else:
            if isinstance(acked, Exception):
                raise acked
            return result, int(acked)
    raise TryAgainError(f"the slot of {keys[0]!r} kept moving ({REDIRECTS} redirections)")


async def _on_one_connection(node, commands: list[tuple]) -> list:
    """Each command's reply, or the error reply as an exception; the connection is dropped
    (not reused) when anything else goes wrong."""
    connection = node.acquire_connection()
    try:
        await connection.send_packed_command(connection.pack_commands(commands))
        replies = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        node.release(connection)


async def _refresh(client) -> None:
    """Load the slot map again (best effort: no node answering leaves the old one)."""
    try:
        await client.nodes_manager.initialize()
    except REDIS_ERRORS:
        pass
