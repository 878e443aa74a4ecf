"""Plain data types returned by the SDK."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(s: Optional[str]) -> bytes:
    if not s:
        return b""
    return base64.b64decode(s + "=" * (-len(s) % 4))


def _time(s: Optional[str]) -> Optional[datetime]:
    if not s:
        return None
    # protojson: RFC 3339 with Z and up to nanoseconds.
    s = s.replace("Z", "+00:00")
    if "." in s:
        head, rest = s.split(".", 1)
        frac, _, tz = rest.partition("+")
        s = f"{head}.{frac[:6]}+{tz}" if tz else f"{head}.{frac[:6]}"
    return datetime.fromisoformat(s)


def rule_json(rule: str) -> Dict[str, Any]:
    """A rule as the API carries it, from the text form the CLI and
    :class:`Network` use: ``"[tcp |udp ]DESTINATION[:PORTS]"``, e.g.
    ``"pypi.example.org"``, ``"tcp *.example.org:443"``,
    ``"udp 10.1.0.0/16:53,5353"``. The server checks it."""
    text = rule.strip()
    out: Dict[str, Any] = {}
    if " " in text:
        proto, text = text.split(" ", 1)
        out["protocol"] = proto
        text = text.strip()
    if ":" in text:
        text, ports = text.split(":", 1)
        out["ports"] = ports.split(",")
    is_ip = all(p.isdigit() for p in text.split(".")) and text.count(".") == 3
    out["cidr" if ("/" in text or is_ip) else "domain"] = text
    return out


def rule_text(r: Dict[str, Any]) -> str:
    """A rule from the API in its canonical text form."""
    dst = r.get("domain") or r.get("cidr", "")
    ports = r.get("ports") or []
    return f"{r.get('protocol') or 'any'} {dst}" + (":" + ",".join(ports) if ports else "")


@dataclass
class Network:
    """A sandbox's network. A sandbox with one gets its own interface and
    address: egress only where ``allow`` (and ``internet``) say, and its
    ports are reachable through the apiserver (:meth:`Sandbox.get_host`).
    Without one it has loopback only."""

    allow: List[str] = field(default_factory=list)
    """Allowed destinations: ``"pypi.example.org"``, ``"*.example.org"``,
    ``"tcp 10.1.0.0/16:443"`` (see :func:`rule_json`). Names resolve through
    the node's DNS proxy, which answers only allowed ones."""
    internet: bool = False
    """Every public address (never private ranges, the node, link-local or
    metadata addresses, or other sandboxes)."""
    allow_public_traffic: bool = False
    """Let requests without an API key reach the sandbox's ports."""

    def to_json(self) -> Dict[str, Any]:
        return {"internet": self.internet, "rules": [rule_json(r) for r in self.allow], "allowPublicTraffic": self.allow_public_traffic}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Network":
        return cls(allow=[rule_text(r) for r in d.get("rules", [])], internet=bool(d.get("internet", False)), allow_public_traffic=bool(d.get("allowPublicTraffic", False)))


@dataclass
class DSecRunArgs:
    """What a new sandbox runs and within which limits.

    Zero or empty values take the server's defaults.
    """

    backend: str = "container"
    """Isolation backend: "container" (crun/runc), "gvisor", "microvm" (a
    QEMU microVM) or "vm" (a full QEMU machine that boots the image's
    systemd)."""
    image: str = "root/py:3.11"
    """Image name "project/name:tag"."""
    cpu_cores_limit: float = 0
    memory_limit_mb: int = 0
    pids_limit: int = 0
    """Processes and threads in the sandbox."""
    disk_limit_mb: int = 0
    """Size of the writable layer: writes past it fail with ENOSPC (on the
    gvisor backend the layer lives in memory and memory_limit_mb bounds it)."""
    open_files_limit: int = 0
    """Open files per process (RLIMIT_NOFILE)."""
    timeout_seconds: int = 0
    """Time to live; the sandbox stops when it runs out."""
    env: Dict[str, str] = field(default_factory=dict)
    metadata: Dict[str, str] = field(default_factory=dict)
    task: str = ""
    """Task label, for pausing a whole task at once (:meth:`DSecClient.pause_task`)."""
    on_timeout: str = "kill"
    """When the time to live runs out: "kill" removes the sandbox, "pause"
    pauses it (offloaded where the backend can, else frozen) until a call
    resumes it."""
    explicit_resume: bool = False
    """While paused, calls do not resume it (they fail naming the pause):
    only :meth:`Sandbox.resume` does."""
    project: str = ""
    """Project to create in; empty means the API key's project."""
    network: Optional[Network] = None
    """The sandbox's network; None: loopback only."""
    devices: List[str] = field(default_factory=list)
    """Host PCI devices by address ("0000:01:00.0"), passed through to a
    ``backend="vm"`` sandbox with VFIO where the node has an IOMMU and the
    device is bound to vfio-pci; refused elsewhere, naming what is missing."""

    def to_spec(self) -> Dict[str, Any]:
        spec = {
            "backend": self.backend,
            "image": self.image,
            "resources": {
                "cpuCores": self.cpu_cores_limit,
                "memoryMb": str(self.memory_limit_mb),
                "pids": str(self.pids_limit),
                "diskMb": str(self.disk_limit_mb),
                "openFiles": str(self.open_files_limit),
            },
            "timeoutSeconds": str(self.timeout_seconds),
            "env": dict(self.env),
            "metadata": dict(self.metadata),
            "task": self.task,
            "onTimeout": _on_timeout(self.on_timeout),
            "explicitResume": self.explicit_resume,
        }
        if self.network is not None:
            spec["network"] = self.network.to_json()
        if self.devices:
            spec["devices"] = list(self.devices)
        return spec


@dataclass
class SandboxInfo:
    """A sandbox as the server describes it."""

    id: str
    project: str
    node_id: str
    state: str
    backend: str
    image: str
    cpu_cores: float
    memory_mb: int
    metadata: Dict[str, str]
    task: str
    created_at: Optional[datetime]
    expires_at: Optional[datetime]
    message: str = ""
    source_snapshot_id: str = ""
    network: Optional[Network] = None
    """Its network policy now (rules in canonical form); None: loopback only."""
    network_address: str = ""
    pause_depth: str = ""
    """For a paused sandbox: "freeze" (memory kept) or "offload" (memory on disk)."""
    timeout_left_seconds: int = 0
    """For a paused sandbox: the time to live it resumes with (its
    expires_at is then the end of its paused lifetime)."""
    on_timeout: str = "kill"
    explicit_resume: bool = False
    oom_kills: int = 0
    """Processes its limits ended for using more than memory_mb while the
    sandbox lived on (the kernel's OOM killer; under gVisor the agent's
    memory watch)."""
    forks_refused: int = 0
    """Forks and new threads refused at its pids limit (container and
    microvm)."""

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "SandboxInfo":
        spec = d.get("spec", {})
        res = spec.get("resources", {})
        return cls(
            id=d["id"],
            project=d.get("project", ""),
            node_id=d.get("nodeId", ""),
            state=d.get("state", "SANDBOX_STATE_UNSPECIFIED").replace("SANDBOX_STATE_", "").lower(),
            backend=spec.get("backend", ""),
            image=spec.get("image", ""),
            cpu_cores=float(res.get("cpuCores", 0)),
            memory_mb=int(res.get("memoryMb", 0)),
            metadata=dict(spec.get("metadata", {})),
            task=spec.get("task", ""),
            created_at=_time(d.get("createdAt")),
            expires_at=_time(d.get("expiresAt")),
            message=d.get("message", ""),
            source_snapshot_id=d.get("sourceSnapshotId", ""),
            network=Network.from_json(spec["network"]) if "network" in spec else None,
            network_address=d.get("networkAddress", ""),
            pause_depth=d.get("pauseDepth", "").replace("PAUSE_DEPTH_", "").replace("UNSPECIFIED", "").lower(),
            timeout_left_seconds=int(d.get("timeoutLeftSeconds", 0)),
            on_timeout="pause" if spec.get("onTimeout") == "ON_TIMEOUT_PAUSE" else "kill",
            explicit_resume=bool(spec.get("explicitResume", False)),
            oom_kills=int(d.get("limitEvents", {}).get("oomKills", 0)),
            forks_refused=int(d.get("limitEvents", {}).get("forksRefused", 0)),
        )


@dataclass
class CommandResult:
    """The outcome of a command run to completion."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    stdout_dropped: int = 0
    """Bytes dropped past the output cap."""
    stderr_dropped: int = 0
    pid: int = 0
    cwd: str = ""
    """Working directory afterwards (session commands only)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_bytes(cls, out: bytes, err: bytes, **kw: Any) -> "CommandResult":
        return cls(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            stdout_bytes=out,
            stderr_bytes=err,
            **kw,
        )


@dataclass
class EntryInfo:
    """A file system entry inside a sandbox."""

    name: str
    path: str
    type: str
    """"file", "directory", "symlink" or "other"."""
    size: int
    mode: int
    owner: str
    group: str
    modified_at: Optional[datetime]
    symlink_target: str = ""
    metadata: Dict[str, str] = field(default_factory=dict)
    """User-defined metadata (``Files.write(metadata=...)``, or set in the
    sandbox as ``user.e2b.KEY`` extended attributes)."""

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "EntryInfo":
        return cls(
            name=d.get("name", ""),
            path=d.get("path", ""),
            type=d.get("type", "FILE_TYPE_UNSPECIFIED").replace("FILE_TYPE_", "").lower(),
            size=int(d.get("size", 0)),
            mode=int(d.get("mode", 0)),
            owner=d.get("owner", ""),
            group=d.get("group", ""),
            modified_at=_time(d.get("modifiedAt")),
            symlink_target=d.get("symlinkTarget", ""),
            metadata=dict(d.get("metadata") or {}),
        )


@dataclass
class ProcessInfo:
    """A process running in a sandbox."""

    pid: int
    ppid: int
    cmdline: List[str]
    uid: int
    state: str
    rss_bytes: int
    tag: str
    managed: bool

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ProcessInfo":
        return cls(
            pid=int(d.get("pid", 0)),
            ppid=int(d.get("ppid", 0)),
            cmdline=list(d.get("cmdline", [])),
            uid=int(d.get("uid", 0)),
            state=d.get("state", ""),
            rss_bytes=int(d.get("rssBytes", 0)),
            tag=d.get("tag", ""),
            managed=bool(d.get("managed", False)),
        )


@dataclass
class OutputChunk:
    """A piece of a running process's output."""

    stream: str
    """"stdout", "stderr" or "pty"."""
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@dataclass
class SnapshotInfo:
    """A memory snapshot of a sandbox."""

    id: str
    source_sandbox_id: str
    project: str
    node_id: str
    size_bytes: int
    created_at: Optional[datetime]

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "SnapshotInfo":
        return cls(
            id=d["id"],
            source_sandbox_id=d.get("sourceSandboxId", ""),
            project=d.get("project", ""),
            node_id=d.get("nodeId", ""),
            size_bytes=int(d.get("sizeBytes", 0)),
            created_at=_time(d.get("createdAt")),
        )


@dataclass
class ProjectInfo:
    """A project, its quota (0: no limit of its own) and what its subtree
    holds against it now (sandboxes and creates in progress; images and
    snapshots, in MiB)."""

    path: str
    max_sandboxes: int
    cpu_cores: float
    memory_mb: int
    no_internet: bool
    used_sandboxes: int
    used_cpu_cores: float
    used_memory_mb: int
    storage_mb: int = 0
    used_storage_mb: int = 0

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ProjectInfo":
        q, u = d.get("quota", {}), d.get("usage", {})
        return cls(
            path=d["path"],
            max_sandboxes=int(q.get("maxSandboxes", 0)),
            cpu_cores=float(q.get("cpuCores", 0)),
            memory_mb=int(q.get("memoryMb", 0)),
            no_internet=bool(q.get("noInternet", False)),
            used_sandboxes=int(u.get("sandboxes", 0)),
            used_cpu_cores=float(u.get("cpuCores", 0)),
            used_memory_mb=int(u.get("memoryMb", 0)),
            storage_mb=int(q.get("storageMb", 0)),
            used_storage_mb=int(u.get("storageMb", 0)),
        )


@dataclass
class NodeInfo:
    """An edge as the apiserver's watcher last saw it."""

    id: str
    address: str
    healthy: bool
    error: str
    capacity_sandboxes: int
    capacity_cpu_cores: float
    capacity_memory_mb: int
    allocated_sandboxes: int
    allocated_cpu_cores: float
    allocated_memory_mb: int
    backends: Dict[str, str]
    """Backend name -> "" when usable, else why not."""

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "NodeInfo":
        c, a = d.get("capacity", {}), d.get("allocated", {})
        return cls(
            id=d["id"],
            address=d.get("address", ""),
            healthy=bool(d.get("healthy", False)),
            error=d.get("error", ""),
            capacity_sandboxes=int(c.get("sandboxes", 0)),
            capacity_cpu_cores=float(c.get("cpuCores", 0)),
            capacity_memory_mb=int(c.get("memoryMb", 0)),
            allocated_sandboxes=int(a.get("sandboxes", 0)),
            allocated_cpu_cores=float(a.get("cpuCores", 0)),
            allocated_memory_mb=int(a.get("memoryMb", 0)),
            backends=dict(d.get("backends", {})),
        )


def _on_timeout(v: str) -> str:
    if v not in ("kill", "pause"):
        raise ValueError(f"on_timeout {v!r}: want 'kill' or 'pause'")
    return "ON_TIMEOUT_" + v.upper()


def _pause_depth(depth: str) -> str:
    if depth not in ("freeze", "offload"):
        raise ValueError(f"depth {depth!r}: want 'freeze' or 'offload'")
    return "PAUSE_DEPTH_" + depth.upper()


@dataclass
class TaskSandboxResult:
    """What a task-wide pause or resume did to one sandbox."""

    sandbox_id: str
    node_id: str
    ok: bool
    error: str = ""
    """Empty when it worked; else the error code and message."""
    info: Optional[SandboxInfo] = None
    memory_released_bytes: int = 0
    note: str = ""
    """Why the pause is shallower than asked (e.g. a backend that cannot
    offload: frozen instead)."""
    took_seconds: float = 0.0

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "TaskSandboxResult":
        err = ""
        if d.get("errorCode"):
            err = f"{d['errorCode']}: {d.get('errorMessage', '')}"
        return cls(
            sandbox_id=d.get("sandboxId", ""),
            node_id=d.get("nodeId", ""),
            ok=not err,
            error=err,
            info=SandboxInfo.from_json(d["sandbox"]) if "sandbox" in d else None,
            memory_released_bytes=int(d.get("memoryReleasedBytes", 0)),
            note=d.get("note", ""),
            took_seconds=int(d.get("tookUs", 0)) / 1e6,
        )


@dataclass
class TaskResult:
    """The outcome of :meth:`DSecClient.pause_task` or :meth:`DSecClient.resume_task`."""

    results: List[TaskSandboxResult]
    memory_released_bytes: int = 0

    @property
    def failed(self) -> List[TaskSandboxResult]:
        return [r for r in self.results if not r.ok]


@dataclass
class ImageInfo:
    """An image of the shared store."""

    name: str
    """``project/name:tag``."""
    digest: str
    """Of its OCI manifest (the registry's digest for a pulled image)."""
    size_bytes: int
    """Compressed size of its layers."""
    layers: int

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ImageInfo":
        return cls(name=d["name"], digest=d.get("digest", ""), size_bytes=int(d.get("sizeBytes", 0)), layers=int(d.get("layers", 0)))
