"""Sandbox networking through the SDK: the policy as the server keeps it,
runtime updates, and HTTP to a server in the sandbox through the
apiserver. No test sends traffic beyond the node: egress is covered by the
Go end-to-end test, which builds its own internet in namespaces."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from opendsec import DSecRunArgs, FailedPreconditionError, InvalidArgumentError, Network


async def _serve(sb, port: int) -> None:
    await sb.run_shell(f"nohup python3 -m http.server {port} >/dev/null 2>&1 &")
    for _ in range(150):
        r = await sb.run_shell(f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 1)'")
        if r.exit_code == 0:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the server on {port} did not start")


async def test_policy_updates_and_inbound_http(client, py_image):
    sb = await client.run_sandbox(DSecRunArgs(image=py_image, network=Network(allow=["PyPI.Example.org", "tcp 192.0.2.0/24:443"])))
    try:
        info = sb.info
        assert info.network is not None and info.network_address
        assert info.network.allow == ["any pypi.example.org", "tcp 192.0.2.0/24:443"]

        info = await sb.update_network(add=["udp 198.51.100.7:53"], remove=["pypi.example.org"], internet=True)
        assert info.network.allow == ["tcp 192.0.2.0/24:443", "udp 198.51.100.7/32:53"] and info.network.internet
        with pytest.raises(InvalidArgumentError, match=r"remove\[0\]"):
            await sb.update_network(remove=["never.example.org"])
        with pytest.raises(InvalidArgumentError, match=r"add\[0\].*port"):
            await sb.update_network(add=["tcp 10.0.0.1:99999"])
        assert (await sb.refresh()).network.allow == ["tcp 192.0.2.0/24:443", "udp 198.51.100.7/32:53"], "a refused update changed nothing"
        info = await sb.update_network(replace=[])
        assert info.network.allow == [] and info.network.internet

        await _serve(sb, 8000)
        r = await sb.request(8000, "GET", "/")
        assert r.status_code == 200 and "Directory listing" in r.text
        async with httpx.AsyncClient() as anon:
            r = await anon.get(sb.get_host(8000))
        assert r.status_code == 401 and "API key" in r.text
        r = await sb.request(8001)
        assert r.status_code == 503 and "nothing listens" in r.text
    finally:
        await sb.stop()


async def test_public_sandbox_answers_without_a_key(client, py_image):
    sb = await client.run_sandbox(DSecRunArgs(image=py_image, network=Network(allow_public_traffic=True)))
    try:
        await _serve(sb, 8000)
        async with httpx.AsyncClient() as anon:
            r = await anon.get(sb.get_host(8000))
        assert r.status_code == 200 and "Directory listing" in r.text
    finally:
        await sb.stop()


async def test_without_a_network(sandbox):
    with pytest.raises(FailedPreconditionError, match="no network"):
        await sandbox.update_network(add=["example.org"])
    r = await sandbox.request(8000)
    assert r.status_code == 400 and "no network" in r.text


async def test_bad_rules_at_create_name_the_rule(client, py_image):
    with pytest.raises(InvalidArgumentError, match=r"network\.rules\[1\].*cidr"):
        await client.run_sandbox(DSecRunArgs(image=py_image, network=Network(allow=["ok.example.org", "10.0.0.0/33"])))
