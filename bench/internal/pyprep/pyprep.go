// Package pyprep is the preparation the fork benchmarks give a sandbox
// before they fork it: what a rollout does first (import modules, build
// some state, listen on a port), in root/py:3.11.
package pyprep

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/client"
)

// Script imports modules, holds ~200 000 floats and serves on
// 127.0.0.1:8000.
const Script = `
import asyncio, argparse, decimal, email.parser, fractions, hashlib, http.server, json, logging
import sqlite3, ssl, statistics, unittest, urllib.request, xml.dom.minidom, random
state = [random.random() for _ in range(200000)]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps({"n": len(state)}).encode())
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
`

// WaitReady is a shell line that ends once the server answers.
const WaitReady = "for i in $(seq 400); do curl -s -o /dev/null http://127.0.0.1:8000/ && exit 0; sleep 0.02; done; exit 1"

// Run writes the script to /root/prep.py, starts it and waits until it
// answers.
func Run(ctx context.Context, sb *client.Sandbox) error {
	if _, err := sb.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: "/root/prep.py", Data: []byte(Script)})); err != nil {
		return err
	}
	if _, err := sb.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{Args: []string{"python3", "/root/prep.py"}, Tag: "prep"}})); err != nil {
		return err
	}
	if r, err := sb.Shell(ctx, WaitReady); err != nil || r.ExitCode != 0 {
		return fmt.Errorf("preparation did not come up: %v %v", r, err)
	}
	return nil
}
