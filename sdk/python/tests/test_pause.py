"""Pausing a whole task (the preemption flow) through the SDK, on the real
gvisor and container backends."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from opendsec import DSecRunArgs, Session

pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc is not installed")

SERVER = """
import http.server, json, random
import decimal, statistics  # imported before the pause
secret = random.getrandbits(64)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        self.wfile.write(json.dumps({"secret": secret}).encode())
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


async def _secret(sb):
    r = await sb.run_shell("for i in $(seq 100); do curl -s --max-time 5 http://127.0.0.1:8000/ && exit 0; sleep 0.1; done; exit 1")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)["secret"]


async def test_pause_task_offload_then_calls_resume(client, py_image):
    """The README's preemption flow: a task's sandboxes are offloaded in one
    call; a call to each brings it back, with its Python process's memory,
    its listening port, its shell session and its files."""
    task = "sdk-preempt"
    sbs = await asyncio.gather(
        *(client.run_sandbox(DSecRunArgs(backend=b, image="root/py:3.11", task=task, memory_limit_mb=512)) for b in ["gvisor", "gvisor", "container"])
    )
    try:
        before = {}
        shells = {}
        for sb in sbs:
            await sb.files.write("/root/server.py", SERVER)
            await sb.exec(["python3", "/root/server.py"], tag="server")
            before[sb.id] = await _secret(sb)
            shell = await sb.session()
            await shell.run("KEPT=$RANDOM$RANDOM")
            shells[sb.id] = (shell.id, (await shell.run("echo $KEPT")).stdout)
            await sb.files.write("/root/note", sb.id)

        result = await client.pause_task(task, depth="offload")
        assert not result.failed, result.failed
        assert {r.sandbox_id for r in result.results} == {sb.id for sb in sbs}
        by_id = {r.sandbox_id: r for r in result.results}
        for sb in sbs:
            r = by_id[sb.id]
            assert r.info.state == "paused"
            if sb.info.backend == "gvisor":
                assert r.info.pause_depth == "offload" and r.memory_released_bytes > (8 << 20), r
            else:
                assert r.info.pause_depth == "freeze" and "memory stays allocated" in r.note, r
        assert result.memory_released_bytes == sum(r.memory_released_bytes for r in result.results)
        listed = await client.list_sandboxes(task=task)
        assert {s.state for s in listed} == {"paused"}

        for sb in sbs:  # no resume call: each call resumes its sandbox
            assert await _secret(sb) == before[sb.id]
            sid, kept = shells[sb.id]
            assert (await Session(sb, {"id": sid}).run("echo $KEPT")).stdout == kept
            assert await sb.files.read_text("/root/note") == sb.id
        listed = await client.list_sandboxes(task=task)
        assert {s.state for s in listed} == {"running"}

        # Frozen, then resumed for the whole task at once.
        result = await client.pause_task(task)
        assert not result.failed and len(result.results) == len(sbs)
        result = await client.resume_task(task)
        assert not result.failed and {r.info.state for r in result.results} == {"running"}
    finally:
        await asyncio.gather(*(sb.stop() for sb in sbs))


async def test_pause_task_names_what_it_needs(client):
    from opendsec import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as e:
        await client.pause_task("")
    assert "task" in e.value.message
    with pytest.raises(ValueError):
        await client.pause_task("t", depth="deep")
    empty = await client.pause_task("no-such-task")
    assert empty.results == [] and empty.memory_released_bytes == 0
