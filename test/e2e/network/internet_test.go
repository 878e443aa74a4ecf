package network

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/gateway/e2b"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestSandboxNetwork: egress as the policy says and nothing more, on every
// backend, against the test's own internet.
func TestSandboxNetwork(t *testing.T) {
	if !inOwnNode(t) {
		return
	}
	in := newInternet(t)
	store := e2e.PyStore(t)
	runscNet := testutil.NewerRunsc(t)
	vm := e2e.MicrovmOptions(t)
	c := e2e.StartClusterWith(t, store, func(cfg *embed.Config) {
		cfg.Backends["gvisor"] = map[string]string{"runsc-network": runscNet}
		cfg.Backends["microvm"] = vm
		cfg.Backends["vm"] = vm
		cfg.Network = &sandboxnet.NodeConfig{Upstream: []string{in.web + ":53"}}
		cfg.GatewayListen = "127.0.0.1:0"
		cfg.Gateway = e2b.Config{Backend: "container", DefaultUser: "root"}
	}, "container", "gvisor", "microvm", "vm")
	// A service of the node's own, on every address (as a control plane's).
	nodeLn, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nodeLn.Close() })
	go func() {
		for {
			conn, err := nodeLn.Accept()
			if err != nil {
				return
			}
			conn.Close()
		}
	}()
	nodePort := nodeLn.Addr().(*net.TCPAddr).Port
	for _, backend := range []string{"container", "gvisor", "microvm", "vm"} {
		t.Run(backend, func(t *testing.T) { testNetworkOn(t, c, in, backend, nodePort) })
	}
	for _, backend := range []string{"gvisor", "microvm", "vm"} {
		t.Run(backend+"-fork", func(t *testing.T) { testForkWithNetwork(t, c, in, backend) })
	}
	t.Run("gvisor-offload", func(t *testing.T) { testOffloadWithNetwork(t, c, in) })
	t.Run("container-pool", func(t *testing.T) { testPoolWithNetwork(t, c, in) })
	t.Run("e2b", func(t *testing.T) { testE2BNetwork(t, c, in) })
	t.Run("no-internet-project", func(t *testing.T) { testNoInternetProject(t, c) })
	t.Run("cli", func(t *testing.T) { testNetworkCLI(t, c, in) })
}

// testNetworkCLI: dsec run --allow, dsec network and dsec port-forward.
func testNetworkCLI(t *testing.T, c *e2e.Cluster, in *internet) {
	bin := e2e.DsecBinary(t)
	env := append(os.Environ(), "DSEC_API_URL="+c.APIURL, "DSEC_API_KEY="+c.Key)
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = env
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("dsec %v: %v", args, err)
		}
		return string(out)
	}
	id := strings.TrimSpace(run("run", "--image", "root/py:3.11", "--allow", "tcp "+in.web+":8080"))
	sb := c.Client.Sandbox(id)
	t.Cleanup(func() { sb.Stop(context.Background()) }) //nolint:errcheck // best effort
	if out := run("network", id); !strings.Contains(out, "tcp "+in.web+"/32:8080") {
		t.Fatalf("dsec network: %q", out)
	}
	if out := run("network", "--add", "tcp "+in.alt+":8080", id); !strings.Contains(out, "tcp "+in.alt+"/32:8080") {
		t.Fatalf("dsec network --add: %q", out)
	}
	expectProbe(t, "after dsec network --add", sb, [][2]string{{in.alt + ":8080", "open"}, {in.alt + ":8081", "refused"}})

	serveIn(t, sb, "nohup python3 -m http.server 9000 >/dev/null 2>&1 &", 9000)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	local := ln.Addr().String()
	ln.Close()
	pf := exec.Command(bin, "port-forward", "--listen", local, id, "9000")
	pf.Env = env
	if err := pf.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pf.Process.Kill(); pf.Wait() }) //nolint:errcheck // test cleanup
	var resp *http.Response
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if resp, err = http.Get("http://" + local + "/"); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("GET through dsec port-forward: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "Directory listing") {
		t.Fatalf("through dsec port-forward: %d %.200s", resp.StatusCode, body)
	}
}

// testNoInternetProject: an operator switches the internet shorthand off
// for a project subtree; rules still work there.
func testNoInternetProject(t *testing.T, c *e2e.Cluster) {
	ctx := e2e.Ctx(t)
	c.Project(t, "root", "offline", &iamv1.Quota{NoInternet: true})
	cl := c.Project(t, "root/offline", "team", nil)
	_, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11", Network: &sandboxv1.NetworkPolicy{Internet: true}})
	if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "root/offline") {
		t.Fatalf("internet in a no-internet subtree: %v", err)
	}
	sb, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11", Network: &sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{rule("", "192.0.2.7", "tcp", "443")}}})
	if err != nil {
		t.Fatalf("rules in a no-internet subtree: %v", err)
	}
	t.Cleanup(func() { sb.Stop(context.Background()) }) //nolint:errcheck // best effort
	yes := true
	for _, who := range []*client.Client{cl, c.Client} { // the member, and root's admin
		_, err = who.Sandboxes.UpdateNetwork(ctx, connect.NewRequest(&sandboxv1.UpdateNetworkRequest{SandboxId: sb.ID, Internet: &yes}))
		if connect.CodeOf(err) != connect.CodePermissionDenied {
			t.Fatalf("switching the internet on in a no-internet subtree: %v", err)
		}
	}
}

// testE2BNetwork: E2B's network settings through the gateway, and a page
// in the sandbox through the host E2B's getHost builds.
func testE2BNetwork(t *testing.T, c *e2e.Cluster, in *internet) {
	key := e2bKey(t, c)
	ctl := map[string]string{"X-API-Key": key, "Content-Type": "application/json"}
	gw := c.GatewayURL
	// What has no OpenDsec form is refused with the field named.
	e2e.Do(t, "POST", gw+"/v2/sandboxes", ctl, strings.NewReader(`{"templateID":"base","network":{"denyOut":["1.2.3.0/24"]}}`)).ErrorBody(t, 400, "network.denyOut[0]")
	e2e.Do(t, "POST", gw+"/v2/sandboxes", ctl, strings.NewReader(`{"templateID":"base","network":{"allowOut":["10.0.0.0/33"]}}`)).ErrorBody(t, 400, "network.rules[0]")

	made := e2e.CreateE2B(t, gw, key, fmt.Sprintf(`{"templateID":"base","allow_internet_access":true,"network":{"allowOut":[%q]}}`, in.web))
	t.Cleanup(func() { e2e.Do(t, "DELETE", gw+"/sandboxes/"+made.SandboxID, ctl, nil) })
	sb := c.Client.Sandbox(made.SandboxID)
	expectProbe(t, "e2b allowOut", sb, [][2]string{{in.web + ":8080", "open"}, {in.alt + ":8080", "refused"}, {in.meta + ":80", "refused"}})
	serveIn(t, sb, "nohup python3 -m http.server 8000 >/dev/null 2>&1 &", 8000)
	var body struct {
		Domain string `json:"domain"`
	}
	e2e.Do(t, "POST", gw+"/sandboxes/"+made.SandboxID+"/connect", ctl, strings.NewReader(`{"timeout":300}`)).JSON(t, &body)
	if body.Domain == "" {
		t.Fatal("connect answered no domain")
	}
	host := "8000-" + made.SandboxID + "." + body.Domain // E2B's getHost
	if r := getHost(t, gw, host, ""); r.Status != 200 || !strings.Contains(string(r.Body), "Directory listing") {
		t.Fatalf("GET through the sandbox host %s: %d %.200s", host, r.Status, r.Body)
	}
	// A request body still streaming when the answer began (gateway too).
	serveIn(t, sb, e2e.ServeEarlyAnswerCmd("8001"), 8001)
	e2e.PostAfterAnswer(t, e2e.HTTPClient, gw+"/", "8001-"+made.SandboxID+"."+body.Domain)
	// The egress settings replaced at runtime (E2B's updateNetwork).
	if r := e2e.Do(t, "PUT", gw+"/sandboxes/"+made.SandboxID+"/network", ctl, strings.NewReader(fmt.Sprintf(`{"denyOut":["0.0.0.0/0"],"allowOut":[%q]}`, in.alt))); r.Status != 204 {
		t.Fatalf("update network: %d %s", r.Status, r.Body)
	}
	expectProbe(t, "e2b after update", sb, [][2]string{{in.web + ":8080", "refused"}, {in.alt + ":8080", "open"}})

	// Without public traffic the host needs the traffic access token.
	var private struct {
		SandboxID          string `json:"sandboxID"`
		TrafficAccessToken string `json:"trafficAccessToken"`
	}
	r := e2e.Do(t, "POST", gw+"/v2/sandboxes", ctl, strings.NewReader(`{"templateID":"base","network":{"allowPublicTraffic":false}}`))
	r.JSON(t, &private)
	if r.Status != 201 || private.TrafficAccessToken == "" {
		t.Fatalf("create without public traffic: %d %s", r.Status, r.Body)
	}
	t.Cleanup(func() { e2e.Do(t, "DELETE", gw+"/sandboxes/"+private.SandboxID, ctl, nil) })
	psb := c.Client.Sandbox(private.SandboxID)
	serveIn(t, psb, "nohup python3 -m http.server 8000 >/dev/null 2>&1 &", 8000)
	phost := "8000-" + private.SandboxID + "." + body.Domain
	if r := getHost(t, gw, phost, ""); r.Status != 403 {
		t.Fatalf("GET without the traffic token: %d %.200s", r.Status, r.Body)
	}
	if r := getHost(t, gw, phost, "wrong"); r.Status != 403 {
		t.Fatalf("GET with a wrong traffic token: %d %.200s", r.Status, r.Body)
	}
	if r := getHost(t, gw, phost, private.TrafficAccessToken); r.Status != 200 {
		t.Fatalf("GET with the traffic token: %d %.200s", r.Status, r.Body)
	}
	// Once killed, its host answers as E2B's proxy does.
	e2e.Do(t, "DELETE", gw+"/sandboxes/"+private.SandboxID, ctl, nil)
	r = getHost(t, gw, phost, private.TrafficAccessToken)
	var gone apiErrorBody
	if json.Unmarshal(r.Body, &gone); r.Status != 502 || gone.Code != 502 || gone.Message != "The sandbox was not found" || gone.SandboxID != private.SandboxID {
		t.Fatalf("GET of a killed sandbox's host: %d %s", r.Status, r.Body)
	}
}

// apiErrorBody is E2B's error body.
type apiErrorBody struct {
	SandboxID string `json:"sandboxId"`
	Code      int    `json:"code"`
	Message   string `json:"message"`
}

// getHost GETs / from a sandbox host (E2B's getHost) at the gateway gw,
// with a traffic access token if not empty.
func getHost(t *testing.T, gw, host, token string) e2e.HTTPResult {
	t.Helper()
	req, _ := http.NewRequest("GET", gw+"/", nil)
	req.Host = host
	if token != "" {
		req.Header.Set("E2b-Traffic-Access-Token", token)
	}
	resp, err := e2e.HTTPClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", host, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return e2e.HTTPResult{Status: resp.StatusCode, Body: b, Header: resp.Header}
}

// e2bKey is the cluster's API key in E2B's format.
func e2bKey(t *testing.T, c *e2e.Cluster) string {
	t.Helper()
	data, err := os.ReadFile(c.ClientEnv)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "export E2B_API_KEY="); ok {
			return v
		}
	}
	t.Fatal("client.env has no E2B_API_KEY")
	return ""
}

func testNetworkOn(t *testing.T, c *e2e.Cluster, in *internet, backend string, nodePort int) {
	// One bound for all of it: a dozen creates and probes, which on microvm
	// under TCG on a busy machine took 128 s (Ctx's 2 minutes ran out).
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	create := func(p *sandboxv1.NetworkPolicy) *client.Sandbox {
		t.Helper()
		sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: "root/py:3.11", Network: p})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Stop(context.Background()) }) //nolint:errcheck // best effort
		return sb
	}
	get := func(sb *client.Sandbox) *sandboxv1.Sandbox {
		t.Helper()
		resp, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID}))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Msg.Sandbox
	}
	pip := "python3 -m pip install -q --disable-pip-version-check --no-cache-dir --timeout 3 --retries 0 --target /tmp/site " +
		"--index-url http://pypi.test.example:8080/simple --trusted-host pypi.test.example " + pkgName +
		" && PYTHONPATH=/tmp/site python3 -c 'import " + pkgName + "; print(" + pkgName + ".VALUE)'"

	// pip install from an allowed index.
	withIndex := create(&sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{rule("pypi.test.example", "", "tcp", "8080")}})
	r := e2e.Shell(t, withIndex, pip)
	if r.ExitCode != 0 || strings.TrimSpace(string(r.Stdout)) != pkgValue {
		t.Fatalf("pip install from the allowed index: exit %d, %q %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	// The allowed name resolves; others do not, and an address no allowed
	// name was answered with is refused; the node, the metadata address
	// and the node's services are closed.
	expectProbe(t, "allowed domain", withIndex, [][2]string{
		{"pypi.test.example", in.web},
		{"www.test.example", "unresolved"},
		{"blocked.test.example", "unresolved"},
		{in.web + ":8080", "open"},
		{in.alt + ":8080", "refused"},
		{in.meta + ":80", "refused"},
		{fmt.Sprintf("%s:%d", in.node, nodePort), "refused"},
	})

	// Without the rule, pip fails cleanly.
	bare := create(&sandboxv1.NetworkPolicy{})
	r = e2e.Shell(t, bare, pip)
	if r.ExitCode == 0 || strings.Contains(string(r.Stdout), pkgValue) {
		t.Fatalf("pip install without a rule succeeded: %q", r.Stdout)
	}
	expectProbe(t, "no rules", bare, [][2]string{{"pypi.test.example", "unresolved"}, {in.web + ":8080", "refused"}})

	// A CIDR rule added at runtime opens exactly that address and port;
	// removed, it closes new connections.
	update := func(req *sandboxv1.UpdateNetworkRequest) *sandboxv1.Sandbox {
		t.Helper()
		req.SandboxId = bare.ID
		resp, err := c.Client.Sandboxes.UpdateNetwork(ctx, connect.NewRequest(req))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Msg.Sandbox
	}
	got := update(&sandboxv1.UpdateNetworkRequest{Add: []*sandboxv1.NetworkRule{rule("", in.alt, "tcp", "8080")}})
	if rs := got.Spec.Network.Rules; len(rs) != 1 || rs[0].Cidr != in.alt+"/32" {
		t.Fatalf("policy after the add: %v", got.Spec.Network)
	}
	expectProbe(t, "cidr added", bare, [][2]string{{in.alt + ":8080", "open"}, {in.alt + ":8081", "refused"}, {in.web + ":8080", "refused"}})
	update(&sandboxv1.UpdateNetworkRequest{Remove: []*sandboxv1.NetworkRule{rule("", in.alt+"/32", "tcp", "8080")}})
	expectProbe(t, "cidr removed", bare, [][2]string{{in.alt + ":8080", "refused"}})

	// A rule naming the metadata service or the node itself is refused,
	// at create and in an update, naming the operator's setting.
	for _, closed := range []string{in.meta, in.node} {
		closedRule := []*sandboxv1.NetworkRule{rule("", closed, "tcp", "80")}
		_, err := c.Client.Sandboxes.UpdateNetwork(ctx, connect.NewRequest(&sandboxv1.UpdateNetworkRequest{SandboxId: bare.ID, Add: closedRule}))
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), sandboxnet.AllowClosedFlag) {
			t.Errorf("an update opening %s: %v, want invalid argument naming %s", closed, err, sandboxnet.AllowClosedFlag)
		}
		_, err = c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: "root/py:3.11", Network: &sandboxv1.NetworkPolicy{Rules: closedRule}})
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), sandboxnet.AllowClosedFlag) {
			t.Errorf("a create opening %s: %v, want invalid argument naming %s", closed, err, sandboxnet.AllowClosedFlag)
		}
	}
	expectProbe(t, "closed rules refused", bare, [][2]string{{in.meta + ":80", "refused"}})

	// The internet shorthand opens public addresses only: none of these.
	v := true
	update(&sandboxv1.UpdateNetworkRequest{Internet: &v})
	// Another sandbox, serving on a port, is closed to it too.
	other := create(&sandboxv1.NetworkPolicy{})
	serveIn(t, other, "nohup python3 -m http.server 9000 >/dev/null 2>&1 &", 9000)
	otherAddr := get(other).NetworkAddress
	expectProbe(t, "internet", bare, [][2]string{
		{in.web + ":8080", "refused"},
		{in.meta + ":80", "refused"},
		{fmt.Sprintf("%s:%d", in.node, nodePort), "refused"},
		{otherAddr + ":9000", "refused"},
	})
	testInbound(t, c, other, create(&sandboxv1.NetworkPolicy{AllowPublicTraffic: true}))
	testAddressReuse(t, create, get)
	testStreamCutWhenStopped(t, create(&sandboxv1.NetworkPolicy{}))

	// A request to a paused sandbox's port resumes it.
	if _, err := c.Client.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: other.ID})); err != nil {
		t.Fatal(err)
	}
	resp, err := other.PortClient().Get(other.PortURL(9000))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET of a paused sandbox's port: %v %v", resp, err)
	}
	resp.Body.Close()
	if st := get(other).State; st != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after a request to its port the sandbox is %v", st)
	}
}

// streamServer answers a GET with one chunk, "first", and then nothing,
// the connection held open.
const streamServer = `
import http.server, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b"5\r\nfirst\r\n")
        self.wfile.flush()
        time.sleep(3600)
http.server.ThreadingHTTPServer(("0.0.0.0", 9001), H).serve_forever()
`

// testStreamCutWhenStopped: a response still streaming from a port ends
// when its sandbox is removed. gVisor's and a VM's network stacks end
// without a FIN, so the edge's connection used to wait for TCP's keepalive
// (about 150 s; an E2B Code Interpreter cell of a killed sandbox hung that
// long). The bound below is that wait's fifth, not a speed target.
func testStreamCutWhenStopped(t *testing.T, sb *client.Sandbox) {
	t.Helper()
	serveIn(t, sb, "cat > /tmp/stream.py <<'EOF'\n"+streamServer+"EOF\nnohup python3 /tmp/stream.py >/dev/null 2>&1 &", 9001)
	resp, err := sb.PortClient().Get(sb.PortURL(9001))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first := make([]byte, 5)
	if _, err := io.ReadFull(resp.Body, first); err != nil || string(first) != "first" {
		t.Fatalf("the stream's first chunk: %q %v (status %d)", first, err, resp.StatusCode)
	}
	rest := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, resp.Body)
		rest <- err
	}()
	if err := sb.Stop(e2e.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-rest:
		if err == nil {
			t.Fatalf("the stream of a removed sandbox ended as if complete")
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the stream of sandbox %s was still open 30 s after it was removed", sb.ID)
	}
}

// keepAliveServer answers every POST with the sandbox's hostname (its id)
// and keeps the connection open (HTTP/1.1).
const keepAliveServer = `
import http.server, socket
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = socket.gethostname().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 9000), H).serve_forever()
`

// testAddressReuse: a removed sandbox's address goes to a later one, and
// the edge's kept connections to the removed one are not used for it (a
// POST, which is not retried, got "connection reset by peer").
func testAddressReuse(t *testing.T, create func(*sandboxv1.NetworkPolicy) *client.Sandbox, get func(*client.Sandbox) *sandboxv1.Sandbox) {
	t.Helper()
	post := func(sb *client.Sandbox) string {
		t.Helper()
		resp, err := sb.PortClient().Post(sb.PortURL(9000), "text/plain", strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			t.Fatalf("POST to %s's port 9000 (address %s): %d %.300s", sb.ID, get(sb).NetworkAddress, resp.StatusCode, body)
		}
		return string(body)
	}
	serve := "cat > /tmp/ka.py <<'EOF'\n" + keepAliveServer + "\nEOF\nnohup python3 /tmp/ka.py >/dev/null 2>&1 &"
	old := create(&sandboxv1.NetworkPolicy{})
	serveIn(t, old, serve, 9000)
	if got := post(old); got != old.ID {
		t.Fatalf("POST answered by %q, want %s", got, old.ID)
	}
	addr := get(old).NetworkAddress
	if err := old.Stop(e2e.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	// Addresses are handed out lowest first: within a few creates one
	// gets the freed address.
	for i := 0; ; i++ {
		sb := create(&sandboxv1.NetworkPolicy{})
		if get(sb).NetworkAddress != addr {
			if i == 8 {
				t.Fatalf("no new sandbox got the freed address %s", addr)
			}
			continue
		}
		serveIn(t, sb, serve, 9000)
		if got := post(sb); got != sb.ID {
			t.Fatalf("POST to the new sandbox on %s answered by %q, want %s", addr, got, sb.ID)
		}
		return
	}
}

// wsEchoServer is a WebSocket echo server in Python's standard library:
// it answers the handshake and echoes one text frame per connection.
const wsEchoServer = `
import base64, hashlib, socketserver
G = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
class H(socketserver.StreamRequestHandler):
    def handle(self):
        key = None
        while True:
            line = self.rfile.readline().strip()
            if not line: break
            k, _, v = line.partition(b":")
            if k.lower() == b"sec-websocket-key": key = v.strip()
        acc = base64.b64encode(hashlib.sha1(key + G).digest())
        self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
        b0, b1 = self.rfile.read(2)
        n = b1 & 127
        mask = self.rfile.read(4)
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(self.rfile.read(n)))
        out = b"echo:" + data
        self.wfile.write(bytes([0x81, len(out)]) + out)
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", 9001), H).serve_forever()
`

// testInbound: HTTP, WebSocket and a port tunnel reach servers in a
// sandbox through the apiserver with the key, and not without it unless
// the sandbox is public; a paused sandbox is resumed by a request.
func testInbound(t *testing.T, c *e2e.Cluster, sb *client.Sandbox, public *client.Sandbox) {
	t.Helper()
	ctx := e2e.Ctx(t)
	serveIn(t, sb, "cat > /tmp/ws.py <<'EOF'\n"+wsEchoServer+"\nEOF\nnohup python3 /tmp/ws.py >/tmp/ws.log 2>&1 &", 9001)
	get := func(hc *http.Client, url string) (int, string) {
		t.Helper()
		resp, err := hc.Get(url)
		if err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// The server from the earlier step listens on 9000 (http.server).
	if code, body := get(sb.PortClient(), sb.PortURL(9000)); code != 200 || !strings.Contains(body, "Directory listing") {
		t.Fatalf("GET through the apiserver with the key: %d %.200s", code, body)
	}
	// A request body still streaming when the answer began (apiserver, edge).
	serveIn(t, sb, e2e.ServeEarlyAnswerCmd("9002"), 9002)
	e2e.PostAfterAnswer(t, sb.PortClient(), sb.PortURL(9002), "")
	if code, body := get(http.DefaultClient, sb.PortURL(9000)); code != http.StatusUnauthorized || !strings.Contains(body, "API key") {
		t.Fatalf("GET without a key: %d %.200s", code, body)
	}
	req, _ := http.NewRequest("GET", sb.PortURL(9000), nil)
	req.Header.Set("X-API-Key", "dsec_not-a-key")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("GET with a wrong key: %v %v", resp, err)
	}
	if code, body := get(sb.PortClient(), sb.PortURL(9999)); code != http.StatusServiceUnavailable || !strings.Contains(body, "nothing listens") {
		t.Fatalf("GET of a port nothing listens on: %d %.200s", code, body)
	}
	// A public sandbox answers without a key.
	serveIn(t, public, "nohup python3 -m http.server 9000 >/dev/null 2>&1 &", 9000)
	if code, body := get(http.DefaultClient, public.PortURL(9000)); code != 200 || !strings.Contains(body, "Directory listing") {
		t.Fatalf("GET of a public sandbox without a key: %d %.200s", code, body)
	}

	// WebSocket, by hand: the handshake and one frame each way.
	u, _ := url.Parse(sb.PortURL(9001))
	conn, err := net.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second)) //nolint:errcheck // a net.Conn
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: %s\r\nX-API-Key: %s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", u.RequestURI(), u.Host, c.Key)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols || resp.Header.Get("Sec-WebSocket-Accept") != "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" {
		t.Fatalf("WebSocket handshake: %v %v", resp, err)
	}
	msg := []byte("hi")
	mask := []byte{1, 2, 3, 4}
	frame := []byte{0x81, 0x80 | byte(len(msg))}
	frame = append(frame, mask...)
	for i, b := range msg {
		frame = append(frame, b^mask[i%4])
	}
	conn.Write(frame) //nolint:errcheck // the read below tells
	head := make([]byte, 2)
	if _, err := io.ReadFull(br, head); err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, head[1]&127)
	if _, err := io.ReadFull(br, payload); err != nil || string(payload) != "echo:hi" {
		t.Fatalf("WebSocket echo: %q %v", payload, err)
	}

	// A raw TCP tunnel (dsec port-forward's).
	tc, err := sb.DialPort(ctx, 9000)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprint(tc, "GET / HTTP/1.0\r\n\r\n")
	got, _ := io.ReadAll(tc)
	tc.Close()
	if !strings.HasPrefix(string(got), "HTTP/1.0 200") {
		t.Fatalf("through the tunnel: %.200q", got)
	}
}

// heldServer keeps a random value in memory and serves it on 9000.
const heldServer = `
import http.server, random
value = str(random.getrandbits(48)).encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(value)
    def log_message(self, *a): pass
http.server.HTTPServer(("0.0.0.0", 9000), H).serve_forever()
`

// heldBody GETs the held server's port 9000 of sb through the API and
// returns its body; when says what the test was doing, for its failure.
func heldBody(t *testing.T, sb *client.Sandbox, when string) string {
	t.Helper()
	resp, err := sb.PortClient().Get(sb.PortURL(9000))
	if err != nil {
		t.Fatalf("%s: GET %s:9000: %v", when, sb.ID, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: GET %s:9000: %d %s", when, sb.ID, resp.StatusCode, b)
	}
	return string(b)
}

// heldServing creates a gVisor sandbox allowed to reach in.web:8080 that
// serves a value held in its memory on port 9000 (heldServer).
func heldServing(t *testing.T, c *e2e.Cluster, in *internet, backend string) *client.Sandbox {
	t.Helper()
	sb, err := c.Client.Create(e2e.Ctx(t), &sandboxv1.SandboxSpec{Backend: backend, Image: "root/py:3.11", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 1024},
		Network: &sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{rule("", in.web, "tcp", "8080")}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Stop(context.Background()) }) //nolint:errcheck // best effort
	serveIn(t, sb, "cat > /tmp/held.py <<'EOF'\n"+heldServer+"\nEOF\nnohup python3 /tmp/held.py >/dev/null 2>&1 &", 9000)
	return sb
}

// testOffloadWithNetwork: a networked gVisor sandbox offloaded (its memory
// to disk) comes back, woken by a request to its port, with its address,
// routes, policy and the server it ran, as it was.
func testOffloadWithNetwork(t *testing.T, c *e2e.Cluster, in *internet) {
	ctx := e2e.Ctx(t)
	sb := heldServing(t, c, in, "gvisor")
	get := func(when string) string { return heldBody(t, sb, when) }
	value := get("before the offload")
	info, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID}))
	if err != nil {
		t.Fatal(err)
	}
	addr := info.Msg.Sandbox.NetworkAddress
	for round := 1; round <= 2; round++ {
		p, err := c.Client.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: sb.ID, Depth: sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD}))
		if err != nil || p.Msg.Note != "" {
			t.Fatalf("offload %d: %v %v", round, p, err)
		}
		// The port request wakes it; the server's value is the one it
		// held in memory.
		if got := get(fmt.Sprintf("after offload %d", round)); got != value {
			t.Fatalf("after offload %d the server answers %q, want %q", round, got, value)
		}
		if out := string(e2e.Shell(t, sb, "ip -4 -o addr show eth0; ip route").Stdout); !strings.Contains(out, addr+"/32") || !strings.Contains(out, "default via") {
			t.Fatalf("after offload %d the sandbox's network is %q, want eth0 with %s and a default route", round, out, addr)
		}
		expectProbe(t, fmt.Sprintf("after offload %d", round), sb, [][2]string{{in.web + ":8080", "open"}, {in.alt + ":8080", "refused"}})
	}
}

// testForkWithNetwork: a sandbox (gVisor or microVM) that has used its
// network forks; each copy has its own address, the source's policy,
// working egress, the source's memory and its listening port reachable
// from outside (a microVM copy's guest takes its address itself).
func testForkWithNetwork(t *testing.T, c *e2e.Cluster, in *internet, backend string) {
	ctx := e2e.Ctx(t)
	src := heldServing(t, c, in, backend)
	// A connection out first: Debian's runsc could not checkpoint after one.
	expectProbe(t, "source before the fork", src, [][2]string{{in.web + ":8080", "open"}, {in.alt + ":8080", "refused"}})
	body := func(sb *client.Sandbox) string { return heldBody(t, sb, "fork") }
	value := body(src)
	resp, err := c.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 2}))
	if err != nil {
		t.Fatal(err)
	}
	addrs := map[string]bool{}
	srcInfo, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: src.ID}))
	if err != nil {
		t.Fatal(err)
	}
	addrs[srcInfo.Msg.Sandbox.NetworkAddress] = true
	for i, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			t.Fatalf("copy %d: %s %s", i, r.ErrorCode, r.ErrorMessage)
		}
		cp := c.Client.Sandbox(r.Sandbox.Id)
		t.Cleanup(func() { cp.Stop(context.Background()) }) //nolint:errcheck // best effort
		if a := r.Sandbox.NetworkAddress; a == "" || addrs[a] {
			t.Fatalf("copy %d has address %q; taken: %v", i, a, addrs)
		}
		addrs[r.Sandbox.NetworkAddress] = true
		if rs := r.Sandbox.Spec.GetNetwork().GetRules(); len(rs) != 1 || rs[0].Cidr != in.web+"/32" {
			t.Fatalf("copy %d's policy: %v", i, r.Sandbox.Spec.GetNetwork())
		}
		expectProbe(t, fmt.Sprintf("copy %d", i), cp, [][2]string{{in.web + ":8080", "open"}, {in.alt + ":8080", "refused"}})
		if got := body(cp); got != value {
			t.Fatalf("copy %d serves %q, the source served %q: memory not carried", i, got, value)
		}
	}
	// The source runs on, with its network.
	expectProbe(t, "source after the fork", src, [][2]string{{in.web + ":8080", "open"}})
	if got := body(src); got != value {
		t.Fatalf("the source serves %q after the fork, %q before", got, value)
	}
	// A snapshot restored later comes back the same way.
	snap, err := c.Client.Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: src.ID}))
	if err != nil {
		t.Fatal(err)
	}
	restored, err := c.Client.Sandboxes.RestoreSnapshot(ctx, connect.NewRequest(&sandboxv1.RestoreSnapshotRequest{SnapshotId: snap.Msg.Snapshot.Id}))
	if err != nil {
		t.Fatal(err)
	}
	rs := c.Client.Sandbox(restored.Msg.Sandbox.Id)
	t.Cleanup(func() { rs.Stop(context.Background()) }) //nolint:errcheck // best effort
	if a := restored.Msg.Sandbox.NetworkAddress; a == "" || addrs[a] {
		t.Fatalf("the restored sandbox has address %q; taken: %v", a, addrs)
	}
	expectProbe(t, "restored", rs, [][2]string{{in.web + ":8080", "open"}, {in.alt + ":8080", "refused"}})
	if got := body(rs); got != value {
		t.Fatalf("the restored sandbox serves %q, the source %q", got, value)
	}
}

// testPoolWithNetwork: a warm pool of sandboxes with a network (dsec pool
// set --network) waits with a policy that lets nothing out; a create with
// a policy claims one and gets exactly that policy; a create without a
// network does not claim it.
func testPoolWithNetwork(t *testing.T, c *e2e.Cluster, in *internet) {
	ctx := e2e.Ctx(t)
	res := &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 256}
	if _, err := c.Client.SetPool(ctx, "root/py:3.11", "container", res, true, 1); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Client.SetPool(context.Background(), "root/py:3.11", "container", res, true, 0) }) //nolint:errcheck // best effort
	waitReady := func() []string {
		t.Helper()
		for deadline := time.Now().Add(2 * time.Minute); c.Edge.PoolReady() != 1; time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the networked pool holds %d ready, want 1", c.Edge.PoolReady())
			}
		}
		return c.Edge.PoolSandboxes()
	}
	pooled := waitReady()
	plain, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11", Resources: res})
	if err != nil || slices.Contains(pooled, plain.ID) {
		t.Fatalf("a create without a network: %v, or it claimed the networked pool's %v", err, pooled)
	}
	plain.Stop(ctx) //nolint:errcheck // best effort
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11", Resources: res,
		Network: &sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{rule("", in.web, "tcp", "8080")}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Stop(context.Background()) }) //nolint:errcheck // best effort
	if !slices.Contains(pooled, sb.ID) {
		t.Fatalf("a create with a network made %s, not the pool's %v", sb.ID, pooled)
	}
	expectProbe(t, "a claimed networked pool sandbox", sb, [][2]string{{in.web + ":8080", "open"}, {in.web + ":8081", "refused"}, {in.alt + ":8080", "refused"}})
	// The pool's next one gets its own claim's policy, nothing of the
	// first's.
	next := waitReady()
	sb2, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11", Resources: res,
		Network: &sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{rule("", in.alt, "tcp", "8080")}}})
	if err != nil || !slices.Contains(next, sb2.ID) {
		t.Fatalf("the second networked claim: %v (pool %v)", err, next)
	}
	t.Cleanup(func() { sb2.Stop(context.Background()) }) //nolint:errcheck // best effort
	expectProbe(t, "the second claim", sb2, [][2]string{{in.alt + ":8080", "open"}, {in.web + ":8080", "refused"}})
}
