"""The delaying, cuttable TCP link of the chaos soak (bench/link_proxy.py), on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from bench.link_proxy import LinkDelay, LinkProxy
from tests.echo_server import echo_server


@pytest.fixture
def echo():
    """An echo server on loopback: its address."""
    with echo_server() as address:
        yield address


def round_trip(sock: socket.socket, payload: bytes) -> float:
    started = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        part = sock.recv(65536)
        assert part, "the link closed"
        got += part
    assert got == payload
    return time.perf_counter() - started


def test_each_direction_is_delayed(echo):
    with LinkProxy(echo, delay=LinkDelay(15.0)) as proxy, socket.create_connection(proxy.address) as sock:
        times = [round_trip(sock, b"ping") for _ in range(5)]
        assert min(times) >= 0.030  # 15 ms each way, never early
        proxy.set_delay(0.0)
        assert min(round_trip(sock, b"ping") for _ in range(5)) < 0.030


def test_jitter_keeps_the_byte_order(echo):
    payload = b"".join(i.to_bytes(4, "big") for i in range(2000))
    with LinkProxy(echo, delay=LinkDelay(2.0, 2.0), seed=1) as proxy, \
            socket.create_connection(proxy.address) as sock:
        for begin in range(0, len(payload), 512):  # many chunks, each with its own draw
            sock.sendall(payload[begin:begin + 512])
            time.sleep(0.0005)
        got = b""
        while len(got) < len(payload):
            got += sock.recv(65536)
        assert got == payload


def test_a_cut_closes_connections_and_refuses_new_ones_until_healed(echo):
    with LinkProxy(echo) as proxy:
        sock = socket.create_connection(proxy.address)
        round_trip(sock, b"before")
        proxy.cut()
        sock.settimeout(5)
        try:
            assert sock.recv(10) == b""  # closed from the proxy's side
        except ConnectionResetError:
            pass
        sock.close()
        with socket.create_connection(proxy.address) as refused:
            refused.settimeout(5)
            try:
                assert refused.recv(10) == b""
            except ConnectionResetError:
                pass
        proxy.heal()
        with socket.create_connection(proxy.address) as again:
            round_trip(again, b"after")


def test_the_command_line_proxy(echo):
    process = subprocess.Popen([sys.executable, "bench/link_proxy.py", "--to", f"{echo[0]}:{echo[1]}",
                                "--delay-ms", "10"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        words = process.stdout.readline().split()
        assert words[0] == "listening"
        address = (words[1], int(words[2]))
        with socket.create_connection(address) as sock:
            assert round_trip(sock, b"x") >= 0.020
            process.stdin.write("delay 0\n")
            process.stdin.flush()
            time.sleep(0.2)
            assert min(round_trip(sock, b"x") for _ in range(5)) < 0.020
        process.stdin.write("quit\n")
        process.stdin.flush()
        assert process.wait(10) == 0
    finally:
        process.kill()
