"""A running sandbox: commands, files, processes, terminals and sessions."""

from __future__ import annotations

import asyncio
import shlex
import warnings
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Sequence, Union

import httpx

from ._connect import ConnectClient
from .errors import DSecError, NotFoundError
from .models import (
    _pause_depth,
    CommandResult,
    EntryInfo,
    ImageInfo,
    OutputChunk,
    ProcessInfo,
    SandboxInfo,
    SnapshotInfo,
    b64,
    rule_json,
    unb64,
)

if TYPE_CHECKING:
    from .client import DSecClient

_PROC = "opendsec.agent.v1.ProcessService/"
_FS = "opendsec.agent.v1.FilesystemService/"
_SESS = "opendsec.agent.v1.SessionService/"
_SB = "opendsec.sandbox.v1.SandboxService/"

_CHUNK = 8 << 20  # bytes per file read/write call


def _config(
    args: Sequence[str],
    *,
    cwd: Optional[str],
    env: Optional[Dict[str, str]],
    user: Optional[str],
    timeout: Optional[float],
    stdin: Optional[Union[bytes, str]] = None,
    keep_stdin_open: bool = False,
    pty: Optional[Dict[str, int]] = None,
    tag: Optional[str] = None,
) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {"args": list(args)}
    if cwd:
        cfg["cwd"] = cwd
    if env:
        cfg["env"] = dict(env)
    if user:
        cfg["user"] = user
    if timeout:
        cfg["timeoutMs"] = int(timeout * 1000)
    if stdin:
        cfg["stdin"] = b64(stdin.encode() if isinstance(stdin, str) else stdin)
    if keep_stdin_open:
        cfg["keepStdinOpen"] = True
    if pty:
        cfg["pty"] = pty
    if tag:
        cfg["tag"] = tag
    return cfg


def _selector(pid: Optional[int] = None, tag: Optional[str] = None) -> Dict[str, Any]:
    return {"pid": pid} if pid else {"tag": tag}


class Process:
    """A process started with :meth:`Sandbox.exec` or :meth:`Sandbox.pty`.

    Iterate it (``async for chunk in proc``) for its output as it comes, or
    ``await proc.wait()`` for the whole output and exit code.
    """

    def __init__(self, sandbox: "Sandbox", stream: AsyncIterator[Dict[str, Any]]) -> None:
        self._sb = sandbox
        self._stream = stream
        self._queue: "asyncio.Queue[Optional[OutputChunk]]" = asyncio.Queue()
        self.pid = 0
        self.tag = ""
        self.exit_code: Optional[int] = None
        self.timed_out = False
        self.error = ""
        self._done = asyncio.Event()
        self._failure: Optional[BaseException] = None
        self._task: Optional["asyncio.Task[None]"] = None

    async def _start(self) -> "Process":
        first = await self._stream.__anext__()
        ev = first.get("event", {})
        if "started" in ev:
            self.pid = int(ev["started"].get("pid", 0))
            self.tag = ev["started"].get("tag", "")
        else:
            self._handle(ev)
        self._task = asyncio.ensure_future(self._pump())
        return self

    def _handle(self, ev: Dict[str, Any]) -> None:
        if "output" in ev:
            o = ev["output"]
            stream = o.get("stream", "STREAM_STDOUT").replace("STREAM_", "").lower()
            self._queue.put_nowait(OutputChunk(stream, unb64(o.get("data"))))
        elif "exited" in ev:
            x = ev["exited"]
            self.exit_code = int(x.get("exitCode", 0))
            self.timed_out = bool(x.get("timedOut", False))
            self.error = x.get("error", "")

    async def _pump(self) -> None:
        try:
            async for msg in self._stream:
                self._handle(msg.get("event", {}))
        except BaseException as e:  # reported to the reader
            self._failure = e
        finally:
            self._queue.put_nowait(None)
            self._done.set()

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[OutputChunk]:
        while True:
            chunk = await self._queue.get()
            if chunk is None:
                self._queue.put_nowait(None)
                if self._failure and not isinstance(self._failure, asyncio.CancelledError):
                    raise self._failure
                return
            yield chunk

    async def wait(self) -> CommandResult:
        """Waits for the process to exit and returns its remaining output."""
        out, err = bytearray(), bytearray()
        async for chunk in self:
            (err if chunk.stream == "stderr" else out).extend(chunk.data)
        await self._done.wait()
        return CommandResult.from_bytes(bytes(out), bytes(err), exit_code=self.exit_code if self.exit_code is not None else -1, timed_out=self.timed_out, pid=self.pid)

    async def send_input(self, data: Union[bytes, str]) -> None:
        """Writes to the process's stdin (or terminal)."""
        raw = data.encode() if isinstance(data, str) else data
        await self._sb._agent(_PROC + "SendInput", {"process": _selector(self.pid, self.tag), "data": b64(raw)})

    async def close_stdin(self) -> None:
        """Closes stdin, so the process reads end of file."""
        await self._sb._agent(_PROC + "CloseStdin", {"process": _selector(self.pid, self.tag)})

    async def signal(self, signal: int = 15) -> None:
        """Sends a signal to the process group."""
        await self._sb._agent(_PROC + "SendSignal", {"process": _selector(self.pid, self.tag), "signal": signal})

    async def kill(self) -> None:
        """Sends SIGKILL."""
        await self.signal(9)

    async def resize(self, cols: int, rows: int) -> None:
        """Resizes the terminal of a process started with :meth:`Sandbox.pty`."""
        await self._sb._agent(_PROC + "ResizePty", {"process": _selector(self.pid, self.tag), "size": {"cols": cols, "rows": rows}})


class Session:
    """A persistent shell (chronus): the working directory, exported
    variables, functions and background jobs survive between commands."""

    def __init__(self, sandbox: "Sandbox", info: Dict[str, Any]) -> None:
        self._sb = sandbox
        self.id: str = info["id"]
        self.pid = int(info.get("pid", 0))
        self.cwd: str = info.get("cwd", "")

    async def run(self, command: str, *, timeout: float = 60, max_output_bytes: int = 0) -> CommandResult:
        """Runs one command line in the session's shell."""
        req: Dict[str, Any] = {"sessionId": self.id, "command": command, "timeoutMs": int(timeout * 1000)}
        if max_output_bytes:
            req["maxOutputBytes"] = str(max_output_bytes)
        r = await self._sb._agent(_SESS + "RunInSession", req, timeout=timeout + 10)
        self.cwd = r.get("cwd", self.cwd)
        return CommandResult.from_bytes(
            unb64(r.get("stdout")),
            unb64(r.get("stderr")),
            exit_code=int(r.get("exitCode", 0)),
            timed_out=bool(r.get("timedOut", False)),
            stdout_dropped=int(r.get("stdoutDropped", 0)),
            stderr_dropped=int(r.get("stderrDropped", 0)),
            cwd=self.cwd,
        )

    async def output(self, offset: int = 0) -> tuple:
        """Reads the session's recorded log from ``offset``; returns
        ``(data, next_offset, first_offset_kept)``."""
        r = await self._sb._agent(_SESS + "GetSessionOutput", {"sessionId": self.id, "offset": str(offset)})
        return unb64(r.get("data")), int(r.get("nextOffset", 0)), int(r.get("firstOffset", 0))

    async def close(self) -> None:
        """Ends the shell and every process it started."""
        await self._sb._agent(_SESS + "CloseSession", {"sessionId": self.id})


class Files:
    """The sandbox's file system. Paths are absolute, or relative to /root.

    Every call takes ``user``: it then acts with that user's rights (a path the
    user may not reach, or a link to one, raises PermissionDeniedError); by
    default it acts as root."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sb = sandbox

    async def read(self, path: str, *, user: str = "") -> bytes:
        """Reads a whole file."""
        data = bytearray()
        offset = 0
        while True:
            r = await self._sb._agent(_FS + "ReadFile", {"path": path, "offset": str(offset), "limit": str(_CHUNK), "user": user})
            chunk = unb64(r.get("data"))
            data.extend(chunk)
            offset += len(chunk)
            if r.get("eof") or not chunk:
                return bytes(data)

    async def read_text(self, path: str, encoding: str = "utf-8", *, user: str = "") -> str:
        """Reads a whole file as text."""
        return (await self.read(path, user=user)).decode(encoding)

    async def write(self, path: str, data: Union[bytes, str], *, mode: int = 0, user: str = "",
                    metadata: Optional[Dict[str, str]] = None) -> EntryInfo:
        """Creates or replaces a file, creating parent directories.

        ``metadata`` (printable ASCII keys and values) becomes the file's
        metadata, replacing what it had (``{}`` clears it); without it the
        file's metadata is left as it is. It is kept as the file's
        ``user.e2b.KEY`` extended attributes, as E2B keeps it.
        """
        raw = data.encode() if isinstance(data, str) else data
        entry: Dict[str, Any] = {}
        first = True
        for start in range(0, max(len(raw), 1), _CHUNK):
            req: Dict[str, Any] = {"path": path, "data": b64(raw[start : start + _CHUNK])}
            if not first:
                req["mode"] = "WRITE_MODE_APPEND"
            elif metadata is not None:
                req["metadata"], req["replaceMetadata"] = dict(metadata), True
            if mode:
                req["perm"] = mode
            if user:
                req["user"] = user
            r = await self._sb._agent(_FS + "WriteFile", req)
            entry = r.get("entry", {})
            first = False
        return EntryInfo.from_json(entry)

    async def list(self, path: str, depth: int = 1, *, user: str = "") -> List[EntryInfo]:
        """Lists a directory (and, with depth > 1, below it)."""
        r = await self._sb._agent(_FS + "ListDir", {"path": path, "depth": depth, "user": user})
        return [EntryInfo.from_json(e) for e in r.get("entries", [])]

    async def stat(self, path: str, *, user: str = "") -> EntryInfo:
        r = await self._sb._agent(_FS + "Stat", {"path": path, "user": user})
        return EntryInfo.from_json(r["entry"])

    async def exists(self, path: str, *, user: str = "") -> bool:
        try:
            await self.stat(path, user=user)
            return True
        except NotFoundError:
            return False

    async def make_dir(self, path: str, *, user: str = "") -> bool:
        """Creates a directory and its parents; False if it existed."""
        r = await self._sb._agent(_FS + "MakeDir", {"path": path, "user": user})
        return bool(r.get("created", False))

    async def remove(self, path: str, *, recursive: bool = False, user: str = "") -> None:
        await self._sb._agent(_FS + "Remove", {"path": path, "recursive": recursive, "user": user})

    async def rename(self, source: str, destination: str, *, user: str = "") -> EntryInfo:
        r = await self._sb._agent(_FS + "Move", {"source": source, "destination": destination, "user": user})
        return EntryInfo.from_json(r["entry"])


class Sandbox:
    """A sandbox. Get one from :meth:`DSecClient.run_sandbox`."""

    def __init__(self, client: "DSecClient", info: SandboxInfo) -> None:
        self._client = client
        self.info = info
        self.id = info.id
        self.files = Files(self)
        self._conn = ConnectClient(client._http, client._endpoints)
        self._headers = {"Dsec-Sandbox-Id": self.id}

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.backend} {self.info.image}>"

    async def _agent(self, method: str, req: Dict[str, Any], timeout: Optional[float] = 60) -> Dict[str, Any]:
        return await self._conn.unary(method, req, timeout=timeout, headers=self._headers)

    async def _sandbox(self, method: str, req: Dict[str, Any], timeout: Optional[float] = 120) -> Dict[str, Any]:
        return await self._client._call(_SB + method, req, timeout=timeout)

    # Commands -----------------------------------------------------------

    async def run(
        self,
        args: Sequence[str],
        *,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        user: Optional[str] = None,
        stdin: Optional[Union[bytes, str]] = None,
        timeout: float = 60,
        max_output_bytes: int = 0,
    ) -> CommandResult:
        """Runs a program (argv) to completion. A program that does not
        exist gives exit code 127. Output beyond ``max_output_bytes`` per
        stream (default 1 MiB) is dropped and counted."""
        req: Dict[str, Any] = {"process": _config(args, cwd=cwd, env=env, user=user, timeout=timeout, stdin=stdin)}
        if max_output_bytes:
            req["maxOutputBytes"] = str(max_output_bytes)
        r = await self._agent(_PROC + "Run", req, timeout=timeout + 10)
        return CommandResult.from_bytes(
            unb64(r.get("stdout")),
            unb64(r.get("stderr")),
            exit_code=int(r.get("exitCode", 0)),
            timed_out=bool(r.get("timedOut", False)),
            stdout_dropped=int(r.get("stdoutDropped", 0)),
            stderr_dropped=int(r.get("stderrDropped", 0)),
            pid=int(r.get("pid", 0)),
        )

    async def run_shell(self, command: str, **kw: Any) -> CommandResult:
        """Runs a shell command line (``/bin/sh -c``) to completion and
        returns its stdout, stderr and exit_code. Takes the keywords of
        :meth:`run`."""
        return await self.run(["/bin/sh", "-c", command], **kw)

    async def exec(
        self,
        command: Union[str, Sequence[str]],
        *,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        user: Optional[str] = None,
        stdin: bool = False,
        timeout: Optional[float] = None,
        tag: Optional[str] = None,
    ) -> Process:
        """Starts a command and returns at once with a :class:`Process`
        whose output streams as it is produced. A string runs through
        ``/bin/sh -c``. With ``stdin=True`` use :meth:`Process.send_input`."""
        args = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        cfg = _config(args, cwd=cwd, env=env, user=user, timeout=timeout, keep_stdin_open=stdin, tag=tag)
        stream = self._conn.server_stream(_PROC + "Start", {"process": cfg}, headers=self._headers)
        return await Process(self, stream)._start()

    async def pty(
        self,
        command: Union[str, Sequence[str]] = "/bin/sh",
        *,
        cols: int = 80,
        rows: int = 24,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        user: Optional[str] = None,
    ) -> Process:
        """Starts a command in a pseudo-terminal. Output arrives as "pty"
        chunks; type with :meth:`Process.send_input`, resize with
        :meth:`Process.resize`."""
        args = shlex.split(command) if isinstance(command, str) else list(command)
        cfg = _config(args, cwd=cwd, env=env, user=user, timeout=None, pty={"cols": cols, "rows": rows})
        stream = self._conn.server_stream(_PROC + "Start", {"process": cfg}, headers=self._headers)
        return await Process(self, stream)._start()

    async def list_processes(self) -> List[ProcessInfo]:
        """Lists every process in the sandbox."""
        r = await self._agent(_PROC + "List", {})
        return [ProcessInfo.from_json(p) for p in r.get("processes", [])]

    async def kill(self, pid: int, signal: int = 9) -> None:
        """Sends a signal to a process by pid."""
        await self._agent(_PROC + "SendSignal", {"process": {"pid": pid}, "signal": signal})

    async def session(self, *, cwd: str = "", env: Optional[Dict[str, str]] = None, user: str = "") -> Session:
        """Opens a persistent shell session."""
        r = await self._agent(_SESS + "CreateSession", {"cwd": cwd, "env": env or {}, "user": user})
        return Session(self, r["session"])

    # Lifecycle ----------------------------------------------------------

    async def refresh(self) -> SandboxInfo:
        """Fetches the sandbox's current description."""
        r = await self._sandbox("GetSandbox", {"sandboxId": self.id})
        self.info = SandboxInfo.from_json(r["sandbox"])
        return self.info

    async def set_timeout(self, seconds: int) -> None:
        """Sets the time to live from now on."""
        r = await self._sandbox("SetSandboxTimeout", {"sandboxId": self.id, "timeoutSeconds": str(seconds)})
        self.info = SandboxInfo.from_json(r["sandbox"])

    async def update_network(
        self,
        *,
        add: Sequence[str] = (),
        remove: Sequence[str] = (),
        replace: Optional[Sequence[str]] = None,
        internet: Optional[bool] = None,
    ) -> SandboxInfo:
        """Changes the network policy by exactly what it says: ``replace``
        sets the whole rule list, else ``remove`` takes rules out (one the
        policy lacks is an error) and ``add`` puts rules in; ``internet``
        switches the shorthand. New connections follow it at once."""
        req: Dict[str, Any] = {"sandboxId": self.id, "add": [rule_json(r) for r in add], "remove": [rule_json(r) for r in remove]}
        if replace is not None:
            req["replaceRules"] = True
            req["rules"] = [rule_json(r) for r in replace]
        if internet is not None:
            req["internet"] = internet
        r = await self._sandbox("UpdateNetwork", req)
        self.info = SandboxInfo.from_json(r["sandbox"])
        return self.info

    def get_host(self, port: int) -> str:
        """The URL of ``port`` inside the sandbox, through the apiserver:
        ``get_host(8000) + "docs"`` reaches ``/docs`` of a server listening
        on 0.0.0.0:8000 there. Requests need the API key (:meth:`request`
        sends it) unless the sandbox allows public traffic. The sandbox
        needs a network (``DSecRunArgs(network=Network())``)."""
        return f"{self._client.api_url}/v1/sandboxes/{self.id}/ports/{int(port)}/"

    async def request(self, port: int, method: str = "GET", path: str = "/", **kwargs: Any) -> httpx.Response:
        """Sends an HTTP request to ``port`` inside the sandbox with the API
        key; keyword arguments go to httpx (``json=``, ``content=``,
        ``headers=``, ``timeout=``). A paused sandbox is resumed first."""
        return await self._client._http.request(method, self.get_host(port) + path.lstrip("/"), **kwargs)

    async def pause(self, depth: str = "freeze") -> int:
        """Pauses the sandbox; it then uses no CPU. ``depth="freeze"`` keeps
        its memory allocated (fast); ``depth="offload"`` writes it to the
        node's disk and gives it back (on backends that cannot, the sandbox
        is frozen and ``info.pause_depth`` says so). Any later call to the
        sandbox resumes it first, with its processes, files, sockets and
        remaining time to live. Returns the memory given back, in bytes."""
        r = await self._sandbox("PauseSandbox", {"sandboxId": self.id, "depth": _pause_depth(depth)})
        self.info = SandboxInfo.from_json(r["sandbox"])
        return int(r.get("memoryReleasedBytes", 0))

    async def resume(self) -> None:
        """Continues a paused sandbox."""
        r = await self._sandbox("ResumeSandbox", {"sandboxId": self.id})
        self.info = SandboxInfo.from_json(r["sandbox"])

    async def snapshot(self) -> SnapshotInfo:
        """Captures memory, processes and the writable layer; the sandbox
        keeps running. Restore with :meth:`DSecClient.restore`."""
        r = await self._sandbox("SnapshotSandbox", {"sandboxId": self.id})
        return SnapshotInfo.from_json(r["snapshot"])

    async def pack_diff(self, name: str, *, exclude: Optional[List[str]] = None, timeout: float = 3600) -> ImageInfo:
        """Turns what this sandbox changed in its image (created, changed
        and deleted files, links, modes, owners) into one new layer over
        that image, named ``name`` ("project/name:tag") in the image store;
        new sandboxes start from it on every backend, and it can be pushed.
        ``exclude`` leaves paths out: "/abs/path" from the root or "name" at
        any depth, with '*', '?' and '[...]' ("/root/.cache", "*.pyc"). A
        running sandbox pauses while its layer is read."""
        r = await self._sandbox("CommitSandbox", {"sandboxId": self.id, "name": name, "exclude": list(exclude or [])}, timeout=timeout)
        return ImageInfo.from_json(r["image"])

    commit = pack_diff

    async def fork(self, count: int = 1, *, timeout_seconds: int = 0, metadata: Optional[Dict[str, str]] = None, spread: bool = False) -> List["Sandbox"]:
        """Makes ``count`` copies that carry this sandbox's memory,
        processes and open ports, each with its own files, network, id and
        identity. Copies run on this sandbox's node while it has room, the
        rest on other nodes (which pull the snapshot from this one);
        ``spread=True`` places every copy on the less loaded of sampled
        nodes instead. Raises if any copy failed; the copies that did start
        are stopped first. Use :meth:`fork_results` for per-copy outcomes."""
        results = await self.fork_results(count, timeout_seconds=timeout_seconds, metadata=metadata, spread=spread)
        failed = [r for r in results if isinstance(r, DSecError)]
        if failed:
            await asyncio.gather(*(r.stop() for r in results if isinstance(r, Sandbox)), return_exceptions=True)
            raise failed[0]
        return [r for r in results if isinstance(r, Sandbox)]

    async def fork_results(self, count: int = 1, *, timeout_seconds: int = 0, metadata: Optional[Dict[str, str]] = None, spread: bool = False) -> List[Union["Sandbox", DSecError]]:
        """Like :meth:`fork`, but returns one entry per copy: a Sandbox, or
        the error that copy met."""
        from .errors import error_from_code

        r = await self._sandbox(
            "ForkSandbox",
            {
                "sandboxId": self.id,
                "count": count,
                "timeoutSeconds": str(timeout_seconds),
                "metadata": metadata or {},
                "placement": "FORK_PLACEMENT_SPREAD" if spread else "FORK_PLACEMENT_UNSPECIFIED",
            },
            timeout=300,
        )
        if r.get("sourceError"):
            warnings.warn(f"fork of {self.id}: the source could not be brought back: {r['sourceError']}", RuntimeWarning, stacklevel=2)
        out: List[Union[Sandbox, DSecError]] = []
        for res in r.get("results", []):
            if "sandbox" in res:
                out.append(Sandbox(self._client, SandboxInfo.from_json(res["sandbox"])))
            else:
                out.append(error_from_code(res.get("errorCode", "unknown"), res.get("errorMessage", "")))
        return out

    async def stop(self) -> None:
        """Stops the sandbox and removes everything it had."""
        await self._sandbox("StopSandbox", {"sandboxId": self.id})

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.stop()
        except NotFoundError:
            pass
