"""bench/overhead.py's link sweep (--link-delay-ms): the delays it takes, the proxy process it
puts in front of each service, and how it turns the timed cells into its rows and its
drafting-ahead comparison.

Here the process tests; the other tiers' are in tests/unit/test_bench_overhead.py.
"""

from __future__ import annotations

import socket
import time

import pytest

from bench import overhead_links
from tests.echo_server import echo_server


@pytest.fixture
def echo_port():
    with echo_server() as address:
        yield address[1]


def _round_trip(sock: socket.socket) -> float:
    started = time.perf_counter()
    sock.sendall(b"ping")
    got = b""
    while len(got) < 4:
        part = sock.recv(64)
        assert part, "the link closed"
        got += part
    return time.perf_counter() - started


def test_the_proxy_process_delays_both_ways_and_takes_a_new_delay(echo_port):
    proxy = overhead_links.LinkProcess(f"127.0.0.1:{echo_port}", 10.0, 0.0)
    try:
        host, port = proxy.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            assert min(_round_trip(sock) for _ in range(3)) >= 0.020  # 10 ms each way
            proxy.set_delay(0.0, 0.0)
            time.sleep(0.2)  # the proxy does not answer: give it time to read the line
            assert min(_round_trip(sock) for _ in range(3)) < 0.010
    finally:
        proxy.close()
    assert proxy.process.returncode == 0  # "quit" ends it
