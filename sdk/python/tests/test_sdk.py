"""The SDK against a real cluster with the container backend."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from opendsec import (
    AuthenticationError,
    DSecClient,
    DSecRunArgs,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)

REPO = Path(__file__).resolve().parents[3]


def test_quickstart_prints_42(dsec_env, py_image):
    """The README's program, unchanged, prints 42."""
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py")],
        env={**os.environ, **dsec_env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "42"


async def test_run_shell_outputs_and_exit_codes(sandbox):
    r = await sandbox.run_shell("echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    r = await sandbox.run_shell("no-such-command-here")
    assert r.exit_code == 127 and "not found" in r.stderr
    r = await sandbox.run(["definitely-missing"])
    assert r.exit_code == 127 and "command not found" in r.stderr
    r = await sandbox.run(["cat"], stdin="piped in")
    assert r.stdout == "piped in"
    r = await sandbox.run_shell("pwd; echo $FOO", cwd="/tmp", env={"FOO": "bar"})
    assert r.stdout == "/tmp\nbar\n"
    r = await sandbox.run_shell("sleep 5", timeout=0.3)
    assert r.timed_out and r.exit_code == 137
    r = await sandbox.run(["yes"], timeout=0.5, max_output_bytes=1000)
    assert len(r.stdout_bytes) == 1000 and r.stdout_dropped > 0


async def test_files(sandbox):
    entry = await sandbox.files.write("/root/dir/a.txt", "hello")
    assert entry.name == "a.txt" and entry.size == 5 and entry.type == "file"
    assert await sandbox.files.read_text("/root/dir/a.txt") == "hello"
    big = os.urandom(20 << 20)  # more than one 8 MiB chunk
    await sandbox.files.write("/root/big.bin", big)
    assert await sandbox.files.read("/root/big.bin") == big
    assert (await sandbox.run_shell("wc -c < /root/big.bin")).stdout.strip() == str(len(big))
    await sandbox.files.make_dir("/root/dir/sub")
    moved = await sandbox.files.rename("/root/dir/a.txt", "/root/dir/sub/b.txt")
    assert moved.path == "/root/dir/sub/b.txt"
    names = sorted(e.path for e in await sandbox.files.list("/root/dir", depth=2))
    assert names == ["/root/dir/sub", "/root/dir/sub/b.txt"]
    with pytest.raises(FailedPreconditionError):
        await sandbox.files.remove("/root/dir")
    await sandbox.files.remove("/root/dir", recursive=True)
    assert not await sandbox.files.exists("/root/dir")
    with pytest.raises(NotFoundError):
        await sandbox.files.read("/root/nope")


async def test_file_metadata(sandbox):
    md = {"author": "mish", "purpose": "upload"}
    assert (await sandbox.files.write("/root/m.txt", "x", metadata=md)).metadata == md
    assert (await sandbox.files.write("/root/m.txt", "y")).metadata == md  # left as it is
    assert [e.metadata for e in await sandbox.files.list("/root") if e.name == "m.txt"] == [md]
    assert (await sandbox.files.write("/root/m.txt", "z", metadata={})).metadata == {}
    with pytest.raises(InvalidArgumentError, match="not printable"):
        await sandbox.files.write("/root/bad.txt", "x", metadata={"k": "line\nbreak"})
    assert not await sandbox.files.exists("/root/bad.txt")


async def test_files_as_a_user_have_its_rights(sandbox):
    # nobody plants a link to /etc/passwd in a directory of its own.
    await sandbox.run_shell("mkdir -p /srv/nb && chown nobody /srv/nb && "
                            "python3 -c 'import os; os.setgroups([]); os.setgid(65534); os.setuid(65534); "
                            "os.symlink(\"/etc/passwd\", \"/srv/nb/evil\")'")
    before = await sandbox.files.read("/etc/passwd")
    with pytest.raises(PermissionDeniedError):
        await sandbox.files.write("/srv/nb/evil", "owned", user="nobody")
    for call in (lambda: sandbox.files.read("/etc/shadow", user="nobody"),
                 lambda: sandbox.files.list("/root", user="nobody"),
                 lambda: sandbox.files.remove("/etc/hostname", user="nobody"),
                 lambda: sandbox.files.rename("/etc/hostname", "/srv/nb/h", user="nobody")):
        with pytest.raises(PermissionDeniedError):
            await call()
    assert await sandbox.files.read("/etc/passwd") == before
    entry = await sandbox.files.write("/srv/nb/mine.txt", "mine", user="nobody")
    assert entry.owner == "nobody"
    assert await sandbox.files.read_text("/srv/nb/mine.txt", user="nobody") == "mine"
    assert [e.name for e in await sandbox.files.list("/srv/nb", user="nobody")] == ["evil", "mine.txt"]


async def test_streaming_exec_stdin_and_kill(sandbox):
    proc = await sandbox.exec("for i in 1 2 3; do echo line $i; sleep 0.1; done")
    chunks = [c.text async for c in proc]
    assert "".join(chunks) == "line 1\nline 2\nline 3\n"
    assert proc.exit_code == 0
    cat = await sandbox.exec(["cat"], stdin=True)
    await cat.send_input("to cat\n")
    await cat.close_stdin()
    res = await cat.wait()
    assert res.stdout == "to cat\n" and res.exit_code == 0
    sleeper = await sandbox.exec(["sleep", "60"], tag="sleeper")
    listed = {p.pid: p for p in await sandbox.list_processes()}
    assert listed[sleeper.pid].managed and listed[sleeper.pid].tag == "sleeper"
    await sleeper.kill()
    res = await sleeper.wait()
    assert res.exit_code == 137


async def test_pty(sandbox):
    term = await sandbox.pty("/bin/sh", cols=100, rows=30)
    await term.resize(120, 40)
    await term.send_input("stty size; exit 4\n")
    out = b""
    async for chunk in term:
        assert chunk.stream == "pty"
        out += chunk.data
    assert b"40 120" in out and term.exit_code == 4


async def test_session_keeps_state(sandbox):
    s = await sandbox.session(cwd="/tmp")
    await s.run("cd / && export GREETING=hello && alias ll='ls -l' 2>/dev/null; sleep 30 &")
    r = await s.run("echo $GREETING; pwd; jobs | wc -l")
    assert r.stdout.split() == ["hello", "/", "1"]
    assert r.cwd == "/"
    r = await s.run("sleep 10", timeout=0.3)
    assert r.timed_out
    r = await s.run("echo $GREETING")
    assert r.stdout == "hello\n"
    data, nxt, first = await s.output()
    assert b"$ echo $GREETING\nhello\n" in data and nxt > 0 and first == 0
    await s.close()


# A loop that counts its rounds and keeps the longest gap between two, in
# centiseconds of /proc/uptime: frozen for D, it shows a gap of at least D
# once it runs again; left running, gaps of a few tens of milliseconds.
PAUSE_PROBE = r"""(cs() { read up _ < /proc/uptime; echo $(( ${up%.*} * 100 + 1${up#*.} - 100 )); }
prev=$(cs); max=0; n=0
while :; do now=$(cs); g=$((now-prev)); [ $g -gt $max ] && max=$g
n=$((n+1)); echo "$n $max" > /tmp/probe.tmp; mv /tmp/probe.tmp /tmp/probe; prev=$now; sleep 0.02; done) >/dev/null 2>&1 &"""


async def _probe(sandbox, min_rounds):
    for _ in range(1500):
        out = (await sandbox.run_shell("cat /tmp/probe 2>/dev/null || true")).stdout.split()
        if len(out) == 2 and int(out[0]) >= min_rounds:
            return int(out[0]), int(out[1]) / 100
        await asyncio.sleep(0.02)
    raise AssertionError(f"pause probe did not reach {min_rounds} rounds")


async def test_pause_freezes_and_any_call_resumes(sandbox):
    await sandbox.run_shell("echo kept > /tmp/p; " + PAUSE_PROBE)
    rounds, _ = await _probe(sandbox, 3)
    await sandbox.pause()
    assert (await sandbox.refresh()).state == "paused"
    await asyncio.sleep(1.5)
    # Any call resumes it first; the processes carry on, and the time they
    # were frozen shows as a gap in the probe's loop.
    r = await sandbox.run_shell("cat /tmp/p")
    assert r.stdout == "kept\n"
    assert (await sandbox.refresh()).state == "running"
    # The round after the one read now spans the pause.
    now, _ = await _probe(sandbox, rounds)
    _, gap = await _probe(sandbox, now + 1)
    assert gap >= 1.2, f"processes ran while paused: longest gap {gap}s over a 1.5 s pause"


async def test_explicit_resume_keeps_it_paused_until_resume(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox:latest", cpu_cores_limit=0.2, memory_limit_mb=64, explicit_resume=True))
    try:
        assert sb.info.explicit_resume
        await sb.run_shell("echo kept > /tmp/p")
        await sb.pause()
        with pytest.raises(FailedPreconditionError) as e:
            await sb.run_shell("cat /tmp/p")
        assert "explicit_resume" in str(e.value)
        assert (await sb.refresh()).state == "paused"
        await sb.resume()
        assert (await sb.run_shell("cat /tmp/p")).stdout == "kept\n"
    finally:
        await sb.stop()


async def test_bad_input_is_clear(client, dsec_env):
    with pytest.raises(InvalidArgumentError) as e:
        await client.run_sandbox(DSecRunArgs(backend="firecracker", image="root/busybox:latest"))
    assert "backend" in e.value.message and "container" in e.value.message
    with pytest.raises(InvalidArgumentError) as e:
        await client.run_sandbox(DSecRunArgs(image="not a valid name"))
    assert "image" in e.value.message
    with pytest.raises(NotFoundError):
        await client.run_sandbox(DSecRunArgs(image="root/does-not-exist:1"))
    with pytest.raises(InvalidArgumentError) as e:
        await client.run_sandbox(DSecRunArgs(image="root/busybox:latest", memory_limit_mb=10 << 20))
    assert "resources.memory_mb" in e.value.message
    async with DSecClient(dsec_env["DSEC_API_URL"], "dsec_wrong") as bad:
        with pytest.raises(AuthenticationError):
            await bad.list_sandboxes()
    with pytest.raises(NotFoundError):
        await (await client.get_sandbox("aaaaaaaa-aaaaaaaaaaaaaaaa")).stop()


async def test_many_at_once(client):
    sbs = await asyncio.gather(*(client.run_sandbox(DSecRunArgs(image="root/busybox:latest", cpu_cores_limit=0.2, memory_limit_mb=64)) for _ in range(4)))
    outs = await asyncio.gather(*(sb.run_shell("hostname") for sb in sbs))
    assert [o.stdout.strip() for o in outs] == [sb.id for sb in sbs]
    listed = {s.id for s in await client.list_sandboxes()}
    assert {sb.id for sb in sbs} <= listed
    await asyncio.gather(*(sb.stop() for sb in sbs))


async def test_disk_limit(client, py_image):
    sb = await client.run_sandbox(DSecRunArgs(backend="container", image=py_image, disk_limit_mb=64))
    try:
        size = int((await sb.run_shell("df -m / | tail -1 | awk '{print $2}'")).stdout)
        assert 56 <= size <= 64, size
        r = await sb.run_shell("dd if=/dev/zero of=/root/fill bs=1M count=100 2>&1")
        assert "No space left on device" in r.stdout, r.stdout
    finally:
        await sb.stop()


async def test_projects_quotas_and_nodes(client):
    """Projects and quotas from the SDK, usage against quota, and the nodes."""
    from opendsec.errors import InvalidArgumentError as BadArg

    name = f"root/sdk-{uuid.uuid4().hex[:8]}"
    p = await client.create_project(name, max_sandboxes=3, cpu_cores=2)
    assert (p.path, p.max_sandboxes, p.cpu_cores, p.used_sandboxes) == (name, 3, 2.0, 0)
    p = await client.set_quota(name, max_sandboxes=5, storage_mb=64)
    assert p.max_sandboxes == 5 and p.cpu_cores == 0 and p.storage_mb == 64
    assert name in [q.path for q in await client.list_projects()]
    root = [q for q in await client.list_projects("root") if q.path == "root"][0]
    assert root.used_sandboxes >= 0
    assert root.used_storage_mb >= 1  # the images the suite imported
    with pytest.raises(BadArg):
        await client.create_project("nameonly")
    await client.delete_project(name)
    assert name not in [q.path for q in await client.list_projects()]
    nodes = await client.list_nodes()
    assert nodes and all(n.healthy for n in nodes)
    assert any(why == "" for n in nodes for why in n.backends.values())
    assert nodes[0].capacity_sandboxes > 0


async def test_a_process_killed_at_its_memory_limit_is_reported(client):
    # The kernel's OOM killer ends the hog; the sandbox lives on and counts it.
    sb = await client.run_sandbox(DSecRunArgs(image="root/busybox:latest", cpu_cores_limit=0.5, memory_limit_mb=64))
    try:
        res = await sb.run_shell("awk 'BEGIN { s = \"x\"; while (1) s = s s }'")
        assert res.exit_code == 137
        assert (await sb.run_shell("echo alive")).stdout == "alive\n"
        for _ in range(75):  # the node's count reaches the edge at its 5 s sample
            info = await sb.refresh()
            if info.oom_kills:
                break
            await asyncio.sleep(0.2)
        assert info.oom_kills >= 1 and info.forks_refused == 0 and info.state == "running"
    finally:
        await sb.stop()
