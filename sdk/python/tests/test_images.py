"""Images from and to a real registry (Debian's docker-registry on loopback),
through the async client and the sync one (the ``client`` fixture)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from opendsec import DSecClient, DSecRunArgs, InvalidArgumentError, NotFoundError

from conftest import _free_port, missing


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    binary = shutil.which("docker-registry")
    if not binary:
        missing("docker-registry not installed (Debian package docker-registry)")
    d = Path(tempfile.mkdtemp(prefix="dsec-sdk-registry-"))
    host = f"127.0.0.1:{_free_port()}"
    (d / "config.yml").write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {d / 'data'}\nhttp:\n  addr: {host}\n")
    log = open(d / "registry.log", "w")
    proc = subprocess.Popen([binary, "serve", str(d / "config.yml")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://{host}/v2/", timeout=2).close()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("docker-registry did not start: " + (d / "registry.log").read_text())
            time.sleep(0.05)
    yield host
    proc.kill()
    proc.wait()
    log.close()
    shutil.rmtree(d, ignore_errors=True)


async def test_push_pull_run(client: DSecClient, registry: str) -> None:
    stages = []
    pushed = await client.push_image("root/busybox:latest", f"{registry}/sdk/busybox:1")
    pulled = await client.pull_image(f"{registry}/sdk/busybox:1", "root/sdk-pulled:1", progress=lambda s, d, t: stages.append((s, d, t)))
    try:
        assert pulled.digest == pushed and pulled.name == "root/sdk-pulled:1" and pulled.layers >= 1
        assert "root/sdk-pulled:1" in [i.name for i in await client.list_images("root")]
        sb = await client.run_sandbox(DSecRunArgs(image="root/sdk-pulled:1", backend="container"))
        try:
            assert (await sb.run_shell("echo pulled")).stdout == "pulled\n"
        finally:
            await sb.stop()
    finally:
        await client.delete_image("root/sdk-pulled:1")


async def test_pull_errors(client: DSecClient, registry: str) -> None:
    with pytest.raises(InvalidArgumentError, match="registry reference"):
        await client.pull_image("Not A Reference")
    with pytest.raises(NotFoundError, match=registry):
        await client.pull_image(f"{registry}/sdk/none:1", "root/none:1")
    with pytest.raises(InvalidArgumentError, match="together"):
        await client.pull_image(f"{registry}/sdk/busybox:1", username="u")



async def test_pack_diff(client: DSecClient) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox:latest", backend="container"))
    try:
        await sb.run_shell("echo kept > /kept && echo scratch > /scratch.tmp && rm /etc/group")
        im = await sb.pack_diff("root/sdk-committed:1", exclude=["*.tmp"])
        assert im.name == "root/sdk-committed:1" and im.layers == 2
    finally:
        await sb.stop()
    try:
        sb2 = await client.run_sandbox(DSecRunArgs(image="root/sdk-committed:1", backend="container"))
        try:
            r = await sb2.run_shell("cat /kept; ls /scratch.tmp /etc/group 2>&1 | wc -l")
            assert r.stdout == "kept\n2\n"
            with pytest.raises(InvalidArgumentError, match="exclude pattern"):
                await sb2.pack_diff("root/sdk-committed:2", exclude=["a/["])
        finally:
            await sb2.stop()
    finally:
        await client.delete_image("root/sdk-committed:1")
