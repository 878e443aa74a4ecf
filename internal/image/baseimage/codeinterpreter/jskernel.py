"""OpenDsec's JavaScript kernel for Jupyter [ours]: a wrapper kernel that
runs cells in a Node.js process (jsrunner.js, next to this file), whose
global scope holds the cells' state. An interrupt (a message: kernel.json
says interrupt_mode "message") is passed to Node as SIGINT, and Node stops
the running cell and keeps that scope; if Node dies, the next cell starts a new one (state lost, and said
so)."""

import json
import os
import select
import signal
import subprocess

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jsrunner.js")


class JavaScriptKernel(Kernel):
    implementation = "opendsec-javascript"
    implementation_version = "1.0"
    language = "javascript"
    language_version = "node"
    language_info = {"name": "javascript", "mimetype": "application/javascript", "file_extension": ".js"}
    banner = "JavaScript (Node.js), OpenDsec"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # The TypeScript kernel is this one with cells transpiled first
        # (its kernel.json sets DSEC_JS_LANGUAGE).
        self.typescript = os.environ.pop("DSEC_JS_LANGUAGE", "") == "typescript"
        if self.typescript:
            self.language = "typescript"
            self.language_info = {"name": "typescript", "mimetype": "text/x-typescript", "file_extension": ".ts"}
            self.banner = "TypeScript (Node.js), OpenDsec"
        self.node = None
        self.buf = b""
        self.cells = 0

    def start_node(self):
        r, w = os.pipe()
        self.node = subprocess.Popen(
            ["node", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,  # Node's own errors: the kernel's stderr
            pass_fds=(w,), env=dict(os.environ, DSEC_JS_MESSAGE_FD=str(w), **({"DSEC_JS_TYPESCRIPT": "1"} if self.typescript else {})),
        )
        os.close(w)
        self.out = r
        self.buf = b""

    def next_message(self):
        """The runner's next message; EOFError once it has ended."""
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.out], [], [], 0.1)
            if not ready:
                continue
            chunk = os.read(self.out, 65536)
            if not chunk:
                raise EOFError("node exited")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    async def interrupt_request(self, stream, ident, parent):
        """Jupyter's interrupt, as a message (kernel.json's interrupt_mode):
        only Node gets SIGINT, and stops the running cell itself; this
        process reads on until the cell says it is done. (A SIGINT to the
        kernel's process group would also raise KeyboardInterrupt here,
        wherever ipykernel happened to be, and lose the cell's end.)"""
        content = {"status": "ok"}
        if self.node is not None and self.node.poll() is None:
            self.node.send_signal(signal.SIGINT)
        self.session.send(stream, "interrupt_reply", content, parent, ident=ident)

    def messages(self, cell):
        """Yields the messages of cell up to its "done"."""
        while True:
            msg = self.next_message()
            if msg.get("id") != cell:
                continue  # what an earlier, interrupted cell sent late
            if msg.get("type") == "done":
                return
            yield msg

    async def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False, **kwargs):
        lost = ""
        if self.node is None or self.node.poll() is not None:
            if self.node is not None:
                lost = "the JavaScript process had ended; this cell runs in a new one, without the earlier cells' state\n"
            self.start_node()
        if lost and not silent:
            self.send_response(self.iopub_socket, "stream", {"name": "stderr", "text": lost})
        self.cells += 1
        self.node.stdin.write((json.dumps({"id": self.cells, "code": code}) + "\n").encode())
        self.node.stdin.flush()
        error = None
        try:
            for msg in self.messages(self.cells):
                kind = msg.get("type")
                if kind == "stream" and not silent:
                    self.send_response(self.iopub_socket, "stream", {"name": msg["name"], "text": msg["text"]})
                elif kind == "result" and not silent:
                    self.send_response(self.iopub_socket, "execute_result", {
                        "execution_count": self.execution_count, "data": {"text/plain": msg["text"]}, "metadata": {}})
                elif kind == "error":
                    error = msg
        except EOFError:
            error = {"ename": "Error", "evalue": "the JavaScript process ended while running the cell", "traceback": []}
        if error is not None:
            content = {"ename": error["ename"], "evalue": error["evalue"], "traceback": error["traceback"]}
            if not silent:
                self.send_response(self.iopub_socket, "error", content)
            return dict(content, status="error", execution_count=self.execution_count)
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def do_shutdown(self, restart):
        if self.node is not None and self.node.poll() is None:
            self.node.kill()
            self.node.wait()
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=JavaScriptKernel)
