"""The synchronous client: the same methods and types as the async one,
for scripts and notebooks that do not run an event loop.

>>> from opendsec.sync import DSecClient
>>> with DSecClient() as client:
...     sb = client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
...     print(sb.run_shell("echo hi").stdout)

There is one implementation: every call runs the async SDK's method on an
event loop the client keeps in a thread of its own, and waits for it. What
the async methods return comes back wrapped: a :class:`Sandbox` (and its
``files``), a :class:`Process` (iterate it with ``for``), a
:class:`Session`; data classes (``SandboxInfo``, ``CommandResult``, …) and
errors are the async SDK's own. One client may be used from several
threads at once; its calls then run concurrently on its loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import weakref
from typing import Any, Callable, Coroutine, Iterator, Optional, TypeVar

from . import client as _client
from . import sandbox as _sandbox
from .errors import NotFoundError
from .models import DSecRunArgs

__all__ = ["DSecClient", "DSecRunArgs", "Files", "Process", "Sandbox", "Session"]

T = TypeVar("T")


class _Loop:
    """An event loop in a daemon thread, which the client's calls run on.
    It ends when the client is closed, or once nothing of the client (nor
    a sandbox it returned) is left to use it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="opendsec-sync", daemon=True)
        self._thread.start()
        self._stop = weakref.finalize(self, _end_loop, self._loop, self._thread)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("opendsec.sync: a sync call from inside the client's own loop would wait forever; use the async SDK there")
        if not self._stop.alive:
            coro.close()
            raise RuntimeError("opendsec.sync: the client is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            # Interrupted (Ctrl-C) or failed: the call does not go on alone.
            fut.cancel()
            raise

    def stop(self) -> None:
        self._stop()

    @property
    def closed(self) -> bool:
        return not self._stop.alive


def _end_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Cancels what still runs on loop (a call another thread waits on
    then raises CancelledError instead of waiting forever), then ends the
    loop and its thread."""
    if threading.current_thread() is thread:
        loop.stop()  # collected on its own thread: the loop ends, unclosed
        return

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await loop.shutdown_asyncgens()

    try:
        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=10)
    except Exception:
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    if not loop.is_running():
        loop.close()


class _Wrapper:
    """Exposes an async SDK object synchronously: its coroutine methods
    are run on the loop and wait; what they return is wrapped in turn."""

    def __init__(self, inner: Any, loop: _Loop) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_loop", loop)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if inspect.iscoroutinefunction(value):
            return self._sync(value)
        return _wrap(value, self._loop)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, _unwrap(value))

    def __repr__(self) -> str:
        return repr(self._inner)

    def __dir__(self) -> Any:
        return sorted(set(dir(type(self))) | {n for n in dir(self._inner) if not n.startswith("_")})

    def __eq__(self, other: object) -> bool:
        return self._inner == _unwrap(other)

    def __hash__(self) -> int:
        return hash(self._inner)

    def _sync(self, method: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_unwrap(a) for a in args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            return _wrap(self._loop.run(method(*args, **kwargs)), self._loop)

        return call


class Files(_Wrapper):
    """A sandbox's files (:class:`opendsec.Files`), synchronously."""


class Session(_Wrapper):
    """A shell session (:class:`opendsec.Session`), synchronously."""


class Process(_Wrapper):
    """A started process (:class:`opendsec.Process`): ``for chunk in
    proc`` gives its output as it comes; ``proc.wait()`` all of it."""

    def __iter__(self) -> Iterator[Any]:
        it = self._inner.__aiter__()

        async def next_chunk() -> Any:
            return await it.__anext__()

        while True:
            try:
                yield self._loop.run(next_chunk())
            except StopAsyncIteration:
                return


class Sandbox(_Wrapper):
    """A sandbox (:class:`opendsec.Sandbox`), synchronously; ``with sb:``
    stops it at the end."""

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        except NotFoundError:  # stopped already, or its time to live ran out
            pass


class DSecClient(_Wrapper):
    """A connection to an OpenDsec apiserver (:class:`opendsec.DSecClient`),
    synchronously. Use it as a context manager, or call :meth:`close`."""

    def __init__(
        self, api_url: Optional[str] = None, api_key: Optional[str] = None, *, max_connections: int = 100, ca_file: Optional[str] = None,
        client_cert: Optional[str] = None, client_key: Optional[str] = None, create_wait: float = _client._CREATE_RETRY_SECONDS,
    ) -> None:
        loop = _Loop()

        async def make() -> _client.DSecClient:
            return _client.DSecClient(
                api_url, api_key, max_connections=max_connections, ca_file=ca_file, client_cert=client_cert, client_key=client_key, create_wait=create_wait
            )

        try:
            inner = loop.run(make())
        except BaseException:
            loop.stop()
            raise
        super().__init__(inner, loop)

    def close(self) -> None:
        """Closes the connections and ends the client's loop thread."""
        if not self._loop.closed:
            try:
                self._loop.run(self._inner.close())
            finally:
                self._loop.stop()

    def __enter__(self) -> "DSecClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_WRAPPERS = {
    _sandbox.Sandbox: Sandbox,
    _sandbox.Files: Files,
    _sandbox.Process: Process,
    _sandbox.Session: Session,
}


def _wrap(value: Any, loop: _Loop) -> Any:
    kind = _WRAPPERS.get(type(value))
    if kind is not None:
        return kind(value, loop)
    if isinstance(value, list):
        return [_wrap(v, loop) for v in value]
    if isinstance(value, tuple):
        return tuple(_wrap(v, loop) for v in value)
    return value


def _unwrap(value: Any) -> Any:
    if isinstance(value, _Wrapper):
        return object.__getattribute__(value, "_inner")
    return value
