"""A small client for the Connect protocol with JSON, over httpx.

Unary calls POST a JSON body; server-streaming calls POST one enveloped
message (1 flag byte, 4 length bytes, JSON) and read enveloped messages until
the end-of-stream envelope (flag 0x02), which carries an error if any.

Apiservers are interchangeable: given several base URLs, a call goes to the
one that last answered and moves on to the next when it could not be sent
(the connection was refused or timed out), or, for a call that is safe to
repeat (reads, and creates carrying an Idempotency-Key), when the connection
broke before the answer.
"""

from __future__ import annotations

import json
import struct
from typing import Any, AsyncIterator, Dict, List, Optional

import httpx

from .errors import DSecError, error_from_code

_END_STREAM = 0x02
_COMPRESSED = 0x01

# Connect's HTTP status -> code mapping, for errors without a JSON body.
_STATUS_CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    408: "deadline_exceeded",
    409: "already_exists",
    429: "resource_exhausted",
    501: "unimplemented",
    502: "unavailable",
    503: "unavailable",
    504: "deadline_exceeded",
}


def _headers(timeout: Optional[float], extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    h = {"Connect-Protocol-Version": "1"}
    if timeout is not None:
        h["Connect-Timeout-Ms"] = str(max(1, int(timeout * 1000)))
    if extra:
        h.update(extra)
    return h


def _error(status: int, body: bytes) -> DSecError:
    try:
        data = json.loads(body)
        return error_from_code(data.get("code", "unknown"), data.get("message", ""))
    except (ValueError, AttributeError):
        text = body.decode("utf-8", "replace").strip()
        return error_from_code(_STATUS_CODES.get(status, "unknown"), text or f"HTTP {status}")


IDEMPOTENCY_HEADER = "Idempotency-Key"


def parse_urls(raw: str) -> List[str]:
    """Reads one URL or a comma-separated list; all share scheme and path."""
    urls = [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]
    if not urls:
        raise ValueError("empty")
    first = httpx.URL(urls[0])
    for u in urls:
        p = httpx.URL(u)
        if p.scheme not in ("http", "https") or not p.host:
            raise ValueError(f"{u!r}: want http://host:port or https://host:port")
        if p.scheme != first.scheme or p.path != first.path:
            raise ValueError(f"{urls[0]!r} and {u!r}: all must have the same scheme and path")
    return urls


class Endpoints:
    """The apiservers' base URLs and the one that last answered."""

    def __init__(self, urls: List[str]) -> None:
        self.urls = urls
        self.current = 0

    def order(self) -> List[int]:
        n = len(self.urls)
        return [(self.current + i) % n for i in range(n)]


def _safe_to_repeat(method: str, headers: Dict[str, str]) -> bool:
    name = method.rsplit("/", 1)[-1]
    return IDEMPOTENCY_HEADER in headers or name.startswith(("Get", "List")) or name == "WhoAmI"


class ConnectClient:
    """Calls Connect methods under one or several interchangeable base URLs."""

    def __init__(self, http: httpx.AsyncClient, endpoints: "Endpoints | str") -> None:
        self._http = http
        self._ends = endpoints if isinstance(endpoints, Endpoints) else Endpoints([endpoints.rstrip("/")])
        # closed_hint is added to the error of a connection the server
        # closed after TLS (what an apiserver that requires a client
        # certificate does to a client without one).
        self.closed_hint = ""

    def _hint(self, e: Optional[Exception]) -> str:
        if self.closed_hint and isinstance(e, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
            return f" ({self.closed_hint})"
        return ""

    async def unary(
        self,
        method: str,
        request: Dict[str, Any],
        *,
        timeout: Optional[float] = None,
        headers: Optional[Dict[str, str]] = None,
    ) -> Dict[str, Any]:
        """Calls a unary method such as "opendsec.sandbox.v1.SandboxService/GetSandbox"."""
        h = _headers(timeout, headers)
        h["Content-Type"] = "application/json"
        http_timeout = None if timeout is None else timeout + 10
        body = json.dumps(request)
        last: Optional[Exception] = None
        for i in self._ends.order():
            try:
                resp = await self._http.post(f"{self._ends.urls[i]}/{method}", content=body, headers=h, timeout=http_timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                last = e  # never sent: the next apiserver
                continue
            except httpx.TransportError as e:
                if not _safe_to_repeat(method, h):
                    raise error_from_code("unavailable", f"{method}: {_reason(e)}") from e
                last = e
                continue
            self._ends.current = i
            break
        else:
            err = error_from_code("unavailable", f"{method}: no apiserver answered ({', '.join(self._ends.urls)}): {_reason(last)}{self._hint(last)}")
            err.retryable = True
            raise err from last
        if resp.status_code != 200:
            err = _error(resp.status_code, resp.content)
            err.retryable = resp.headers.get("dsec-retry") == "1"
            err.retry_after = _retry_after(resp.headers.get("retry-after"))
            raise err
        return resp.json() if resp.content else {}

    async def server_stream(
        self,
        method: str,
        request: Dict[str, Any],
        *,
        timeout: Optional[float] = None,
        headers: Optional[Dict[str, str]] = None,
    ) -> AsyncIterator[Dict[str, Any]]:
        """Calls a server-streaming method and yields each response message."""
        h = _headers(timeout, headers)
        h["Content-Type"] = "application/connect+json"
        payload = json.dumps(request).encode()
        body = struct.pack(">BI", 0, len(payload)) + payload
        last: Optional[Exception] = None
        for i in self._ends.order():  # a stream moves on only while it cannot connect
            try:
                async with self._http.stream(
                    "POST", f"{self._ends.urls[i]}/{method}", content=body, headers=h, timeout=httpx.Timeout(None, connect=10)
                ) as resp:
                    self._ends.current = i
                    if resp.status_code != 200:
                        raise _error(resp.status_code, await resp.aread())
                    buf = b""
                    async for chunk in resp.aiter_bytes():
                        buf += chunk
                        while len(buf) >= 5:
                            flags, size = struct.unpack(">BI", buf[:5])
                            if len(buf) < 5 + size:
                                break
                            msg, buf = buf[5 : 5 + size], buf[5 + size :]
                            if flags & _COMPRESSED:
                                raise error_from_code("internal", "compressed stream message not supported")
                            data = json.loads(msg) if msg else {}
                            if flags & _END_STREAM:
                                err = data.get("error")
                                if err:
                                    raise error_from_code(err.get("code", "unknown"), err.get("message", ""))
                                return
                            yield data
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                last = e  # nothing was sent or yielded: the next apiserver
                continue
            except httpx.TransportError as e:
                raise error_from_code("unavailable", f"{method}: {e}") from e
            break
        else:
            raise error_from_code("unavailable", f"{method}: no apiserver answered ({', '.join(self._ends.urls)}): {last}") from last
        raise error_from_code("unavailable", f"{method}: stream ended without an end-of-stream message")


def _reason(e: Optional[BaseException]) -> str:
    """What went wrong with a transport error: its own message, or its
    causes' (a TLS alert, such as a client certificate the apiserver
    requires, reaches httpx as a ReadError without one)."""
    seen = 0
    while e is not None and seen < 10:
        if str(e):
            return str(e)
        e = e.__cause__ or e.__context__
        seen += 1
    return "the connection closed"


def _retry_after(value: Optional[str]) -> Optional[float]:
    """A Retry-After header's whole seconds; None when absent or a date."""
    try:
        secs = int(value or "")
    except ValueError:
        return None
    return float(secs) if secs >= 0 else None
