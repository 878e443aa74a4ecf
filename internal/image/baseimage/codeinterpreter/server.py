"""OpenDsec's code interpreter server [ours].

Serves the HTTP protocol of E2B's Code Interpreter SDKs on port 49999 from
inside a sandbox (image root/code-interpreter, template code-interpreter-v1)
and runs the code in Jupyter kernels through jupyter_client:

  GET  /health                  200 once the default Python context is up
  POST /execute                 {code, context_id, language, env_vars}:
                                one JSON object per line as the cell runs
  POST /contexts                {language, cwd} -> {id, language, cwd}
  GET  /contexts                the contexts
  DELETE /contexts/{id}         shuts the context's kernel down
  POST /contexts/{id}/restart   restarts it (its state is lost)

Each context is one kernel; cells of one context run one at a time, in the
order they came. As in E2B's template, the server and its kernels run as
root with /home/user as the default working directory, and a default Python
and a default JavaScript context exist from the start. A client that goes away while its cell runs (the SDKs
close the connection when the cell's timeout passes) interrupts the cell,
so the kernel and its state stay usable. Standard library only, besides
jupyter_client.
"""

import json
import os
import queue
import select
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("DSEC_CODE_INTERPRETER_PORT", "49999"))
DEFAULT_CWD = os.environ.get("DSEC_CODE_INTERPRETER_CWD") or (
    "/home/user" if os.path.isdir("/home/user") else os.path.expanduser("~"))
# IPython's profile with the startup scripts of the image (PIL images shown).
IPYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ipython")
MAX_BODY = 16 << 20
KERNEL_START_TIMEOUT = 120

# Names the SDKs send -> kernelspec names that serve them.
LANGUAGE_KERNELS = {
    "python": "python3",
    "python3": "python3",
    "bash": "bash",
    "sh": "bash",
    "javascript": "javascript",
    "js": "javascript",
    "typescript": "typescript",
    "ts": "typescript",
    "r": "ir",
    "java": "java",
}

# Jupyter MIME types -> the fields of the SDKs' Result.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",  # a DataFrame's columns (the image's IPython startup script)
    "e2b/chart": "chart",  # a matplotlib figure's data (the same script)
}


class HTTPError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def canonical_language(name):
    return {"python3": "python", "sh": "bash", "js": "javascript", "ts": "typescript"}.get(name, name)


class Context:
    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()  # one cell at a time
        self.km = None
        self.kc = None

    def start(self):
        env = dict(os.environ)
        env.pop("DSEC_CODE_INTERPRETER_PORT", None)
        if os.path.isdir(IPYTHON_DIR):
            env.setdefault("IPYTHONDIR", IPYTHON_DIR)
        self.km = KernelManager(kernel_name=LANGUAGE_KERNELS[self.language])
        self.km.start_kernel(cwd=self.cwd, env=env)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=KERNEL_START_TIMEOUT)

    def restart(self):
        with self.lock:
            self.km.restart_kernel(now=True)
            self.kc.wait_for_ready(timeout=KERNEL_START_TIMEOUT)

    def shutdown(self):
        with self.lock:
            try:
                self.kc.stop_channels()
            finally:
                self.km.shutdown_kernel(now=True)

    def json(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


class Contexts:
    def __init__(self):
        self.mu = threading.Lock()
        self.by_id = {}
        self.defaults = {}  # language -> Context
        self.installed = set(KernelSpecManager().find_kernel_specs())

    def supported(self):
        langs = {canonical_language(l) for l, k in LANGUAGE_KERNELS.items() if k in self.installed}
        return sorted(langs)

    def check_language(self, language):
        language = canonical_language((language or "python").strip().lower())
        kernel = LANGUAGE_KERNELS.get(language)
        if kernel is None or kernel not in self.installed:
            raise HTTPError(400, "language %r: not available in this sandbox; available: %s"
                            % (language, ", ".join(self.supported())))
        return language

    def create(self, language, cwd):
        language = self.check_language(language)
        cwd = cwd or DEFAULT_CWD
        if not isinstance(cwd, str) or not cwd.startswith("/"):
            raise HTTPError(400, "cwd %r: an absolute path is expected" % (cwd,))
        try:  # a context's directory is made when missing
            os.makedirs(cwd, exist_ok=True)
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            raise HTTPError(400, "cwd %r: %s" % (cwd, getattr(e, "strerror", None) or e))
        if not os.path.isdir(cwd):
            raise HTTPError(400, "cwd %r: not a directory in the sandbox" % cwd)
        ctx = Context(language, cwd)
        try:
            ctx.start()
        except Exception as e:  # the kernel's own message says why
            if ctx.km is not None:  # a kernel that started but never answered
                try:
                    ctx.km.shutdown_kernel(now=True)
                except Exception:
                    pass
            raise HTTPError(500, "starting a %s kernel: %s" % (language, e))
        with self.mu:
            self.by_id[ctx.id] = ctx
        return ctx

    def default(self, language):
        language = self.check_language(language)
        with self.mu:
            ctx = self.defaults.get(language)
            if ctx is not None:
                return ctx
        ctx = self.create(language, DEFAULT_CWD)
        with self.mu:
            if language in self.defaults:  # another request made it first
                winner = self.defaults[language]
            else:
                self.defaults[language] = winner = ctx
        if winner is not ctx:
            self.remove(ctx.id)
        return winner

    def get(self, context_id):
        with self.mu:
            ctx = self.by_id.get(context_id)
        if ctx is None:
            raise HTTPError(404, "context %s: not found" % context_id)
        return ctx

    def list(self):
        with self.mu:
            return list(self.by_id.values())

    def remove(self, context_id):
        with self.mu:
            ctx = self.by_id.pop(context_id, None)
            if ctx is None:
                raise HTTPError(404, "context %s: not found" % context_id)
            for lang, d in list(self.defaults.items()):
                if d is ctx:
                    del self.defaults[lang]
        ctx.shutdown()


CONTEXTS = None


def env_code(language, env_vars):
    """Code that sets env_vars in the kernel and code that undoes it."""
    if language == "python":
        names = json.dumps(sorted(env_vars))
        values = json.dumps(env_vars)
        return (
            "import os as _dsec_os, json as _dsec_json\n"
            "_dsec_saved = {k: _dsec_os.environ.get(k) for k in _dsec_json.loads(%r)}\n"
            "_dsec_os.environ.update(_dsec_json.loads(%r))\n" % (names, values),
            "for _k, _v in _dsec_saved.items():\n"
            "    _dsec_os.environ.pop(_k, None) if _v is None else _dsec_os.environ.__setitem__(_k, _v)\n"
            "del _dsec_saved\n",
        )
    if language == "bash":
        before, after = [], []
        for i, (k, v) in enumerate(sorted(env_vars.items())):
            quoted = "'" + v.replace("'", "'\\''") + "'"
            before.append('_dsec_had_%d="${%s+x}"; _dsec_old_%d="${%s-}"; export %s=%s' % (i, k, i, k, k, quoted))
            after.append('if [ -n "$_dsec_had_%d" ]; then export %s="$_dsec_old_%d"; else unset %s; fi; unset _dsec_had_%d _dsec_old_%d'
                         % (i, k, i, k, i, i))
        return "\n".join(before), "\n".join(after)
    if language in ("javascript", "typescript"):  # one runner serves both
        values = json.dumps(env_vars)
        return (
            "globalThis.__dsecSaved = {}; for (const [k, v] of Object.entries(%s)) "
            "{ __dsecSaved[k] = process.env[k]; process.env[k] = v }" % values,
            "for (const [k, v] of Object.entries(globalThis.__dsecSaved)) "
            "{ if (v === undefined) delete process.env[k]; else process.env[k] = v }; delete globalThis.__dsecSaved",
        )
    if language == "r":
        # R's string literals take JSON's escapes; names are checked
        # (valid_env_name) before they get here.
        names = ", ".join(json.dumps(k) for k in sorted(env_vars))
        pairs = ", ".join("%s = %s" % (json.dumps(k), json.dumps(v)) for k, v in sorted(env_vars.items()))
        return (
            ".dsec_saved <- Sys.getenv(c(%s), unset = NA, names = TRUE)\n"
            "invisible(do.call(Sys.setenv, as.list(c(%s))))" % (names, pairs),
            "for (.dsec_k in names(.dsec_saved)) if (is.na(.dsec_saved[[.dsec_k]])) Sys.unsetenv(.dsec_k) "
            "else do.call(Sys.setenv, setNames(list(.dsec_saved[[.dsec_k]]), .dsec_k))\n"
            "rm(.dsec_saved, .dsec_k)",
        )
    raise HTTPError(400, "env_vars: not supported for language %r" % language)


def valid_env_name(k):
    return isinstance(k, str) and k != "" and (k[0].isalpha() or k[0] == "_") and all(c.isalnum() or c == "_" for c in k)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "opendsec-code-interpreter"

    def log_message(self, fmt, *args):  # requests are not logged; errors are
        pass

    # --- plumbing ---------------------------------------------------------

    def send_text(self, status, text):
        body = (text + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status, value):
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def read_json(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise HTTPError(413, "request body: %d bytes, at most %d allowed" % (n, MAX_BODY))
        raw = self.rfile.read(n) if n else b""
        if not raw.strip():
            return {}
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise HTTPError(400, "request body: not JSON: %s" % e)
        if not isinstance(value, dict):
            raise HTTPError(400, "request body: a JSON object is expected")
        return value

    def dispatch(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        try:
            if method == "GET" and path == "/health":
                return self.send_text(200, "OK")
            if method == "POST" and path == "/execute":
                return self.execute(self.read_json())
            if path == "/contexts":
                if method == "GET":
                    return self.send_json(200, [c.json() for c in CONTEXTS.list()])
                if method == "POST":
                    body = self.read_json()
                    ctx = CONTEXTS.create(body.get("language"), body.get("cwd"))
                    return self.send_json(200, ctx.json())
            if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
                CONTEXTS.remove(parts[1])
                return self.send_text(200, "removed")
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
                CONTEXTS.get(parts[1]).restart()
                return self.send_text(200, "restarted")
            raise HTTPError(404, "%s %s: no such route" % (method, path))
        except HTTPError as e:
            self.send_text(e.status, e.message)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def do_DELETE(self):
        self.dispatch("DELETE")

    def client_gone(self):
        """Whether the client closed its connection (it sends nothing while a cell runs)."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            if not r:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # --- /execute ---------------------------------------------------------

    def execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, "code: a string is required")
        context_id, language = body.get("context_id"), body.get("language")
        if context_id and language:
            raise HTTPError(400, "context_id and language: give one, not both")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(valid_env_name(k) and isinstance(v, str) for k, v in env_vars.items()):
            raise HTTPError(400, "env_vars: an object of variable names to string values is expected")
        ctx = CONTEXTS.get(context_id) if context_id else CONTEXTS.default(language)

        # One execution per connection, as E2B's SDKs expect: a client that
        # goes away closes its connection, and no later request is sent on
        # one whose cell may still be ending.
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        with ctx.lock:
            try:
                self.run_cell(ctx, code, env_vars)
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    def emit(self, obj):
        data = (json.dumps(obj) + "\n").encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def run_silent(self, ctx, code):
        """Runs code that prints nothing; returns why it failed, or None."""
        msg_id = ctx.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        reply = self.wait_reply(ctx, msg_id, interruptible=False)
        if reply is None:
            return "the kernel died"
        content = reply["content"]
        if content.get("status") != "ok":
            return "%s: %s %s" % (content.get("status"), content.get("ename", ""), content.get("evalue", ""))
        return None

    def wait_reply(self, ctx, msg_id, interruptible):
        while True:
            try:
                msg = ctx.kc.get_shell_msg(timeout=0.2)
            except queue.Empty:
                if not ctx.km.is_alive():
                    return None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg

    def run_cell(self, ctx, code, env_vars):
        restore = None
        if env_vars:
            setup, restore = env_code(ctx.language, env_vars)
            why = self.run_silent(ctx, setup)
            if why is not None:
                self.emit({"type": "error", "name": "EnvVarsError", "value": "env_vars could not be set (%s)" % why, "traceback": ""})
                return
        try:
            self.stream_cell(ctx, code)
        finally:
            if restore is not None and ctx.km.is_alive():
                self.run_silent(ctx, restore)

    def stream_cell(self, ctx, code):
        kc = ctx.kc
        msg_id = kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=True)
        interrupted = False
        while True:
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if not interrupted and self.client_gone():
                    ctx.km.interrupt_kernel()
                    interrupted = True
                if not ctx.km.is_alive():
                    self.emit({"type": "error", "name": "KernelDied",
                               "value": "the kernel died while running the cell; it was restarted and its state is lost",
                               "traceback": ""})
                    ctx.km.restart_kernel(now=True)
                    kc.wait_for_ready(timeout=KERNEL_START_TIMEOUT)
                    return
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue  # left over from an earlier, interrupted cell
            kind, content = msg["msg_type"], msg["content"]
            if interrupted:
                if kind == "status" and content.get("execution_state") == "idle":
                    return
                continue
            try:
                if kind == "execute_input":
                    self.emit({"type": "number_of_executions", "execution_count": content.get("execution_count")})
                elif kind == "stream":
                    self.emit({"type": "stdout" if content.get("name") == "stdout" else "stderr",
                               "text": content.get("text", ""), "timestamp": time.time_ns()})
                elif kind in ("execute_result", "display_data"):
                    self.emit(result_of(content.get("data", {}), kind == "execute_result"))
                elif kind == "error":
                    self.emit({"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                               "traceback": "\n".join(content.get("traceback", []))})
                elif kind == "status" and content.get("execution_state") == "idle":
                    return
            except (BrokenPipeError, ConnectionResetError):
                ctx.km.interrupt_kernel()
                interrupted = True


def result_of(data, main):
    out = {"type": "result", "is_main_result": main}
    extra = {}
    text = data.get("text/plain")
    # A string's repr loses its quotes, as E2B's server does: 'supertest'
    # reads supertest.
    if isinstance(text, str) and len(text) >= 2 and text.startswith("'") and text.endswith("'"):
        data = dict(data, **{"text/plain": text[1:-1]})
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    if extra:
        out["extra"] = extra
    return out


def main():
    global CONTEXTS
    CONTEXTS = Contexts()
    # The default contexts are started before the port opens, side by side,
    # so the first cell does not wait for a kernel and /health means ready.
    def start(lang):
        try:
            CONTEXTS.default(lang)
        except Exception as e:  # Python is tried again below, and raises there
            print("default %s context: %s" % (lang, getattr(e, "message", e)), file=sys.stderr, flush=True)

    starts = [threading.Thread(target=start, args=(lang,))
              for lang in ("python", "javascript") if LANGUAGE_KERNELS[lang] in CONTEXTS.installed]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    CONTEXTS.default("python")  # raises here if it could not start
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    print("code interpreter listening on :%d (%s)" % (PORT, ", ".join(CONTEXTS.supported())), file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
