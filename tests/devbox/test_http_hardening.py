"""The devbox's HTTP server against slow, oversized, malformed and careless
clients. Real sockets against real servers on 127.0.0.1."""

from __future__ import annotations

import json
import select
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from charlie.devbox import DevboxServer, Limits

from .conftest import TOKEN, ServerFactory, ServerProcess, wait_until

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True once the server has closed the connection (EOF or reset), within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            try:
                if sock.recv(65536) == b"":
                    return True
            except ConnectionError:
                return True
    return False


def _response(sock: socket.socket) -> tuple[int, dict[str, object]]:
    """Read one response off a raw socket: its status and its JSON body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return int(lines[0].split()[1]), json.loads(rest[:length])


def _request(url: str, raw: bytes) -> tuple[int, dict[str, object]]:
    with _connect(url) as sock:
        sock.sendall(raw)
        return _response(sock)


def test_a_silent_connection_is_closed(make_server: ServerFactory) -> None:
    server = make_server(limits=Limits(http_idle_seconds=0.5))
    with _connect(server.url) as idle, _connect(server.url) as half:
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert _closed_within(idle, 5)
        assert _closed_within(half, 5)
    assert httpx.get(server.url + "/health", headers=AUTH).status_code == 200


def test_a_trickling_client_is_cut_off_at_the_request_deadline(
    make_server: ServerFactory,
) -> None:
    # one byte every 0.2s never trips the 1s idle timeout; the 1.5s request deadline still ends it
    server = make_server(limits=Limits(http_idle_seconds=1.0, http_request_seconds=1.5))
    with _connect(server.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 8:
            try:
                sock.sendall(b"a")
            except OSError:
                closed = True
                break
            if _closed_within(sock, 0.2):
                closed = True
                break
        elapsed = time.monotonic() - started
    assert closed, "the server kept a trickling connection open for 8s"
    assert elapsed < 5, elapsed


def test_a_body_that_stops_arriving_gets_408(make_server: ServerFactory) -> None:
    server = make_server(limits=Limits(http_idle_seconds=0.5))
    with _connect(server.url) as sock:
        sock.sendall(
            b"PUT /workspaces/slow HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b'\r\nContent-Length: 100\r\n\r\n{"repo": '
        )
        status, body = _response(sock)
        assert status == 408, body
        assert _closed_within(sock, 5)
    assert not (server.root / "workspaces" / "slow").exists()


def test_too_many_connections_are_refused_at_once(make_server: ServerFactory) -> None:
    server = make_server(limits=Limits(http_connections=2))
    first, second = _connect(server.url), _connect(server.url)
    try:
        time.sleep(0.2)  # let the server accept both
        status, body = _request(
            server.url,
            b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\n\r\n",
        )
        assert status == 503 and "too many" in str(body["error"])
    finally:
        first.close()
        second.close()
    # the slots come back once those connections end
    assert wait_until(lambda: httpx.get(server.url + "/health", headers=AUTH).status_code == 200, 5)


def _put(length_headers: bytes, body: bytes = b"") -> bytes:
    return (
        b"PUT /workspaces/w HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b"\r\nContent-Type: application/json\r\n"
        + length_headers
        + b"\r\n"
        + body
    )


def test_an_oversized_body_gets_413_without_being_sent(make_server: ServerFactory) -> None:
    server = make_server(limits=Limits(request_bytes=1000))
    status, body = _request(server.url, _put(b"Content-Length: 1000000000\r\n"))
    assert status == 413 and "1000000000" in str(body["error"])


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (b"", 411),
        (b"Content-Length: -1\r\n", 400),
        (b"Content-Length: +15\r\n", 400),
        (b"Content-Length: 1_5\r\n", 400),
        (b"Content-Length: 15, 15\r\n", 400),
        (b"Content-Length: 15\r\nContent-Length: 16\r\n", 400),
        (b"Transfer-Encoding: chunked\r\n", 411),
    ],
    ids=["missing", "negative", "plus", "underscore", "list", "conflicting", "chunked"],
)
def test_a_missing_or_invalid_content_length_is_refused(
    server: DevboxServer, headers: bytes, status: int
) -> None:
    got, body = _request(server.url, _put(headers, b'{"repo": null}'))
    assert got == status, body
    assert "Content-Length" in str(body["error"]) or "chunked" in str(body["error"])
    assert not (server.root / "workspaces" / "w").exists()


def test_an_internal_error_answers_an_id_not_the_exception(
    spawn_server: Callable[..., ServerProcess], devbox_root: Path, tmp_path: Path
) -> None:
    proc = spawn_server()
    execution_id = str(uuid.uuid4())
    # a command record the devbox cannot read: an unexpected error, not a refusal
    (devbox_root / "commands" / execution_id / "meta.json").mkdir(parents=True)
    response = httpx.get(f"{proc.url}/commands/{execution_id}", headers=AUTH)
    assert response.status_code == 500
    body = response.json()
    request_id = body["request_id"]
    assert request_id in body["error"]
    text = response.text
    for leak in ("IsADirectory", "Errno", str(devbox_root), "Traceback", "meta.json"):
        assert leak not in text, text
    log = tmp_path / "devbox-server.log"
    assert wait_until(lambda: request_id in log.read_text(), 5)
    logged = log.read_text()
    assert "Traceback" in logged and "IsADirectoryError" in logged
    assert TOKEN not in logged


def test_the_token_is_refused_in_urls_and_never_logged(
    spawn_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    proc = spawn_server("--verbose")  # every request line is logged
    for name in ("token", "access_token", "Token"):
        response = httpx.get(f"{proc.url}/health", params={name: TOKEN}, headers=AUTH)
        assert response.status_code == 400, response.text
        assert "Authorization" in response.json()["error"]
    # a wrong token in the URL is no better, and the right one still works in the header
    assert httpx.get(f"{proc.url}/health?token=guess", headers=AUTH).status_code == 400
    assert httpx.get(f"{proc.url}/health", headers=AUTH).status_code == 200
    assert httpx.get(f"{proc.url}/health", headers={"Authorization": "Bearer w"}).status_code == (
        401
    )
    # a request line too broken to parse is logged by http.server itself
    with _connect(proc.url) as sock:
        sock.sendall(f"GET /x?token={TOKEN}&auth=other-secret HTTP/1.1 junk\r\n\r\n".encode())
        _closed_within(sock, 5)
    log = tmp_path / "devbox-server.log"
    assert wait_until(lambda: log.read_text().count("/health") >= 6, 5), log.read_text()
    logged = log.read_text()
    assert TOKEN not in logged and "other-secret" not in logged, logged
    assert "Bearer" not in logged and "Authorization:" not in logged
