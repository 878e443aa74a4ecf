"""Runs E2B's own Python SDK against OpenDsec's E2B gateway.

A cluster is started here with bin/dsec up (gvisor backend, root/py:3.11 as
the "base" template) unless E2B_API_URL is already set; the SDK is then
pointed at the gateway by the three variables a user would change.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import sys
from pathlib import Path
from typing import Dict, Iterator

import pytest

REPO = Path(__file__).resolve().parents[3]

# make test sets DSEC_TEST_STRICT=1: a missing runtime or image then fails
# the run instead of skipping it.
STRICT = os.environ.get("DSEC_TEST_STRICT") == "1"


def missing(reason: str) -> None:
    """Skips for want of something on the host; fails when strict."""
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


@pytest.fixture(scope="session", autouse=True)
def gateway(request: pytest.FixtureRequest) -> Iterator[Dict[str, str]]:
    """E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY of a running gateway,
    also set in os.environ for the SDK."""
    if os.environ.get("E2B_API_URL"):
        yield {k: os.environ[k] for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
        return
    if os.geteuid() != 0:
        missing("the gvisor backend needs root")
    dsec = REPO / "bin" / "dsec"
    if not dsec.exists():
        missing("bin/dsec not built (run make build)")
    images = Path(os.environ.get("DSEC_TEST_IMAGE_STORE", REPO / ".cache" / "images"))
    if not (images / "refs" / "root" / "py" / "3.11").exists():
        missing("root/py:3.11 is not built (make images)")
    up = start_up(dsec, images)
    for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        os.environ[k] = up.env[k]
    try:
        yield up.env
    finally:
        up.stop(request.session.testsfailed > 0)


class Up:
    """A dsec up of a test's own: its process, state directory and client.env."""

    def __init__(self, dsec: Path, proc: "subprocess.Popen[bytes]", state: Path, log, env: Dict[str, str]) -> None:  # type: ignore[no-untyped-def]
        self.dsec, self.proc, self.state, self.log, self.env = dsec, proc, state, log, env

    def stop(self, failed: bool) -> None:
        subprocess.run([str(self.dsec), "stop", "--all"], env={**os.environ, **self.env}, capture_output=True)
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()
        # The state holds the node's unpacked image layers (hundreds of MB):
        # removed after a clean run, kept (and named) after a failing one.
        if failed or os.environ.get("DSEC_KEEP_TEST_STATE"):
            print(f"\ndsec state kept in {self.state}")
        else:
            shutil.rmtree(self.state, ignore_errors=True)


def start_up(dsec: Path, images: Path, *extra: str) -> Up:
    """Starts bin/dsec up with the gateway on free loopback ports (and
    extra flags) and waits for its client.env."""
    state = Path(tempfile.mkdtemp(prefix="dsec-e2b-test-"))
    log = open(state / "dsec.log", "w")
    proc = subprocess.Popen(
        [
            str(dsec), "up", "--state-dir", str(state),
            "--listen", f"127.0.0.1:{_free_port()}",
            "--e2b-listen", f"127.0.0.1:{_free_port()}",
            "--image-store", str(images), *extra,
        ],
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
    return Up(dsec, proc, state, log, _read_env(env_file))


@pytest.fixture
def sandbox():
    from e2b import Sandbox

    sb = Sandbox.create(timeout=300)
    yield sb
    try:
        sb.kill()
    except Exception:
        pass


@pytest.fixture
def own_internet(tmp_path: Path) -> Iterator[Dict[str, str]]:
    """A network namespace of the test's own, joined to the node by a veth,
    with a web server: the only host the network tests send traffic to."""
    import secrets

    # The JS suite runs beside this one (make test-sdks) with the same
    # fixture: it takes 10.253.128-254 and the names dsectj*, this one
    # 10.253.1-127 and dsectp*, so the two never meet.
    tag = secrets.token_hex(2)
    ns, veth = f"dsectp-{tag}", f"dsectp{tag}"
    octet = 1 + secrets.randbelow(127)
    node, web = f"10.253.{octet}.1", f"10.253.{octet}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    (tmp_path / "index.html").write_text("hello from the test's own internet\n")
    ip("netns", "add", ns)
    server = None
    try:
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("addr", "add", node + "/24", "dev", veth)
        ip("link", "set", veth, "up")
        ip("-n", ns, "addr", "add", web + "/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "route", "add", "default", "via", node)
        server = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "http.server", "8080", "--bind", web, "--directory", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # Ready when it accepts (from the node, over the test's own veth).
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection((web, 8080), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the test's web server did not start")
                time.sleep(0.05)
        yield {"web": web, "url": f"http://{web}:8080/index.html"}
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
