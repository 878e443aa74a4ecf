package e2e

import (
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/testutil"
)

func FakeSpec() *sandboxv1.SandboxSpec {
	return &sandboxv1.SandboxSpec{Backend: "fake", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}}
}

// layerCacheMount is a node's image layer mounted from its EROFS form.
var layerCacheMount = regexp.MustCompile(`/cache/[0-9a-f]{16}/fs$`)

// AssertNoLeaks checks the host for anything a sandbox of this cluster
// could leave: mounts, cgroups, runtime state, processes, directories.
// Sandbox ids start with the node's id, so every sandbox the cluster ever
// made is covered, including ones whose id the test never saw; other
// tests' sandboxes (other nodes) are not.
func AssertNoLeaks(t *testing.T, c *Cluster) {
	t.Helper()
	node := string(c.Edge.Node())
	// The edge keeps a few empty writable layers ready (marked warm), and
	// its image layers mounted (the node's cache, not a sandbox's).
	mounts, _ := rootfs.MountsUnder(c.Cfg.StateDir)
	var left []string
	for _, m := range mounts {
		if _, err := os.Stat(m + ".warm"); err != nil && !layerCacheMount.MatchString(m) {
			left = append(left, m)
		}
	}
	if len(left) != 0 {
		t.Errorf("mounts left: %v", left)
	}
	if dirs := NodeCgroups().Children(node + "-"); len(dirs) != 0 {
		t.Errorf("cgroups left: %v", dirs)
	}
	out, _ := exec.Command("ps", "-eo", "args").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, node+"-") {
			t.Errorf("a process of node %s is still running: %s", node, line)
		}
	}
	out, err := exec.Command("crun", "--root", filepath.Join(c.Cfg.StateDir, "edge", "backends", "container", "crun"), "list", "-q").Output()
	if err != nil || strings.TrimSpace(string(out)) != "" {
		t.Errorf("crun still lists containers: %q, %v", out, err)
	}
	ents, _ := os.ReadDir(filepath.Join(c.Cfg.StateDir, "edge", "sandboxes"))
	if len(ents) != 0 {
		t.Errorf("%d sandbox directories left", len(ents))
	}
}

// NodeCgroups is the cgroup layout of this machine, with the sandboxes'
// default parent (the one StartCluster's edges use).
func NodeCgroups() *cgroups.Host {
	h, err := cgroups.Detect(cgroups.DefaultRoot, "")
	if err != nil {
		panic(err)
	}
	return h
}

func RunIn(t *testing.T, sb *client.Sandbox, session, cmd string) []byte {
	t.Helper()
	r, err := sb.Sessions.RunInSession(Ctx(t), connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: session, Command: cmd}))
	if err != nil {
		t.Fatalf("%s: %s: %v", sb.ID, cmd, err)
	}
	return r.Msg.Stdout
}

// EarlyAnswerServer answers a POST before it reads the body: headers and
// a first chunk, then the body echoed once it is all there, then a last
// chunk. Every proxy
// on the way (gateway, apiserver, edge) must go on sending the request
// body after the response started and keep the response whole: an HTTP/1
// server closes a request body once the response starts unless the
// handler asked for full duplex, and the proxy's transport then dropped
// its connection, cutting the response ("terminated" in E2B's JS SDK).
const EarlyAnswerServer = `
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def chunk(self, b):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
        self.wfile.flush()
    def do_POST(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.chunk(b"start|")
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.chunk(b"echo:" + body)
        self.chunk(b"|done")
        self.wfile.write(b"0\r\n\r\n")
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
`

// ServeEarlyAnswerCmd is the command that starts EarlyAnswerServer on port.
func ServeEarlyAnswerCmd(port string) string {
	return "cat > /tmp/early.py <<'EOF'\n" + EarlyAnswerServer + "\nEOF\nnohup python3 /tmp/early.py " + port + " >/dev/null 2>&1 &"
}

// PostAfterAnswer POSTs "hello" to url (with Host host if not empty),
// in two parts 300 ms apart after the headers, so that the server's
// answer has started before the body arrives, and checks the whole answer.
func PostAfterAnswer(t *testing.T, hc *http.Client, url, host string) {
	t.Helper()
	pr, pw := io.Pipe()
	go func() {
		for _, part := range []string{"hel", "lo"} {
			time.Sleep(300 * time.Millisecond)
			if _, err := pw.Write([]byte(part)); err != nil {
				return // the request failed: seen below
			}
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", url, pr)
	req.ContentLength = 5
	if host != "" {
		req.Host = host
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("POST %s (host %q): %v", url, host, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 || string(got) != "start|echo:hello|done" {
		t.Fatalf("POST %s (host %q) with the body sent after the answer began: status %d, body %q, err %v; want 200 %q", url, host, resp.StatusCode, got, err, "start|echo:hello|done")
	}
}

// WaitFailed waits until the sandbox is reported failed and returns the
// reason and how long it took.
func WaitFailed(t *testing.T, c *Cluster, id string, since time.Time) (string, time.Duration) {
	t.Helper()
	for time.Since(since) < 20*time.Second {
		got, err := c.Client.Sandboxes.GetSandbox(Ctx(t), connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: id}))
		if err != nil {
			t.Fatal(err)
		}
		if got.Msg.Sandbox.State == sandboxv1.SandboxState_SANDBOX_STATE_FAILED {
			return got.Msg.Sandbox.Message, time.Since(since)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("sandbox %s still not reported failed %v after it died", id, time.Since(since))
	return "", 0
}

// WaitLimitEvents waits up to 15 s (the edge learns a container's counts
// at its 5 s metrics sample, an agent's at its next answer or heartbeat)
// until sandbox id's limit events satisfy ok, and returns them.
func WaitLimitEvents(t *testing.T, c *Cluster, id string, ok func(*sandboxv1.LimitEvents) bool) *sandboxv1.LimitEvents {
	t.Helper()
	var last *sandboxv1.LimitEvents
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		got, err := c.Client.Sandboxes.GetSandbox(Ctx(t), connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: id}))
		if err != nil {
			t.Fatal(err)
		}
		if last = got.Msg.Sandbox.LimitEvents; ok(last) {
			return last
		}
	}
	t.Fatalf("sandbox %s: its limit events %v after 15 s", id, last)
	return nil
}

// Clusters on the real runtimes. Their guards skip where the host lacks a
// runtime or image, and fail instead in a strict run (make test).

// ContainerCluster runs the container backend (crun) with root/busybox.
func ContainerCluster(t *testing.T) *Cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	testutil.RequireBinary(t, "busybox")
	return StartCluster(t, "container")
}

// GvisorCluster runs the gvisor and container backends with root/busybox
// only, in a store of its own: tests that need no Python image do not
// depend on one.
func GvisorCluster(t *testing.T) *Cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "busybox")
	return StartCluster(t, "gvisor", "container")
}

// GvisorPyCluster runs the gvisor and container backends on the image
// store `make images` fills, which has root/py:3.11.
func GvisorPyCluster(t *testing.T) *Cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	return StartClusterWithStore(t, PyStore(t), "gvisor", "container")
}

// MicrovmOptions are the microvm backend's options for a cluster of a
// test's own: the guest kernel and init make deps and the tests build.
func MicrovmOptions(t *testing.T) map[string]string {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "qemu-system-x86_64")
	testutil.RequireBinary(t, "mkfs.ext4")
	return map[string]string{"guest": testutil.GuestKernelDir(t), "init": testutil.VMInitBinary(t)}
}

// AllBackendsPyCluster runs the container, gvisor and microvm backends on
// the image store `make images` fills.
func AllBackendsPyCluster(t *testing.T) *Cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	vm := MicrovmOptions(t)
	return StartClusterWith(t, PyStore(t), func(cfg *embed.Config) { cfg.Backends["microvm"] = vm }, "gvisor", "container", "microvm")
}

// PyStore is the image store `make images` fills, with root/py:3.11.
func PyStore(t *testing.T) string {
	store := filepath.Join(testutil.RepoRoot(t), ".cache", "images")
	s, err := image.OpenStore(store)
	if err != nil {
		testutil.Missing(t, "no image store at %s (make images): %v", store, err)
	}
	ref, _ := image.ParseRef("root/py:3.11")
	if _, err := s.Resolve(ref); err != nil {
		testutil.Missing(t, "root/py:3.11 is not built (make images): %v", err)
	}
	return store
}
