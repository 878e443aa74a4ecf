"""The microvm backend through the SDK: each sandbox a QEMU guest with a
kernel of its own (TCG on these machines), forked with its memory."""

from __future__ import annotations

import asyncio
import os

from opendsec import DSecRunArgs
from opendsec.errors import FailedPreconditionError

from conftest import STRICT, missing


async def test_microvm_sandbox_runs_the_seed_steps(client, py_image):
    try:
        sb = await client.run_sandbox(DSecRunArgs(backend="microvm", image=py_image, cpu_cores_limit=1, memory_limit_mb=512))
    except FailedPreconditionError as e:  # no QEMU or guest kernel on this node
        if STRICT:
            raise
        missing(f"the microvm backend cannot run here: {e.message}")
    try:
        r = await sb.run_shell("python3 -c 'print(6 * 7)'")
        assert r.exit_code == 0 and r.stdout.strip() == "42", r
        kernel = (await sb.run_shell("uname -r")).stdout.strip()
        assert kernel.endswith("-cloud-amd64") and kernel != os.uname().release, kernel
        assert (await sb.run_shell("hostname")).stdout.strip() == sb.id
        await sb.files.write("/root/note", b"kept")
        assert await sb.files.read("/root/note") == b"kept"
        await sb.exec(["sleep", "1000"], tag="held")
        pid = (await sb.run_shell("pidof sleep")).stdout.strip()
        # The seed's fork: 4 copies with the source's memory (its process),
        # files, and names of their own.
        forks = await sb.fork(count=4)
        try:
            assert len(forks) == 4
            for f in forks:
                r = await f.run_shell("pidof sleep; cat /root/note; echo; hostname")
                assert r.stdout.split() == [pid, "kept", f.id], r
        finally:
            await asyncio.gather(*(f.stop() for f in forks), return_exceptions=True)
    finally:
        await sb.stop()
