"""OpenDsec Python SDK: sandboxes for agentic RL and code-running agents.

>>> async with DSecClient() as client:
...     sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
...     print((await sb.run_shell("echo hi")).stdout)
"""

from .client import DSecClient
from .errors import (
    AlreadyExistsError,
    AuthenticationError,
    DSecError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
    UnsupportedError,
)
from .models import CommandResult, DSecRunArgs, EntryInfo, ImageInfo, Network, NodeInfo, OutputChunk, ProcessInfo, ProjectInfo, SandboxInfo, SnapshotInfo, TaskResult, TaskSandboxResult
from .sandbox import Files, Process, Sandbox, Session

__all__ = [
    "AlreadyExistsError",
    "AuthenticationError",
    "CommandResult",
    "DSecClient",
    "DSecError",
    "DSecRunArgs",
    "Network",
    "NodeInfo",
    "EntryInfo",
    "FailedPreconditionError",
    "ImageInfo",
    "Files",
    "InvalidArgumentError",
    "NotFoundError",
    "OutputChunk",
    "PermissionDeniedError",
    "Process",
    "ProcessInfo",
    "ProjectInfo",
    "ResourceExhaustedError",
    "Sandbox",
    "SandboxInfo",
    "Session",
    "SnapshotInfo",
    "TaskResult",
    "TaskSandboxResult",
    "UnavailableError",
    "UnsupportedError",
]
__version__ = "0.1.0"
