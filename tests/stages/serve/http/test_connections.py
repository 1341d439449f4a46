"""Idle, slow and surplus connections on a real `llmopt serve` process: header deadline (slowloris),
idle keep-alive, stalled body (408), the connection cap (503), and the warning of a public bind."""
from __future__ import annotations

import select
import socket
import time

import pytest

from .prom_text import value
from .serve_process import serve_process

HEADER_S, KEEP_ALIVE_S = 1.0, 1.0
REQUEST = b'{"prompt": "the quick", "max_tokens": 2}'


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    with serve_process(model_dir, "--header-timeout", str(HEADER_S), "--keep-alive-timeout", str(KEEP_ALIVE_S),
                       tmp_path=tmp_path_factory.mktemp("guarded")) as server:
        yield server


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes `sock` within `timeout` (reading whatever it sends first)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                if not sock.recv(65536):
                    return True
            except ConnectionResetError:
                return True
    return False


def raw_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    return data


def test_slowloris_connections_are_closed_after_the_header_timeout_while_others_are_served(guarded):
    socks = [guarded.connect() for _ in range(50)]
    opened = time.monotonic()
    line, sent, served_in, closed_at = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200, 0, None, {}
    while len(closed_at) < len(socks) and time.monotonic() - opened < HEADER_S + 10:
        for i, sock in enumerate(socks):  # one header byte each, every 0.1 s: never a whole header
            if i not in closed_at:
                try:
                    sock.send(line[sent:sent + 1])
                except OSError:
                    closed_at[i] = time.monotonic() - opened
        sent += 1
        readable = select.select([s for i, s in enumerate(socks) if i not in closed_at], [], [], 0.1)[0]
        for sock in readable:
            try:
                gone = not sock.recv(1024)
            except ConnectionResetError:
                gone = True
            if gone:
                closed_at[socks.index(sock)] = time.monotonic() - opened
        if served_in is None and sent == 3:  # a normal request while all 50 trickle
            started = time.monotonic()
            with guarded.client() as client:
                assert client.post("/v1/completions", content=REQUEST,
                                   headers={"content-type": "application/json"}).status_code == 200
            served_in = time.monotonic() - started
    for sock in socks:
        sock.close()
    assert len(closed_at) == 50, f"{50 - len(closed_at)} trickling connections still open"
    assert min(closed_at.values()) >= HEADER_S - 0.05 and served_in < 2.0
    print(f"50 slowloris connections closed {min(closed_at.values()):.2f}..{max(closed_at.values()):.2f} s after "
          f"they opened (header timeout {HEADER_S:g} s); a normal request meanwhile took {served_in * 1000:.0f} ms")


def test_an_idle_keep_alive_connection_and_a_silent_one_are_closed(guarded):
    with guarded.connect() as sock, guarded.connect() as silent:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw_response(sock).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        assert closed_by_peer(sock, KEEP_ALIVE_S + 5)
        idle = time.monotonic() - answered
        assert closed_by_peer(silent, HEADER_S + 5)
    assert idle >= KEEP_ALIVE_S - 0.05
    print(f"idle keep-alive connection closed {idle:.2f} s after its response (--keep-alive-timeout {KEEP_ALIVE_S:g})")


def test_a_stalled_body_gets_408_and_the_connection_closes(guarded):
    with guarded.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"prompt":')  # 10 of 100 bytes, then nothing
        started = time.monotonic()
        response = raw_response(sock)
        waited = time.monotonic() - started
        assert response.startswith(b"HTTP/1.1 408") and b"body_timeout" in response + sock.recv(65536)
        assert closed_by_peer(sock, 5)
    assert waited >= HEADER_S - 0.05
    print(f"stalled body answered 408 after {waited:.2f} s")


def test_a_body_that_trickles_after_the_answer_is_cut_off(guarded):
    """A route that answers without reading the body (a 404): its bytes may not keep the connection."""
    with guarded.connect() as sock:
        sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nx")
        assert raw_response(sock).startswith(b"HTTP/1.1 404")
        started = time.monotonic()
        while not closed_by_peer(sock, 0.3):
            sock.send(b"x")  # well inside the keep-alive timeout each time
            assert time.monotonic() - started < HEADER_S + 5, "the trickling body kept the connection open"


@pytest.fixture(scope="module")
def public(model_dir, tmp_path_factory):
    with serve_process(model_dir, "--host", "0.0.0.0", "--max-connections", "4",
                       tmp_path=tmp_path_factory.mktemp("public")) as server:
        yield server


def test_a_public_bind_without_a_key_warns_once(public):
    warnings = [line for line in public.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "--api-key-file" in warnings[0]


def test_connections_past_the_limit_get_503_at_once(public):
    held = [public.connect() for _ in range(4)]
    try:
        with public.connect() as extra:
            started = time.monotonic()
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            response = raw_response(extra)
            answered = time.monotonic() - started
            assert response.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in response.lower()
            assert b"too_many_connections" in response + extra.recv(65536) and closed_by_peer(extra, 5)
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    with public.client() as client:  # room again
        assert client.get("/health").status_code == 200
        assert value(client.get("/metrics").text, "llmopt:requests_rejected_total", reason="too_many_connections") == 1
    print(f"a connection past --max-connections answered 503 in {answered * 1000:.0f} ms")
