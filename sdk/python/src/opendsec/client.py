"""The entry point: DSecClient."""

from __future__ import annotations

import asyncio
import os
import random
import ssl
import uuid
from typing import Any, Callable, Dict, List, Optional

import httpx

from ._connect import IDEMPOTENCY_HEADER, ConnectClient, Endpoints, parse_urls
from .errors import AuthenticationError, DSecError, InvalidArgumentError, UnavailableError
from .models import DSecRunArgs, ImageInfo, NodeInfo, ProjectInfo, SandboxInfo, SnapshotInfo, TaskResult, TaskSandboxResult, _pause_depth
from .sandbox import Sandbox

_SB = "opendsec.sandbox.v1.SandboxService/"
# How long a create keeps trying (with its idempotency key) while the
# answers say to: an apiserver taking over a dead one's create, a fleet with
# no room now (DSecClient(create_wait=...) sets it per client).
_CREATE_RETRY_SECONDS = 60
_IAM = "opendsec.iam.v1.IAMService/"
_IMG = "opendsec.image.v1.ImageService/"

# Progress receives (stage, done, total): stage names the layer; total is 0
# when unknown.
ProgressFn = Callable[[str, int, int], None]


def tls_context(ca_file: Optional[str], client_cert: Optional[str], client_key: Optional[str]) -> Any:
    """The TLS verification httpx gets: True (the system's roots) unless a
    CA (ca_file or DSEC_CA_FILE: a cluster's own, trusted besides the
    system's) or a client certificate for mutual TLS (client_cert and
    client_key, or DSEC_CLIENT_CERT and DSEC_CLIENT_KEY) is named."""
    ca = ca_file or os.environ.get("DSEC_CA_FILE", "")
    cert = client_cert or os.environ.get("DSEC_CLIENT_CERT", "")
    key = client_key or os.environ.get("DSEC_CLIENT_KEY", "")
    if not ca and not cert and not key:
        return True
    ctx = ssl.create_default_context()
    if ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise InvalidArgumentError(f"CA file {ca!r} (ca_file or DSEC_CA_FILE): {e}") from None
    if bool(cert) != bool(key):
        raise InvalidArgumentError("client certificate: client_cert and client_key (DSEC_CLIENT_CERT, DSEC_CLIENT_KEY) go together: give both or neither")
    if cert:
        try:
            ctx.load_cert_chain(certfile=cert, keyfile=key)
        except (OSError, ssl.SSLError) as e:
            raise InvalidArgumentError(f"client certificate {cert!r} with key {key!r}: {e}") from None
    return ctx


class DSecClient:
    """A connection to an OpenDsec apiserver.

    Reads ``DSEC_API_URL`` and ``DSEC_API_KEY`` unless given. The URL may be
    a comma-separated list of interchangeable apiservers: calls go to the one
    that last answered and fail over to the others; creates carry an
    idempotency key, so one retried on another apiserver makes no second
    sandbox. Use it as an async context manager, or call :meth:`close`.
    """

    def __init__(
        self, api_url: Optional[str] = None, api_key: Optional[str] = None, *, max_connections: int = 100, ca_file: Optional[str] = None,
        client_cert: Optional[str] = None, client_key: Optional[str] = None, create_wait: float = _CREATE_RETRY_SECONDS,
    ) -> None:
        raw = api_url or os.environ.get("DSEC_API_URL", "")
        key = api_key or os.environ.get("DSEC_API_KEY", "")
        if not raw.strip(" ,"):
            raise InvalidArgumentError("no API URL: pass api_url or set DSEC_API_URL (source the client.env that dsec up wrote)")
        try:
            self.api_urls = parse_urls(raw)
        except ValueError as e:
            raise InvalidArgumentError(f"API URL: {e}") from None
        self.api_url = self.api_urls[0]
        self._endpoints = Endpoints(self.api_urls)
        if not key:
            raise AuthenticationError("no API key: pass api_key or set DSEC_API_KEY")
        verify = tls_context(ca_file, client_cert, client_key)
        self._http = httpx.AsyncClient(
            verify=verify,
            headers={"Authorization": f"Bearer {key}"},
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx.Timeout(120, connect=10),
        )
        self._conn = ConnectClient(self._http, self._endpoints)
        #: How long run_sandbox sends a create again while the answers say to
        #: (a fleet with no room now, an apiserver that died), in seconds.
        self.create_wait = create_wait
        if any(u.startswith("https://") for u in self.api_urls) and not (client_cert or os.environ.get("DSEC_CLIENT_CERT")):
            self._conn.closed_hint = "an apiserver that requires client certificates closes connections without one: set DSEC_CLIENT_CERT and DSEC_CLIENT_KEY"

    async def __aenter__(self) -> "DSecClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, req: Dict[str, Any], timeout: Optional[float] = 120, headers: Optional[Dict[str, str]] = None
    ) -> Dict[str, Any]:
        return await self._conn.unary(method, req, timeout=timeout, headers=headers)

    async def run_sandbox(self, args: Optional[DSecRunArgs] = None) -> Sandbox:
        """Creates a sandbox and returns once its agent answers."""
        args = args or DSecRunArgs()
        req: Dict[str, Any] = {"spec": args.to_spec()}
        if args.project:
            req["project"] = args.project
        # One key for every attempt: an attempt whose apiserver died answers,
        # on the next one, with the sandbox it made or makes a new one.
        key = uuid.uuid4().hex
        deadline = asyncio.get_running_loop().time() + self.create_wait
        pause = 0.2
        while True:
            try:
                r = await self._call(_SB + "CreateSandbox", req, timeout=300, headers={IDEMPOTENCY_HEADER: key})
                return Sandbox(self, SandboxInfo.from_json(r["sandbox"]))
            except DSecError as e:
                if not e.retryable:
                    raise
                # A fleet with no room says how long to wait; spread ±25 %
                # so a burst's refused creates do not return all at once.
                wait = e.retry_after * random.uniform(0.75, 1.25) if e.retry_after is not None else pause
                if asyncio.get_running_loop().time() + wait > deadline:
                    raise
                await asyncio.sleep(wait)
                pause = min(pause * 2, 2.0)

    async def get_sandbox(self, sandbox_id: str) -> Sandbox:
        """Returns a handle on an existing sandbox."""
        r = await self._call(_SB + "GetSandbox", {"sandboxId": sandbox_id})
        return Sandbox(self, SandboxInfo.from_json(r["sandbox"]))

    async def list_sandboxes(
        self, *, project: str = "", task: str = "", metadata: Optional[Dict[str, str]] = None, states: Optional[List[str]] = None
    ) -> List[SandboxInfo]:
        """Lists sandboxes of the key's project subtree, oldest first."""
        out: List[SandboxInfo] = []
        token = ""
        while True:
            req: Dict[str, Any] = {"project": project, "task": task, "metadata": metadata or {}, "pageSize": 1000, "pageToken": token}
            if states:
                req["states"] = ["SANDBOX_STATE_" + s.upper() for s in states]
            r = await self._call(_SB + "ListSandboxes", req)
            out.extend(SandboxInfo.from_json(s) for s in r.get("sandboxes", []))
            token = r.get("nextPageToken", "")
            if not token:
                return out

    async def restore(self, snapshot: "SnapshotInfo | str", *, timeout_seconds: int = 0, metadata: Optional[Dict[str, str]] = None) -> Sandbox:
        """Starts a new sandbox from a snapshot."""
        sid = snapshot if isinstance(snapshot, str) else snapshot.id
        r = await self._call(_SB + "RestoreSnapshot", {"snapshotId": sid, "timeoutSeconds": str(timeout_seconds), "metadata": metadata or {}}, timeout=300)
        return Sandbox(self, SandboxInfo.from_json(r["sandbox"]))

    async def pause_task(self, task: str, depth: str = "freeze", *, project: str = "") -> TaskResult:
        """Pauses every running sandbox of ``task`` (its ``DSecRunArgs.task``)
        in the key's project subtree, on every node, in parallel.
        ``depth="freeze"`` stops their CPU and keeps their memory;
        ``depth="offload"`` writes their memory to disk and gives it back
        (frozen instead where a backend cannot; the result's note says so).
        One that could not be paused is in ``failed``; the others are paused
        anyway. Any later call to a paused sandbox resumes it first."""
        r = await self._call(_SB + "PauseTask", {"task": task, "project": project, "depth": _pause_depth(depth)}, timeout=3600)
        return TaskResult(
            results=[TaskSandboxResult.from_json(x) for x in r.get("results", [])],
            memory_released_bytes=int(r.get("memoryReleasedBytes", 0)),
        )

    async def resume_task(self, task: str, *, project: str = "") -> TaskResult:
        """Resumes every paused sandbox of ``task``, in parallel (optional:
        any call to a paused sandbox resumes it)."""
        r = await self._call(_SB + "ResumeTask", {"task": task, "project": project}, timeout=3600)
        return TaskResult(results=[TaskSandboxResult.from_json(x) for x in r.get("results", [])])

    async def list_snapshots(self, sandbox_id: str = "") -> List[SnapshotInfo]:
        """Lists snapshots (of one sandbox, or all in the key's project subtree)."""
        r = await self._call(_SB + "ListSnapshots", {"sandboxId": sandbox_id})
        return [SnapshotInfo.from_json(s) for s in r.get("snapshots", [])]

    async def delete_snapshot(self, snapshot: "SnapshotInfo | str") -> None:
        """Deletes a snapshot and frees its storage."""
        sid = snapshot if isinstance(snapshot, str) else snapshot.id
        await self._call(_SB + "DeleteSnapshot", {"snapshotId": sid})

    # Projects and quotas (ADMIN keys, in their own subtree).

    async def create_project(
        self, path: str, *, max_sandboxes: int = 0, cpu_cores: float = 0, memory_mb: int = 0, no_internet: bool = False, storage_mb: int = 0
    ) -> ProjectInfo:
        """Creates PARENT/NAME with a quota (0: no limit of its own)."""
        parent, _, name = path.rpartition("/")
        if not parent or not name:
            raise InvalidArgumentError(f"project {path!r}: want PARENT/NAME, e.g. root/team-a")
        quota = _quota(max_sandboxes, cpu_cores, memory_mb, no_internet, storage_mb)
        r = await self._call(_IAM + "CreateProject", {"parent": parent, "name": name, "quota": quota})
        return ProjectInfo.from_json(r["project"])

    async def list_projects(self, path: str = "") -> List[ProjectInfo]:
        """The project subtree at path (default: the key's), with usage against quota."""
        r = await self._call(_IAM + "ListProjects", {"path": path})
        return [ProjectInfo.from_json(p) for p in r.get("projects", [])]

    async def set_quota(
        self, path: str, *, max_sandboxes: int = 0, cpu_cores: float = 0, memory_mb: int = 0, no_internet: bool = False, storage_mb: int = 0
    ) -> ProjectInfo:
        """Replaces a project's quota (storage_mb: its images and snapshots)."""
        quota = _quota(max_sandboxes, cpu_cores, memory_mb, no_internet, storage_mb)
        r = await self._call(_IAM + "SetQuota", {"path": path, "quota": quota})
        return ProjectInfo.from_json(r["project"])

    async def delete_project(self, path: str) -> None:
        """Deletes a leaf project that has no keys and no sandboxes."""
        await self._call(_IAM + "DeleteProject", {"path": path})

    async def list_nodes(self) -> List[NodeInfo]:
        """The edges: health, allocation against capacity, backends (root ADMIN key)."""
        r = await self._call(_SB + "ListNodes", {})
        return [NodeInfo.from_json(n) for n in r.get("nodes", [])]

    # Images.

    async def list_images(self, project: str = "") -> List[ImageInfo]:
        """The images the key can use (its project's, its ancestors' and descendants')."""
        r = await self._call(_IMG + "ListImages", {"project": project})
        return [ImageInfo.from_json(i) for i in r.get("images", [])]

    async def delete_image(self, name: str) -> int:
        """Removes an image's name; returns the store's bytes freed (layers
        no other image, sandbox or snapshot uses)."""
        r = await self._call(_IMG + "DeleteImage", {"name": name})
        return int(r.get("freedBytes", 0))

    async def pull_image(
        self,
        source: str,
        name: str = "",
        *,
        username: str = "",
        password: str = "",
        identity_token: str = "",
        progress: Optional[ProgressFn] = None,
        timeout: float = 3600,
    ) -> ImageInfo:
        """Copies an image from an OCI registry into the store.

        ``source`` is a registry reference ("registry.example.com/team/app:1.0",
        "127.0.0.1:5000/py:3.12", "python:3.12" for Docker Hub); ``name`` the
        store name "project/name:tag" (default: the source's last path part
        and tag in the key's project). Without credentials the apiserver's
        own logins for that registry are used, else none. A multi-platform
        index resolves to linux/amd64; layers the store has are not fetched
        again, and a broken download continues where it stopped.
        """
        req = {"source": source, "name": name, "credentials": _credentials(username, password, identity_token)}
        last = await self._progress_stream("PullImage", req, "image", progress, timeout)
        return ImageInfo.from_json(last["image"])

    async def push_image(
        self,
        name: str,
        destination: str,
        *,
        username: str = "",
        password: str = "",
        identity_token: str = "",
        progress: Optional[ProgressFn] = None,
        timeout: float = 3600,
    ) -> str:
        """Uploads the stored image ``name`` to a registry reference with a
        tag; returns the pushed manifest's digest."""
        req = {"name": name, "destination": destination, "credentials": _credentials(username, password, identity_token)}
        last = await self._progress_stream("PushImage", req, "digest", progress, timeout)
        return str(last["digest"])

    async def _progress_stream(
        self, method: str, req: Dict[str, Any], result: str, progress: Optional[ProgressFn], timeout: float
    ) -> Dict[str, Any]:
        """Calls a streaming image method: hands each progress message to
        ``progress`` and returns the message that carries ``result``."""
        async for msg in self._conn.server_stream(_IMG + method, req, timeout=timeout):
            p = msg.get("progress")
            if p and progress:
                progress(p.get("stage", ""), int(p.get("done", 0)), int(p.get("total", 0)))
            if msg.get(result):
                return msg
        raise UnavailableError(f"{method}: the apiserver ended the stream without the {result}")


def _credentials(username: str, password: str, identity_token: str) -> Dict[str, str]:
    if bool(username) != bool(password) and not identity_token:
        raise InvalidArgumentError("registry credentials: give username and password together (or identity_token)")
    return {"username": username, "password": password, "identityToken": identity_token}


def _quota(max_sandboxes: int, cpu_cores: float, memory_mb: int, no_internet: bool, storage_mb: int) -> Dict[str, Any]:
    """A Quota message in the API's JSON (int64 fields as strings)."""
    return {
        "maxSandboxes": str(max_sandboxes),
        "cpuCores": cpu_cores,
        "memoryMb": str(memory_mb),
        "noInternet": no_internet,
        "storageMb": str(storage_mb),
    }
