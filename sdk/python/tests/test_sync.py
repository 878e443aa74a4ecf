"""The synchronous client as a plain script uses it: no event loop of the
caller's, context managers, iteration, threads, the SDK's own errors.
(Every test taking the ``client`` fixture also runs against it.)"""

from __future__ import annotations

import threading
from typing import Dict

import pytest

from opendsec import DSecRunArgs, NotFoundError, SandboxInfo
from opendsec.sync import DSecClient, Process, Sandbox


def test_a_script_without_an_event_loop(dsec_env: Dict[str, str]):
    with DSecClient(dsec_env["DSEC_API_URL"], dsec_env["DSEC_API_KEY"]) as client:
        with client.run_sandbox(DSecRunArgs(image="root/busybox:latest", cpu_cores_limit=0.2, memory_limit_mb=64)) as sb:
            assert isinstance(sb, Sandbox) and isinstance(sb.info, SandboxInfo)
            assert sb.run_shell("echo hi").stdout == "hi\n"
            sb.files.write("/tmp/f", "kept")
            assert sb.files.read_text("/tmp/f") == "kept"
            proc = sb.exec(["sh", "-c", "for i in 1 2 3; do echo $i; done"])
            assert isinstance(proc, Process)
            assert "".join(c.text for c in proc) == "1\n2\n3\n"
            assert sb.id in [s.id for s in client.list_sandboxes()]
            # Several threads share one client; their calls run at once.
            out: Dict[int, str] = {}

            def run(i: int) -> None:
                out[i] = sb.run_shell(f"echo {i}").stdout

            threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert out == {i: f"{i}\n" for i in range(8)}
            sb_id = sb.id
        with pytest.raises(NotFoundError):
            client.get_sandbox(sb_id)
        # Leaving "with sb" after it was stopped is fine, as with the async SDK.
        with client.run_sandbox(DSecRunArgs(image="root/busybox:latest", cpu_cores_limit=0.2, memory_limit_mb=64)) as sb:
            sb.stop()
    with pytest.raises(RuntimeError, match="closed"):
        client.list_sandboxes()


def test_bad_arguments_fail_before_a_loop_is_left_behind(monkeypatch):
    monkeypatch.delenv("DSEC_API_URL", raising=False)
    before = threading.active_count()
    with pytest.raises(Exception) as e:
        DSecClient("", "key")
    assert "DSEC_API_URL" in str(e.value)
    assert threading.active_count() == before
