"""E2B's own SDKs (Python and JavaScript) against a gateway that serves
HTTPS (dsec up --tls), verifying it with the cluster's CA the way each SDK
takes an extra CA: SSL_CERT_FILE for Python (httpx), NODE_EXTRA_CA_CERTS
for Node. Each runs in a process of its own with only the variables a user
would set."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator

import pytest

from conftest import REPO, missing, start_up

PY_SCRIPT = """
from e2b import Sandbox
sb = Sandbox.create(timeout=120)
try:
    print(sb.commands.run("echo over-https").stdout.strip())
    sb.files.write("/tmp/f.txt", "kept")
    print(sb.files.read("/tmp/f.txt"))
finally:
    sb.kill()
"""

JS_SCRIPT = """
const { Sandbox } = require('e2b')
;(async () => {
  const sb = await Sandbox.create({ timeoutMs: 120000 })
  try {
    console.log((await sb.commands.run('echo over-https')).stdout.trim())
  } finally {
    await sb.kill()
  }
})().catch((e) => { console.error(String(e && e.cause ? e.cause : e)); process.exit(1) })
"""


@pytest.fixture(scope="module")
def tls_gateway(request: pytest.FixtureRequest) -> Iterator[Dict[str, str]]:
    """client.env of a dsec up --tls of this module's own."""
    dsec = REPO / "bin" / "dsec"
    images = Path(os.environ.get("DSEC_TEST_IMAGE_STORE", REPO / ".cache" / "images"))
    if os.geteuid() != 0:
        missing("the gvisor backend needs root")
    if not dsec.exists():
        missing("bin/dsec not built (run make build)")
    if not (images / "refs" / "root" / "py" / "3.11").exists():
        missing("root/py:3.11 is not built (make images)")
    up = start_up(dsec, images, "--tls")
    try:
        if not up.env["E2B_API_URL"].startswith("https://") or not up.env.get("DSEC_CA_FILE"):
            pytest.fail(f"dsec up --tls wrote no https gateway or CA: {up.env}")
        yield up.env
    finally:
        up.stop(request.session.testsfailed > 0)


def _env(gw: Dict[str, str], **extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_") and k not in ("SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS")}
    env.update({k: gw[k] for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")})
    env.update(extra)
    return env


def test_python_sdk_over_https(tls_gateway: Dict[str, str]) -> None:
    ok = subprocess.run([sys.executable, "-c", PY_SCRIPT], env=_env(tls_gateway, SSL_CERT_FILE=tls_gateway["DSEC_CA_FILE"]),
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.split() == ["over-https", "kept"], ok.stderr[-2000:]
    refused = subprocess.run([sys.executable, "-c", PY_SCRIPT], env=_env(tls_gateway), capture_output=True, text=True, timeout=300)
    # httpx says CERTIFICATE_VERIFY_FAILED; newer SDKs' Rust client (pyqwest) UnknownIssuer.
    assert refused.returncode != 0 and ("CERTIFICATE_VERIFY_FAILED" in refused.stderr or "UnknownIssuer" in refused.stderr), refused.stderr[-2000:]


def test_js_sdk_over_https(tls_gateway: Dict[str, str]) -> None:
    js = REPO / "test" / "e2b" / "js"
    node = shutil.which("node")
    if node is None or not (js / "node_modules" / "e2b").exists():
        missing("node or E2B's JS SDK (make e2b-sdks) is missing")
    ok = subprocess.run([node, "-e", JS_SCRIPT], cwd=js, env=_env(tls_gateway, NODE_EXTRA_CA_CERTS=tls_gateway["DSEC_CA_FILE"]),
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.strip() == "over-https", ok.stderr[-2000:]
    refused = subprocess.run([node, "-e", JS_SCRIPT], cwd=js, env=_env(tls_gateway), capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "certificate" in refused.stderr.lower(), refused.stderr[-2000:]
