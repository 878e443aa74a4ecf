"""E2B's Python SDK (pinned in requirements.txt), unchanged, against the
gateway: every call here is what an E2B user writes."""

from __future__ import annotations

import datetime
import json
import os
import time
import uuid

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

# A Python server that keeps a random value and a hit counter in memory:
# pausing, resuming and forking must carry both, and the process.
HELD_STATE = r"""
import http.server, json, os, random
value = random.getrandbits(48)
hits = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global hits, value
        hits += 1
        if self.path.startswith("/set/"):
            value = int(self.path[5:])
        body = json.dumps({"value": value, "hits": hits, "pid": os.getpid()}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


def start_server(sb: Sandbox) -> None:
    sb.files.write("server.py", HELD_STATE)
    sb.commands.run("python3 server.py", background=True)
    for _ in range(100):
        if sb.commands.run("curl -s 127.0.0.1:8000/ >/dev/null && echo up || true").stdout.strip() == "up":
            return
        time.sleep(0.1)
    raise AssertionError("server did not come up")


def query(sb: Sandbox, path: str = "/") -> dict:
    return json.loads(sb.commands.run(f"curl -s 127.0.0.1:8000{path}").stdout)


def test_commands_output_exit_code_env_and_cwd(sandbox: Sandbox):
    r = sandbox.commands.run("echo out; echo err >&2; whoami; pwd")
    assert r.stdout == "out\nuser\n/home/user\n"
    assert r.stderr == "err\n"
    assert r.exit_code == 0

    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo before; exit 7")
    assert e.value.exit_code == 7
    assert e.value.stdout == "before\n"

    r = sandbox.commands.run("echo $GREETING from $(pwd)", envs={"GREETING": "hello"}, cwd="/tmp")
    assert r.stdout == "hello from /tmp\n"
    assert sandbox.commands.run("whoami", user="root").stdout == "root\n"

    # The "base" template: passwordless sudo, python (as python3 too), git, curl.
    r = sandbox.commands.run("sudo -n whoami; python3 -c 'print(6*7)'; python -c 'print(7*6)'; git --version >/dev/null && curl --version >/dev/null && echo tools")
    assert r.stdout == "root\n42\n42\ntools\n"


def test_large_and_endless_output(sandbox: Sandbox):
    # Output is streamed, not capped on the way (as with envd): 20 MB
    # arrives whole.
    r = sandbox.commands.run("head -c 20000000 /dev/zero | tr '\\0' x")
    assert len(r.stdout) == 20_000_000 and set(r.stdout) == {"x"}
    # Endless output ends at the command's timeout, and the command with it.
    seen = 0

    def on_stdout(chunk: str) -> None:
        nonlocal seen
        seen += len(chunk)

    with pytest.raises(TimeoutException):
        sandbox.commands.run("while :; do echo endless-line; done", timeout=2, on_stdout=on_stdout)
    assert seen > 0
    for _ in range(50):
        if "endless-line" not in sandbox.commands.run("ps -eo args").stdout:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the endless command outlived its timeout")


def test_metrics(sandbox: Sandbox):
    # Issue 13 item 6: samples by time range, recorded every 5 s from the
    # sandbox's start; none for a range before it existed.
    sandbox.commands.run("python3 -c 'x = bytearray(64 << 20); import time; time.sleep(6)'")
    m = sandbox.get_metrics()
    assert len(m) >= 2, m
    assert all(a.timestamp < b.timestamp for a, b in zip(m, m[1:])), m
    assert all(s.cpu_count >= 1 and 0 < s.mem_used <= s.mem_total and s.disk_used <= s.disk_total for s in m), m
    info = sandbox.get_info()
    assert m[0].timestamp >= info.started_at.replace(microsecond=0), (m[0], info.started_at)
    before = sandbox.get_metrics(start=info.started_at - datetime.timedelta(hours=1), end=info.started_at - datetime.timedelta(minutes=1))
    assert before == []
    # The API takes whole seconds.
    lo, hi = m[-1].timestamp.replace(microsecond=0), m[-1].timestamp.replace(microsecond=0) + datetime.timedelta(seconds=1)
    last = sandbox.get_metrics(start=lo, end=hi)
    assert m[-1].timestamp in [s.timestamp for s in last] and all(lo <= s.timestamp <= hi for s in last), (last, lo, hi)
    assert len(last) < len(m)


def test_create_env_vars_and_metadata_listing():
    tag = uuid.uuid4().hex
    sb = Sandbox.create(envs={"FROM_CREATE": "yes"}, metadata={"suite": tag}, timeout=120)
    try:
        assert sb.commands.run("echo $FROM_CREATE").stdout == "yes\n"
        info = sb.get_info()
        assert info.sandbox_id == sb.sandbox_id
        assert info.template_id == "base"
        assert info.metadata == {"suite": tag}
        assert info.state == SandboxState.RUNNING
        assert info.end_at > info.started_at

        found = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        assert [s.sandbox_id for s in found] == [sb.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other-" + tag})).next_items() == []
        assert sb.is_running()
    finally:
        sb.kill()
    assert not sb.is_running()
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items() == []
    with pytest.raises(NotFoundException):
        Sandbox.connect(sb.sandbox_id)


def test_background_command_streams_output_takes_stdin_and_is_killed(sandbox: Sandbox):
    h = sandbox.commands.run("echo ready; read line; echo got $line; cat", background=True, stdin=True, timeout=30)
    assert h.pid in [p.pid for p in sandbox.commands.list()]

    # Output streams while the command runs: the answer to "ready" is what
    # lets the command go on (it would block forever otherwise).
    seen = []

    def on_stdout(chunk: str) -> None:
        seen.append(chunk)
        if "ready" in chunk:
            sandbox.commands.send_stdin(h.pid, "one\n")
        if "got one" in chunk:
            sandbox.commands.send_stdin(h.pid, "two\n")
            sandbox.commands.close_stdin(h.pid)

    r = h.wait(on_stdout=on_stdout)
    assert r.stdout == "ready\ngot one\ntwo\n"
    assert "".join(seen) == r.stdout

    h = sandbox.commands.run("sleep 600", background=True)
    assert sandbox.commands.kill(h.pid)
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code != 0
    assert h.pid not in [p.pid for p in sandbox.commands.list()]

    # A command's timeout ends the command, not only the call, as on E2B.
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30 && echo late", timeout=1)
    for _ in range(50):
        if "sleep 30" not in sandbox.commands.run("ps -eo args").stdout:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the timed-out command is still running")


def test_connect_to_a_running_command(sandbox: Sandbox):
    h = sandbox.commands.run("sleep 0.5; echo done", background=True)
    again = sandbox.commands.connect(h.pid)
    assert again.wait().stdout.endswith("done\n")


def test_file_metadata(sandbox: Sandbox):
    # Issue 23 item 8: X-Metadata-* uploads become user.e2b.* attributes,
    # shown by get_info, list and rename; an overwrite replaces them; set
    # inside the sandbox, they show too.
    md = {"author": "mish", "purpose": "upload"}
    assert sandbox.files.write("meta/a.txt", "x", metadata=md).metadata == md
    assert sandbox.files.get_info("meta/a.txt").metadata == md
    assert sandbox.files.write("meta/b.txt", "x", metadata=md, use_octet_stream=True).metadata == md
    infos = sandbox.files.write_files([{"path": "meta/c.txt", "data": "1"}, {"path": "meta/d.txt", "data": "2"}], metadata={"source": "suite"})
    assert [i.metadata for i in infos] == [{"source": "suite"}] * 2
    listed = {e.name: e.metadata for e in sandbox.files.list("meta")}
    assert listed == {"a.txt": md, "b.txt": md, "c.txt": {"source": "suite"}, "d.txt": {"source": "suite"}}, listed
    assert sandbox.files.rename("meta/a.txt", "meta/e.txt").metadata == md
    assert sandbox.files.write("meta/e.txt", "again").metadata is None
    assert sandbox.files.get_info("meta/e.txt").metadata is None
    assert sandbox.files.write("meta/plain.txt", "x").metadata is None
    path = sandbox.commands.run("realpath meta/plain.txt").stdout.strip()
    sandbox.commands.run(f"python3 -c \"import os; os.setxattr('{path}', 'user.e2b.author', b'mish')\"")
    assert sandbox.files.get_info("meta/plain.txt").metadata == {"author": "mish"}
    with pytest.raises(InvalidArgumentException):
        sandbox.files.write("meta/bad.txt", "x", metadata={"good": "bad\nvalue"})
    assert not sandbox.files.exists("meta/bad.txt")


def test_files(sandbox: Sandbox):
    info = sandbox.files.write("notes/a.txt", "first")
    assert info.path == "/home/user/notes/a.txt"
    assert sandbox.files.read("notes/a.txt") == "first"
    assert sandbox.files.get_info("notes/a.txt").owner == "user"

    payload = os.urandom(1 << 20)
    sandbox.files.write("/tmp/blob.bin", payload)
    assert bytes(sandbox.files.read("/tmp/blob.bin", format="bytes")) == payload
    assert sandbox.commands.run("sha256sum /tmp/blob.bin | cut -d' ' -f1").stdout.strip() == __import__("hashlib").sha256(payload).hexdigest()

    infos = sandbox.files.write_files([{"path": "multi/x", "data": "X"}, {"path": "multi/y", "data": b"Y"}])
    assert sorted(i.path for i in infos) == ["/home/user/multi/x", "/home/user/multi/y"]

    names = {e.name: e for e in sandbox.files.list("multi")}
    assert set(names) == {"x", "y"}
    assert names["x"].type == FileType.FILE and names["x"].size == 1

    assert sandbox.files.exists("multi/x")
    assert not sandbox.files.exists("multi/nope")
    assert sandbox.files.make_dir("made/deep")
    assert not sandbox.files.make_dir("made/deep")
    assert sandbox.files.get_info("made/deep").type == FileType.DIR

    moved = sandbox.files.rename("multi/x", "multi/z")
    assert moved.path == "/home/user/multi/z"
    assert sandbox.files.read("multi/z") == "X"
    sandbox.files.remove("multi")
    assert not sandbox.files.exists("multi/z")

    with pytest.raises(NotFoundException):
        sandbox.files.read("no/such/file")


def test_watch_dir(sandbox: Sandbox):
    sandbox.files.make_dir("watched")
    w = sandbox.files.watch_dir("watched")
    sandbox.files.write("watched/new.txt", "x")
    sandbox.commands.run("rm watched/new.txt")
    events = []
    for _ in range(50):
        events += w.get_new_events()
        if any(e.type == FilesystemEventType.REMOVE for e in events):
            break
        time.sleep(0.1)
    w.stop()
    # An upload is written in place, as envd does: create and write events
    # on the file's own name, no temporary names.
    assert {e.name for e in events} == {"new.txt"}, events
    assert any(e.type == FilesystemEventType.CREATE for e in events)
    assert any(e.type == FilesystemEventType.WRITE for e in events)
    assert any(e.type == FilesystemEventType.REMOVE for e in events)


def test_polling_watcher_sees_each_write_once_as_it_returns(sandbox: Sandbox):
    # Issue 13 item 7: a polling (sync) watcher saw only CREATE right after
    # a write returned, and an overwrite gave two WRITEs. An upload gives
    # the events envd's does (it chowns the file to the writer): CREATE,
    # CHMOD, WRITE for a new file (E2B's test_watch_iterated counts three),
    # CHMOD and one WRITE for an overwrite.
    sandbox.files.make_dir("polled")
    w = sandbox.files.watch_dir("polled")
    sandbox.files.write("polled/a.txt", "first")
    got = [(e.name, e.type) for e in w.get_new_events()]
    assert got == [("a.txt", FilesystemEventType.CREATE), ("a.txt", FilesystemEventType.CHMOD), ("a.txt", FilesystemEventType.WRITE)], got
    sandbox.files.write("polled/a.txt", "second, longer")
    got = [(e.name, e.type) for e in w.get_new_events()]
    assert got == [("a.txt", FilesystemEventType.CHMOD), ("a.txt", FilesystemEventType.WRITE)], got
    # A command's writes are there once it has returned.
    sandbox.commands.run("echo x >> polled/b.txt")
    assert [(e.name, e.type) for e in w.get_new_events()] == [("b.txt", FilesystemEventType.CREATE), ("b.txt", FilesystemEventType.WRITE)]
    w.stop()


def test_watch_with_entry_info(sandbox: Sandbox):
    # Issue 13 item 11: include_entry was refused (the SDK needs envd 0.6.3).
    sandbox.files.make_dir("entries")
    # allow_network_mounts (envd 0.6.4) is taken: the agent watches any
    # directory (E2B's test_watch_directory_changes_with_network_mounts_allowed).
    w = sandbox.files.watch_dir("entries", include_entry=True, allow_network_mounts=True)
    sandbox.files.write("entries/f.txt", "12345")
    sandbox.files.remove("entries/f.txt")
    events = w.get_new_events()
    w.stop()
    writes = [e for e in events if e.type == FilesystemEventType.WRITE]
    assert writes and writes[0].entry is not None, events
    assert writes[0].entry.name == "f.txt" and writes[0].entry.path == "/home/user/entries/f.txt"
    assert writes[0].entry.type == FileType.FILE
    removes = [e for e in events if e.type == FilesystemEventType.REMOVE]
    assert removes and removes[0].entry is None, events


def test_pty(sandbox: Sandbox):
    out = []
    t = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.send_stdin(t.pid, b"stty size; echo pty-$((6*7)); exit\n")
    t.wait(on_pty=out.append)
    assert b"24 80" in b"".join(out) and b"pty-42" in b"".join(out)

    out = []
    t = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.resize(t.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(t.pid, b"stty size; exit 3\n")
    with pytest.raises(CommandExitException):
        t.wait(on_pty=out.append)
    assert b"30 100" in b"".join(out)


def test_timeout_pause_and_connect_keep_processes_and_memory(sandbox: Sandbox):
    # The fixture made it with 300 s: the new end is now + 200 s, not the old one.
    asked = time.time()
    sandbox.set_timeout(200)
    end = sandbox.get_info().end_at.timestamp()
    assert asked + 195 <= end <= time.time() + 201, (end - asked)

    start_server(sandbox)
    before = query(sandbox, "/set/4242")
    assert sandbox.pause()
    assert sandbox.get_info().state == SandboxState.PAUSED
    # Probing a paused sandbox says so and does not wake it.
    assert not sandbox.is_running()
    assert sandbox.get_info().state == SandboxState.PAUSED
    assert [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()] == [sandbox.sandbox_id]

    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.get_info().state == SandboxState.RUNNING
    # The first handle still works: its envd access token outlived the pause.
    after = query(sandbox)
    assert after["value"] == 4242 and after["pid"] == before["pid"] and after["hits"] == before["hits"] + 1


def test_fork_copies_memory_and_copies_are_independent(sandbox: Sandbox):
    start_server(sandbox)
    src = query(sandbox, "/set/777")
    forks = sandbox.fork(count=2, timeout=120)
    try:
        assert all(isinstance(f, Sandbox) for f in forks), forks
        ids = {f.sandbox_id for f in forks}
        assert len(ids) == 2 and sandbox.sandbox_id not in ids
        for f in forks:
            st = query(f)
            assert st["value"] == 777 and st["hits"] == src["hits"] + 1
        query(forks[0], "/set/1")
        assert query(forks[1])["value"] == 777
        assert query(sandbox)["value"] == 777
        # Files are copied too and diverge.
        forks[0].files.write("only-in-fork", "0")
        assert not forks[1].files.exists("only-in-fork")
        assert not sandbox.files.exists("only-in-fork")
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()


def test_snapshot_then_create_from_it(sandbox: Sandbox):
    sandbox.files.write("kept.txt", "from the snapshot")
    snap = sandbox.create_snapshot()
    assert snap.snapshot_id.startswith("snap-")
    copy = Sandbox.create(snap.snapshot_id, timeout=60)
    try:
        assert copy.files.read("kept.txt") == "from the snapshot"
    finally:
        copy.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)


def test_bad_key_and_bad_access_token_are_refused(gateway, sandbox: Sandbox):
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_" + "0" * 40)
    r = httpx.get(
        gateway["E2B_SANDBOX_URL"] + "/files",
        params={"path": "/etc/hostname"},
        headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": "wrong"},
    )
    assert r.status_code == 401
    assert "X-Access-Token" in r.json()["message"]


def test_auto_pause_on_timeout_then_connect_keeps_memory():
    """E2B's lifecycle on_timeout "pause" (autoPause): when the timeout
    passes the sandbox is paused, not killed; connect resumes it with its
    process and memory."""
    sb = Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": True}, timeout=10)
    try:
        info = sb.get_info()
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}, info.lifecycle
        start_server(sb)
        before = query(sb, "/set/31337")
        deadline = time.time() + 60
        while sb.get_info().state != SandboxState.PAUSED:
            assert time.time() < deadline, "not paused a minute after its timeout"
            time.sleep(0.5)
        assert not sb.is_running()
        back = Sandbox.connect(sb.sandbox_id, timeout=120)
        assert back.get_info().state == SandboxState.RUNNING
        after = query(back)
        assert after["value"] == 31337 and after["pid"] == before["pid"]
    finally:
        sb.kill()
    killed = Sandbox.create(timeout=60)
    try:
        assert killed.get_info().lifecycle == {"on_timeout": "kill", "auto_resume": False}
    finally:
        killed.kill()


def test_auto_pause_without_auto_resume_requires_connect():
    """E2B's lifecycle auto_resume False: once paused, no call wakes the
    sandbox (is_running stays false, a command is refused); connect does."""
    sb = Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": False}, timeout=3)
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        sb.files.write("kept.txt", "before the pause")
        deadline = time.time() + 60
        while sb.get_info().state != SandboxState.PAUSED:
            assert time.time() < deadline, "not paused a minute after its timeout"
            time.sleep(0.5)
        assert not sb.is_running()
        with pytest.raises(Exception) as e:
            sb.commands.run("true", request_timeout=30)
        assert "paused" in str(e.value), e.value
        assert sb.get_info().state == SandboxState.PAUSED
        back = Sandbox.connect(sb.sandbox_id, timeout=120)
        assert back.get_info().state == SandboxState.RUNNING and back.is_running()
        assert back.files.read("kept.txt") == "before the pause"
    finally:
        sb.kill()


def test_create_as_older_sdks_send_it(gateway):
    """e2b 2.39 (what the Code Interpreter SDKs' lockfiles pin) sends
    autoResume {enabled: false} on every create, with autoPause false."""
    url, key = gateway["E2B_API_URL"], gateway["E2B_API_KEY"]
    for body in (
        {"templateID": "base", "timeout": 60, "autoPause": False, "autoResume": {"enabled": False}},
        {"templateID": "base", "timeout": 60, "autoPause": False, "autoResume": {"policy": "off"}},
    ):
        r = httpx.post(url + "/sandboxes", json=body, headers={"X-API-Key": key}, timeout=60)
        assert r.status_code == 201, (body, r.status_code, r.text)
        Sandbox.kill(r.json()["sandboxID"])
    r = httpx.post(url + "/sandboxes", json={"templateID": "base", "autoResume": {"policy": "sometimes"}}, headers={"X-API-Key": key}, timeout=60)
    assert r.status_code == 400 and "autoResume.policy" in r.json()["message"], r.text


def test_idempotent_create(gateway):
    key = uuid.uuid4().hex
    first = Sandbox.create(idempotency_key=key, timeout=60)
    try:
        again = Sandbox.create(idempotency_key=key, timeout=60)
        assert again.sandbox_id == first.sandbox_id
    finally:
        first.kill()


def test_network_allowed_host_and_get_host(own_internet):
    """allow_internet_access with allow_out reaches the allowed host; a
    server in the sandbox answers through get_host(port)."""
    sb = Sandbox.create(timeout=300, allow_internet_access=True, network={"allow_out": [own_internet["web"]]})
    try:
        r = sb.commands.run(f"curl -s --max-time 5 {own_internet['url']}")
        assert r.stdout == "hello from the test's own internet\n"
        sb.commands.run("python3 -m http.server 8000 --bind 0.0.0.0", background=True)
        for _ in range(100):
            if sb.commands.run("curl -s 127.0.0.1:8000/ >/dev/null && echo up || true").stdout.strip() == "up":
                break
            time.sleep(0.1)
        host = sb.get_host(8000)
        assert host.startswith(f"8000-{sb.sandbox_id}.")
        gw = os.environ["E2B_API_URL"]
        page = httpx.get(gw + "/", headers={"Host": host}, timeout=30)
        assert page.status_code == 200 and "Directory listing" in page.text

        # update_network replaces the egress settings: deny all, allow none.
        sb.update_network({"deny_out": ["0.0.0.0/0"]})
        r = sb.commands.run(f"curl -s --max-time 5 {own_internet['url']} || echo refused")
        assert r.stdout.strip() == "refused"
    finally:
        sb.kill()


def test_network_settings_without_a_mapping_are_refused():
    with pytest.raises(Exception, match="network.denyOut"):
        Sandbox.create(timeout=60, network={"deny_out": ["198.51.100.0/24"]})


def test_entry_modes_symlinks_and_removing_what_is_not_there(sandbox: Sandbox):
    """As envd: a directory's mode is its permission bits (0o755, no Go
    ModeDir bit); a symlink reports its target's absolute path (this SDK
    shows type SYMLINK for it: envd marks it is_symlink and puts the
    target's type in `type`, which the JS SDK shows); removing a missing
    path succeeds."""
    sandbox.files.make_dir("d")
    assert sandbox.files.get_info("d").mode == 0o755
    sandbox.files.write("target.txt", "x")
    sandbox.commands.run("cd /home/user && ln -s d dlink && ln -s target.txt flink && ln -s /home/user/dlink chain")
    info = sandbox.files.get_info("dlink")
    assert info.type == FileType.SYMLINK and info.symlink_target == "/home/user/d"
    assert sandbox.files.get_info("chain").symlink_target == "/home/user/d"
    listed = {e.name: e for e in sandbox.files.list(".")}
    assert listed["flink"].type == FileType.SYMLINK and listed["flink"].symlink_target == "/home/user/target.txt"
    sandbox.files.remove("never-was-here")  # no exception


def test_killing_an_unknown_id_returns_false():
    assert Sandbox.kill("not-a-sandbox-id") is False
    assert Sandbox.kill("abcdefgh-abcdefghijklmnop") is False


def test_a_sandbox_killed_while_a_command_streams_says_so():
    """The stream of a command in a sandbox that is killed ends as E2B's
    does (test_sandbox_killed_during_run.py): the connection is cut, the
    SDK's health probe hears the sandbox is gone, and says so."""
    from e2b import SandboxNotRunningException

    sb = Sandbox.create(timeout=120)
    handle = sb.commands.run("while true; do echo tick; sleep 0.1; done", background=True)
    time.sleep(1)
    assert Sandbox.kill(sb.sandbox_id) is True
    with pytest.raises(SandboxNotRunningException) as e:
        handle.wait()
    assert "sandbox was killed or reached its end of life" in str(e.value), e.value


def test_an_mcp_gateway_that_fails_to_start_kills_the_sandbox():
    """The SDK starts the MCP gateway itself, running mcp-gateway in the new
    sandbox; the base image lacks it, so the SDK kills the sandbox and says
    so, as E2B does on its base template."""
    metadata = {"mcpCleanup": str(time.time_ns())}
    with pytest.raises(Exception, match="Failed to start MCP gateway"):
        Sandbox.create("base", timeout=60, metadata=metadata, mcp={"invalid_server": {}})
    left = Sandbox.list(query=SandboxQuery(metadata=metadata)).next_items()
    assert left == []


def test_a_shortened_timeout_is_honoured_on_time():
    """E2B's tests allow a second: a sandbox whose timeout is set to 2 s
    no longer answers 2.4 s later."""
    sb = Sandbox.create(timeout=120)
    try:
        sb.set_timeout(2)
        time.sleep(2.4)
        assert sb.is_running() is False
    finally:
        try:
            sb.kill()
        except Exception:
            pass


def test_a_timeout_of_zero_ends_it_now():
    """E2B's timeout counts from now: set_timeout(0) is accepted and ends
    the sandbox (killed, or paused with on_timeout "pause")."""
    killed = Sandbox.create(timeout=120)
    paused = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        killed.set_timeout(0)
        paused.set_timeout(0)
        deadline = time.time() + 30
        while killed.is_running() or paused.get_info().state != SandboxState.PAUSED:
            assert time.time() < deadline, "still running 30 s after set_timeout(0)"
            time.sleep(0.2)
        with pytest.raises(NotFoundException):
            Sandbox.connect(killed.sandbox_id)
    finally:
        for sb in (killed, paused):
            try:
                sb.kill()
            except Exception:
                pass


def test_signed_file_urls(sandbox: Sandbox):
    """download_url/upload_url carry envd's signature instead of the token
    (and, through E2B_SANDBOX_URL, no sandbox id): they work for the path,
    operation and time they were signed for, and nothing else."""
    sandbox.files.write("signed.txt", "signed content")
    url = sandbox.download_url("signed.txt")
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200 and r.text == "signed content", (r.status_code, r.text)
    up = sandbox.upload_url("uploaded.txt")
    r = httpx.post(up, files={"file": ("uploaded.txt", b"uploaded content")}, timeout=30)
    assert r.status_code == 200, (r.status_code, r.text)
    assert sandbox.files.read("uploaded.txt") == "uploaded content"
    assert httpx.get(url.replace("signed.txt", "uploaded.txt"), timeout=30).status_code == 401
    assert httpx.get(sandbox.download_url("signed.txt", use_signature_expiration=60), timeout=30).status_code == 200
    expired = httpx.get(sandbox.download_url("signed.txt", use_signature_expiration=-60), timeout=30)
    assert expired.status_code == 401 and expired.json()["message"] == "signature is already expired", expired.text


def test_named_snapshots():
    """create_snapshot(name=...) names a snapshot; it is listed with its
    name, starts sandboxes by that name, and is deleted by it. E2B's own
    suites name them "snap-…", like ids: a name that is not an id is fine."""
    sb = Sandbox.create(timeout=300)
    try:
        sb.files.write("state.txt", "kept")
        name = f"snap-{uuid.uuid4().hex[:8]}"
        snap = sb.create_snapshot(name=name)
        assert name in snap.names
        listed = [s for s in sb.list_snapshots().next_items() if s.snapshot_id == snap.snapshot_id]
        assert listed and name in listed[0].names
        # The name filter matches whole names (test_list_snapshots_filtered_by_name).
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()] == [snap.snapshot_id]
        assert Sandbox.list_snapshots(name=name + "-does-not-exist").next_items() == []
        copy = Sandbox.create(name, timeout=120)
        try:
            assert copy.files.read("state.txt") == "kept"
        finally:
            copy.kill()
        assert Sandbox.delete_snapshot(name) is True
    finally:
        sb.kill()


def test_boot_id_is_there_and_survives_a_pause(sandbox: Sandbox):
    first = sandbox.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    assert len(first) == 36 and first.count("-") == 4, first
    sandbox.pause()
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.commands.run("python3 -c 'print(open(\"/proc/sys/kernel/random/boot_id\").read().strip())'").stdout.strip() == first
    # A file read through envd's API sees it too (E2B's keep_memory and
    # filesystem-only pause tests read it so).
    assert again.files.read("/proc/sys/kernel/random/boot_id").strip() == first



def test_filesystem_only_pause_starts_afresh_with_its_files(sandbox: Sandbox):
    # E2B's test_pause_filesystem_only and test_auto_pause_filesystem_only_reboots:
    # without its memory a pause keeps the files only; the resume is a fresh
    # start (a new boot id, no process of before).
    sandbox.files.write("/home/user/kept.txt", "kept")
    boot = sandbox.files.read("/proc/sys/kernel/random/boot_id").strip()
    sandbox.commands.run("sleep 1000", background=True, timeout=0)
    assert sandbox.pause(keep_memory=False)
    assert not sandbox.is_running()
    again = sandbox.connect()
    assert again.is_running()
    assert again.files.read("/home/user/kept.txt") == "kept"
    assert again.files.read("/proc/sys/kernel/random/boot_id").strip() != boot
    assert "sleep 1000" not in again.commands.run("ps -eo args").stdout

    # The timeout's pause without memory does the same; with keep_memory
    # unset it keeps the memory (test_keep_memory_none_defaults_to_full_memory).
    for keep_memory, same_boot in ((False, False), (None, True)):
        sb = Sandbox.create(timeout=60, lifecycle={"on_timeout": {"action": "pause", "keep_memory": keep_memory}})
        try:
            boot = sb.files.read("/proc/sys/kernel/random/boot_id").strip()
            sb.set_timeout(0)
            for _ in range(150):
                if sb.get_info().state == SandboxState.PAUSED:
                    break
                time.sleep(0.2)
            assert sb.get_info().state == SandboxState.PAUSED
            resumed = sb.connect()
            assert (resumed.files.read("/proc/sys/kernel/random/boot_id").strip() == boot) is same_boot, keep_memory
        finally:
            sb.kill()
