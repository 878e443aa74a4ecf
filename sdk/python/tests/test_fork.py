"""Fork with memory through the SDK, on the real gvisor backend."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opendsec import DSecRunArgs, Session, UnsupportedError

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed")

SERVER = """
import http.server, json, os, random
import decimal, statistics  # imported once, before the fork
value = random.getrandbits(32)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global value
        if self.path.startswith("/set/"):
            value = int(self.path[5:])
        self.send_response(200); self.end_headers()
        self.wfile.write(json.dumps({"value": value, "pid": os.getpid()}).encode())
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


def test_fork_seed_program(dsec_env, py_image):
    """The issue's program, with backend="gvisor", runs unchanged."""
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "fork.py")],
        env={**os.environ, **dsec_env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "42"


async def _get(sb, path="/"):
    r = await sb.run_shell(f"curl -s --max-time 5 http://127.0.0.1:8000{path}")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


async def test_fork_keeps_memory_ports_and_sessions(client, py_image):
    sb = await client.run_sandbox(DSecRunArgs(backend="gvisor", image="root/py:3.11", memory_limit_mb=1024))
    try:
        await sb.files.write("/root/server.py", SERVER)
        await sb.exec(["python3", "/root/server.py"], tag="server")
        assert (await sb.run_shell("for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:8000/ && exit 0; sleep 0.1; done; exit 1")).ok
        shell = await sb.session()
        await shell.run("cd /tmp && KEPT=$((RANDOM * 7))")
        kept = (await shell.run("echo $KEPT")).stdout
        before = await _get(sb)

        forks = await sb.fork(count=2)
        assert len(forks) == 2 and len({f.id for f in forks} | {sb.id}) == 3
        for s in [sb, *forks]:
            assert await _get(s) == before  # same process, same value, port open
            same_shell = Session(s, {"id": shell.id})  # the session survives in every copy
            assert (await same_shell.run("echo $KEPT; pwd")).stdout == kept + "/tmp\n"
            assert (await s.run_shell("hostname")).stdout.strip() == s.id
        await _get(forks[0], "/set/5")
        assert (await _get(forks[0]))["value"] == 5
        assert (await _get(forks[1]))["value"] == before["value"]
        assert (await _get(sb))["value"] == before["value"]
        await forks[1].files.write("/root/only-here", "x")
        assert not await forks[0].files.exists("/root/only-here")
        assert not await sb.files.exists("/root/only-here")
        await asyncio.gather(*(f.stop() for f in forks))
    finally:
        await sb.stop()


async def test_snapshot_restore_list_delete(client):
    sb = await client.run_sandbox(DSecRunArgs(backend="gvisor", image="root/busybox:latest"))
    try:
        await sb.run_shell("echo saved > /root/f")
        snap = await sb.snapshot()
        assert snap.source_sandbox_id == sb.id and snap.size_bytes > 0
        assert snap.id in {s.id for s in await client.list_snapshots()}
        restored = await client.restore(snap)
        try:
            assert (await restored.run_shell("cat /root/f")).stdout == "saved\n"
            assert restored.info.source_snapshot_id == snap.id
        finally:
            await restored.stop()
        await client.delete_snapshot(snap)
        assert snap.id not in {s.id for s in await client.list_snapshots()}
    finally:
        await sb.stop()


async def test_container_backend_says_why_it_cannot_fork(sandbox):
    with pytest.raises(UnsupportedError) as e:
        await sandbox.fork(count=1)
    assert "container" in e.value.message and "snapshot" in e.value.message
