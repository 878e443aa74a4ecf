"""Apiservers are interchangeable: the client fails over between the URLs it
is given, repeats only what is safe to repeat, and sends each create with an
idempotency key. Against stub apiservers on loopback; no cluster needed."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, List, Tuple

import pytest

from opendsec import DSecClient
from opendsec.errors import DSecError, InvalidArgumentError


class _Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: List[Tuple[str, str]] = []  # (method, idempotency key)

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        method = self.path.rsplit("/", 1)[-1]
        _Stub.seen.append((method, self.headers.get("Idempotency-Key", "")))
        body = json.dumps({"sandbox": {"id": "n1-sb", "state": "SANDBOX_STATE_RUNNING"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def good() -> Iterator[str]:
    _Stub.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _dead() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def broken() -> Iterator[str]:
    """Accepts a connection, reads the request, closes without answering."""
    ln = socket.socket()
    ln.bind(("127.0.0.1", 0))
    ln.listen(16)

    def serve() -> None:
        while True:
            try:
                c, _ = ln.accept()
            except OSError:
                return
            c.recv(65536)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{ln.getsockname()[1]}"
    ln.close()


async def test_fails_over_when_an_apiserver_is_down(good: str) -> None:
    async with DSecClient(f"{_dead()},{good}", "key") as c:
        sb = await c.get_sandbox("n1-sb")
        assert sb.id == "n1-sb"
        await c.run_sandbox()
    assert [m for m, _ in _Stub.seen] == ["GetSandbox", "CreateSandbox"]


async def test_repeats_creates_with_their_key_but_not_stops(good: str, broken: str) -> None:
    async with DSecClient(f"{broken},{good}", "key") as c:
        sb = await c.run_sandbox()
        assert sb.id == "n1-sb"
        ((method, key),) = _Stub.seen
        assert method == "CreateSandbox" and len(key) == 32
    _Stub.seen = []
    async with DSecClient(f"{broken},{good}", "key") as c:
        with pytest.raises(DSecError):
            await c._call("opendsec.sandbox.v1.SandboxService/StopSandbox", {"sandboxId": "n1-sb"})
    assert _Stub.seen == [], "a stop whose connection broke was sent again elsewhere"


def test_url_lists_are_checked() -> None:
    for bad in ["ftp://a", "http://a,https://b", "http://a/x,http://b/y"]:
        with pytest.raises(InvalidArgumentError):
            DSecClient(bad, "key")
    c = DSecClient(" http://a:1/ , http://b:2 ", "key")
    assert c.api_urls == ["http://a:1", "http://b:2"] and c.api_url == "http://a:1"


def _refuse(h: BaseHTTPRequestHandler, status: int, code: str, message: str, **headers: str) -> None:
    """Reads the request, notes it in _Stub.seen and answers with a Connect
    error and headers (underscores in their names become dashes)."""
    h.rfile.read(int(h.headers.get("Content-Length") or 0))
    _Stub.seen.append((h.path.rsplit("/", 1)[-1], h.headers.get("Idempotency-Key", "")))
    body = json.dumps({"code": code, "message": message}).encode()
    h.send_response(status)
    for name, value in headers.items():
        h.send_header(name.replace("_", "-"), value)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


class _Busy(_Stub):
    """Answers the first two creates Unavailable, marked retryable (as an
    apiserver taking over a dead one's create does), then like _Stub."""

    def do_POST(self) -> None:
        if sum(1 for m, _ in _Stub.seen if m == "CreateSandbox") < 2:
            _refuse(self, 503, "unavailable", "its sandbox is still being made; retry", Dsec_Retry="1")
            return
        super().do_POST()


async def test_create_retries_unavailable_with_its_key() -> None:
    _Stub.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        async with DSecClient(f"http://127.0.0.1:{srv.server_address[1]}", "key") as c:
            sb = await c.run_sandbox()
    finally:
        srv.shutdown()
    assert sb.id == "n1-sb"
    keys = {k for m, k in _Stub.seen if m == "CreateSandbox"}
    assert len(_Stub.seen) == 3 and len(keys) == 1 and len(keys.pop()) == 32, _Stub.seen


class _Unready(_Stub):
    """Answers every create Unavailable, unmarked (a service that never got
    ready)."""

    def do_POST(self) -> None:
        _refuse(self, 503, "unavailable", "did not become ready within 1s")


async def test_create_does_not_retry_what_the_server_did_not_mark() -> None:
    _Stub.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Unready)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        async with DSecClient(f"http://127.0.0.1:{srv.server_address[1]}", "key") as c:
            with pytest.raises(DSecError) as e:
                await c.run_sandbox()
    finally:
        srv.shutdown()
    assert e.value.code == "unavailable" and len(_Stub.seen) == 1, _Stub.seen


class _Full(_Stub):
    """Answers the first two creates as a fleet without room does
    (resource_exhausted, marked to be sent again after a second), then like
    _Stub."""

    def do_POST(self) -> None:
        if sum(1 for m, _ in _Stub.seen if m == "CreateSandbox") < _Full.refusals:
            _Full.at.append(time.monotonic())
            _refuse(self, 429, "resource_exhausted", "node n1: node full: 4 sandboxes, its limit is 4", Dsec_Retry="1", Retry_After="1")
            return
        super().do_POST()

    refusals = 2
    at: List[float] = []


async def test_create_backs_off_while_the_fleet_is_full() -> None:
    """A create every node refused for room is sent again with its key after
    the second the server asked for (±25 %), until it is made; with a
    shorter create_wait the refusal comes back at once."""
    _Stub.seen, _Full.at, _Full.refusals = [], [], 2
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Full)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        async with DSecClient(f"http://127.0.0.1:{srv.server_address[1]}", "key") as c:
            sb = await c.run_sandbox()
            assert sb.id == "n1-sb"
            creates = [k for m, k in _Stub.seen if m == "CreateSandbox"]
            assert len(creates) == 3 and len(set(creates)) == 1, _Stub.seen
            gaps = [b - a for a, b in zip(_Full.at, _Full.at[1:])]
            assert gaps and all(0.7 <= g for g in gaps), gaps
        _Stub.seen, _Full.at, _Full.refusals = [], [], 100
        async with DSecClient(f"http://127.0.0.1:{srv.server_address[1]}", "key", create_wait=0.5) as c:
            with pytest.raises(DSecError) as e:
                await c.run_sandbox()
            assert e.value.code == "resource_exhausted" and e.value.retry_after == 1.0
            assert len(_Stub.seen) == 1, _Stub.seen
    finally:
        srv.shutdown()


def test_tls_files_are_checked(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A client certificate without its key, or files that are no
    certificates, are refused naming what is wrong; with none named the
    system's roots verify."""
    for var in ["DSEC_CA_FILE", "DSEC_CLIENT_CERT", "DSEC_CLIENT_KEY"]:
        monkeypatch.delenv(var, raising=False)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(InvalidArgumentError, match="go together"):
        DSecClient("https://a:1", "key", client_cert=str(junk))
    monkeypatch.setenv("DSEC_CLIENT_KEY", str(junk))
    with pytest.raises(InvalidArgumentError, match="go together"):
        DSecClient("https://a:1", "key")
    with pytest.raises(InvalidArgumentError, match="client certificate"):
        DSecClient("https://a:1", "key", client_cert=str(junk))
    monkeypatch.delenv("DSEC_CLIENT_KEY")
    with pytest.raises(InvalidArgumentError, match="CA file"):
        DSecClient("https://a:1", "key", ca_file=str(junk))
    c = DSecClient("https://a:1", "key")
    assert c._conn.closed_hint, "an https client without a certificate gets no hint"
