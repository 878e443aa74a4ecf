"""Fixtures: a running OpenDsec (started here with bin/dsec up unless
DSEC_API_URL is already set) and a client."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator

import pytest

REPO = Path(__file__).resolve().parents[3]

# make test sets DSEC_TEST_STRICT=1: then a missing binary or image fails
# the run instead of skipping, so a green run means everything was covered.
STRICT = os.environ.get("DSEC_TEST_STRICT") == "1"


def missing(reason: str) -> None:
    """Skips the test for want of something on the host; fails when strict."""
    if STRICT:
        pytest.fail(f"{reason} (DSEC_TEST_STRICT=1: a missing runtime or image fails the run)", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 and up): a port
    the kernel handed out and we closed could go to one of dsec up's own
    ":0" listeners before dsec up binds to it."""
    for _ in range(100):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


def _read_env(path: Path) -> Dict[str, str]:
    env: Dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            k, v = line[len("export ") :].split("=", 1)
            env[k] = v
    return env


@pytest.fixture(scope="session")
def dsec_env(request: pytest.FixtureRequest) -> Iterator[Dict[str, str]]:
    """DSEC_API_URL and DSEC_API_KEY of a running cluster."""
    if os.environ.get("DSEC_API_URL"):
        yield {"DSEC_API_URL": os.environ["DSEC_API_URL"], "DSEC_API_KEY": os.environ.get("DSEC_API_KEY", "")}
        return
    dsec = REPO / "bin" / "dsec"
    if not dsec.exists():
        missing("bin/dsec not built (run make build) and DSEC_API_URL not set")
    images = Path(os.environ.get("DSEC_TEST_IMAGE_STORE", REPO / ".cache" / "images"))
    state = Path(tempfile.mkdtemp(prefix="dsec-sdk-test-"))
    log = open(state / "dsec.log", "w")
    proc = subprocess.Popen(
        [str(dsec), "up", "--state-dir", str(state), "--listen", f"127.0.0.1:{_free_port()}", "--e2b-listen", "", "--image-store", str(images), "--backends", "container,gvisor,microvm,vm"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    env_file = state / "client.env"
    deadline = time.time() + 30
    while not env_file.exists():
        if proc.poll() is not None or time.time() > deadline:
            log.close()
            raise RuntimeError("dsec up did not start: " + (state / "dsec.log").read_text())
        time.sleep(0.05)
    env = _read_env(env_file)
    try:
        yield env
    finally:
        # Remove every sandbox the tests left, then stop the cluster.
        subprocess.run([str(dsec), "stop", "--all"], env={**os.environ, **env}, capture_output=True)
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        # The state holds the node's unpacked image layers (hundreds of MB):
        # removed after a clean run, kept (and named) after a failing one.
        if request.session.testsfailed or os.environ.get("DSEC_KEEP_TEST_STATE"):
            print(f"\ndsec state kept in {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def images(dsec_env: Dict[str, str]) -> set:
    """Names of the images the test cluster has."""
    out = subprocess.run([str(REPO / "bin" / "dsec"), "image", "ls"], env={**os.environ, **dsec_env}, capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines()[1:] if line.strip()}


@pytest.fixture(scope="session")
def py_image(images: set) -> str:
    """root/py:3.11, which make images builds."""
    if "root/py:3.11" not in images:
        missing("root/py:3.11 not built (make images)")
    return "root/py:3.11"


@pytest.fixture(scope="session")
def systemd_image(images: set) -> str:
    """root/debian-systemd:13, the vm backend's image, which make images builds."""
    if "root/debian-systemd:13" not in images:
        missing("root/debian-systemd:13 not built (make images)")
    return "root/debian-systemd:13"


class _OverSync:
    """The sync client seen through the async SDK's interface, so that
    every test that takes ``client`` runs against both: each call runs the
    sync method in a worker thread (the sync client waits there for its own
    loop), and what it returns is seen the same way."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        # What is async in the async SDK is awaited here; the rest (get_host) is not.
        if inspect.iscoroutinefunction(getattr(self._inner._inner, name, None)):

            async def call(*args, **kwargs):
                args = [a._inner if isinstance(a, _OverSync) else a for a in args]
                kwargs = {k: v._inner if isinstance(v, _OverSync) else v for k, v in kwargs.items()}
                return _over_sync(await asyncio.to_thread(value, *args, **kwargs))

            return call
        return _over_sync(value)

    def __aiter__(self):
        it = iter(self._inner)
        end = object()

        async def chunks():
            while (chunk := await asyncio.to_thread(next, it, end)) is not end:
                yield chunk

        return chunks()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await asyncio.to_thread(self._inner.__exit__, *exc)


def _over_sync(value):
    from opendsec import sync

    if isinstance(value, sync._Wrapper):
        return _OverSync(value)
    if isinstance(value, list):
        return [_over_sync(v) for v in value]
    return value


@pytest.fixture(params=["async", "sync"])
async def client(request: pytest.FixtureRequest, dsec_env: Dict[str, str]):
    """The async client, then the sync one (opendsec.sync) through the same tests."""
    if request.param == "async":
        from opendsec import DSecClient

        async with DSecClient(dsec_env["DSEC_API_URL"], dsec_env["DSEC_API_KEY"]) as c:
            yield c
        return
    from opendsec.sync import DSecClient as SyncClient

    c = await asyncio.to_thread(SyncClient, dsec_env["DSEC_API_URL"], dsec_env["DSEC_API_KEY"])
    try:
        yield _OverSync(c)
    finally:
        await asyncio.to_thread(c.close)


@pytest.fixture
async def sandbox(client, images):
    from opendsec import DSecRunArgs

    if "root/py:3.11" in images:
        image = "root/py:3.11"
    elif STRICT:
        missing("root/py:3.11 not built (make images)")
    else:
        image = "root/busybox:latest"
    sb = await client.run_sandbox(DSecRunArgs(backend="container", image=image, cpu_cores_limit=1, memory_limit_mb=512))
    yield sb
    try:
        await sb.stop()
    except Exception:
        pass
