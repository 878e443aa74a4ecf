package network

import (
	"archive/zip"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// The network tests run in a node of their own: the test binary runs
// again inside a network namespace it made, so the cluster, its sandboxes
// and the small internet below share no route with the machine, and no
// packet can leave it whatever the code under test does.

// nodeNSEnv names the namespace the child runs in.
const nodeNSEnv = "DSEC_E2E_NODE_NS"

// inOwnNode reports whether the test runs in its own node namespace. If
// not, it runs the test (name) again in a new one, reports its result
// and returns false: the caller returns at once.
func inOwnNode(t *testing.T) bool {
	t.Helper()
	if os.Getenv(nodeNSEnv) != "" {
		return true
	}
	if os.Geteuid() != 0 {
		testutil.Missing(t, "network tests need root (network namespaces, nftables)")
		return false
	}
	for _, tool := range []string{"ip", "nft", "unshare", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			testutil.Missing(t, "network tests need %s: %v", tool, err)
			return false
		}
	}
	ns := "dsect-node-" + randHex(3)
	run(t, "ip", "netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() }) //nolint:errcheck // best effort
	run(t, "ip", "-n", ns, "link", "set", "lo", "up")
	deadline, ok := t.Deadline()
	timeout := 15 * time.Minute
	if ok {
		timeout = time.Until(deadline) - 10*time.Second
	}
	// nsenter, not ip netns exec: that remounts /sys for the namespace,
	// which hides the cgroup hierarchies the runtimes need.
	cmd := exec.Command("nsenter", "--net=/var/run/netns/"+ns, "--", os.Args[0], "-test.run", "^"+t.Name()+"$", "-test.v", "-test.count=1", "-test.timeout="+timeout.String())
	cmd.Env = append(os.Environ(), nodeNSEnv+"="+ns)
	out, err := cmd.CombinedOutput()
	t.Logf("in its own node namespace %s:\n%s", ns, out)
	if err != nil {
		t.Fatalf("the test failed in its own node namespace: %v", err)
	}
	return false
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b) //nolint:errcheck // crypto/rand does not fail on Linux
	return hex.EncodeToString(b)
}

func run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// internet is the test's own small internet, one namespace joined to the
// node by a veth: web servers, a DNS zone and a Python package index.
type internet struct {
	ns   string
	node string // the node's address on the link (one of its own addresses)
	web  string // 10.251.0.2: DNS, the package index and a page on :8080
	alt  string // 10.251.0.3: pages on :8080 and :8081
	meta string // 169.254.169.254, a metadata service's address, on :80
	// names maps the zone's names to addresses.
	names map[string]string
}

const (
	pkgName  = "dsecdemo"
	pkgValue = "served-by-the-test-index"
)

func newInternet(t *testing.T) *internet {
	t.Helper()
	in := &internet{ns: "dsect-inet-" + randHex(3), node: "10.251.0.1", web: "10.251.0.2", alt: "10.251.0.3", meta: "169.254.169.254"}
	in.names = map[string]string{"pypi.test.example": in.web, "www.test.example": in.web, "alt.test.example": in.alt, "blocked.test.example": in.alt}
	run(t, "ip", "netns", "add", in.ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", in.ns).Run() }) //nolint:errcheck // best effort
	run(t, "ip", "link", "add", "dsectinet0", "type", "veth", "peer", "name", "eth0", "netns", in.ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", "dsectinet0").Run() }) //nolint:errcheck // best effort
	run(t, "ip", "addr", "add", in.node+"/24", "dev", "dsectinet0")
	run(t, "ip", "link", "set", "dsectinet0", "up")
	run(t, "ip", "route", "add", in.meta+"/32", "dev", "dsectinet0")
	for _, a := range []string{in.web + "/24", in.alt + "/24", in.meta + "/32"} {
		run(t, "ip", "-n", in.ns, "addr", "add", a, "dev", "eth0")
	}
	run(t, "ip", "-n", in.ns, "link", "set", "eth0", "up")
	run(t, "ip", "-n", in.ns, "link", "set", "lo", "up")
	run(t, "ip", "-n", in.ns, "route", "add", "default", "via", in.node)

	wheel, whlName := buildWheel(t)
	sum := sha256.Sum256(wheel)
	mux := http.NewServeMux()
	mux.HandleFunc("/simple/"+pkgName+"/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "<!DOCTYPE html><html><body><a href=\"/packages/%s#sha256=%x\">%s</a></body></html>\n", whlName, sum, whlName)
	})
	mux.HandleFunc("/packages/"+whlName, func(w http.ResponseWriter, r *http.Request) { w.Write(wheel) }) //nolint:errcheck // the client sees a short body
	for _, addr := range []string{in.web + ":8080", in.alt + ":8080", in.alt + ":8081", in.meta + ":80"} {
		addr := addr
		h := http.Handler(mux)
		if !strings.HasPrefix(addr, in.web) {
			h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintf(w, "page of %s", addr) })
		}
		in.listen(t, "tcp", addr, func(l net.Listener) { go http.Serve(l, h) }) //nolint:errcheck // ends with the listener
	}
	zone := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		name := strings.TrimSuffix(strings.ToLower(q.Question[0].Name), ".")
		a, ok := in.names[name]
		switch {
		case !ok:
			m.Rcode = dns.RcodeNameError
		case q.Question[0].Qtype == dns.TypeA:
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: net.ParseIP(a)})
		}
		w.WriteMsg(m) //nolint:errcheck // the client retries
	})
	var pc net.PacketConn
	if err := sandboxnet.InNetNS(in.path(), func() (err error) { pc, err = net.ListenPacket("udp", in.web+":53"); return err }); err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: zone}
	go srv.ActivateAndServe()            //nolint:errcheck // ends at shutdown
	t.Cleanup(func() { srv.Shutdown() }) //nolint:errcheck // best effort
	return in
}

func (in *internet) path() string { return filepath.Join("/var/run/netns", in.ns) }

// listen makes a listener inside the internet namespace and serves it.
func (in *internet) listen(t *testing.T, network, addr string, serve func(net.Listener)) {
	t.Helper()
	var l net.Listener
	if err := sandboxnet.InNetNS(in.path(), func() (err error) { l, err = net.Listen(network, addr); return err }); err != nil {
		t.Fatalf("listen on %s in %s: %v", addr, in.ns, err)
	}
	t.Cleanup(func() { l.Close() })
	serve(l)
}

// buildWheel makes a pure-Python wheel of package dsecdemo.
func buildWheel(t *testing.T) ([]byte, string) {
	t.Helper()
	files := []struct{ name, body string }{
		{pkgName + "/__init__.py", fmt.Sprintf("VALUE = %q\n", pkgValue)},
		{pkgName + "-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: " + pkgName + "\nVersion: 0.1\n"},
		{pkgName + "-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: opendsec-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"},
	}
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	var record strings.Builder
	for _, f := range files {
		w, err := zw.Create(f.name)
		if err != nil {
			t.Fatal(err)
		}
		w.Write([]byte(f.body)) //nolint:errcheck // a bytes.Buffer
		sum := sha256.Sum256([]byte(f.body))
		fmt.Fprintf(&record, "%s,sha256=%s,%d\n", f.name, base64.RawURLEncoding.EncodeToString(sum[:]), len(f.body))
	}
	record.WriteString(pkgName + "-0.1.dist-info/RECORD,,\n")
	w, _ := zw.Create(pkgName + "-0.1.dist-info/RECORD")
	w.Write([]byte(record.String())) //nolint:errcheck // a bytes.Buffer
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), pkgName + "-0.1-py3-none-any.whl"
}

// probeScript prints, for each HOST:PORT argument, how a TCP connection to
// it ends, and for each NAME argument (no colon) what it resolves to.
const probeScript = `
import socket, sys
out = []
for a in sys.argv[1:]:
    if ":" not in a:
        try: out.append(socket.gethostbyname(a))
        except OSError: out.append("unresolved")
        continue
    h, p = a.rsplit(":", 1)
    try:
        socket.create_connection((h, int(p)), 3).close(); out.append("open")
    except ConnectionRefusedError: out.append("refused")
    except socket.timeout: out.append("timeout")
    except OSError as e: out.append("error-%d" % e.errno)
print(" ".join(out))
`

// probe runs probeScript in sb and returns one result per target.
func probe(t *testing.T, sb *client.Sandbox, targets ...string) []string {
	t.Helper()
	args := append([]string{"python3", "-c", probeScript}, targets...)
	r, err := sb.Run(e2e.Ctx(t), &agentv1.ProcessConfig{Args: args})
	if err != nil || r.ExitCode != 0 {
		t.Fatalf("probe %v: %v (exit %d): %s", targets, err, r.GetExitCode(), r.GetStderr())
	}
	return strings.Fields(string(r.Stdout))
}

// expectProbe checks probe's results against want (target → result).
func expectProbe(t *testing.T, step string, sb *client.Sandbox, want [][2]string) {
	t.Helper()
	targets := make([]string, len(want))
	for i, w := range want {
		targets[i] = w[0]
	}
	got := probe(t, sb, targets...)
	for i, w := range want {
		if i >= len(got) || got[i] != w[1] {
			t.Errorf("%s: %s gave %v, want %s (all: %v)", step, w[0], at(got, i), w[1], got)
		}
	}
}

func at(s []string, i int) string {
	if i < len(s) {
		return s[i]
	}
	return "(nothing)"
}

func rule(domain, cidr, proto string, ports ...string) *sandboxv1.NetworkRule {
	return &sandboxv1.NetworkRule{Domain: domain, Cidr: cidr, Protocol: proto, Ports: ports}
}

// serveIn starts command (a server left in the background) in sb and
// waits up to 30 s for something to listen on port there.
func serveIn(t *testing.T, sb *client.Sandbox, command string, port int) {
	t.Helper()
	e2e.Shell(t, sb, command)
	for deadline := time.Now().Add(30 * time.Second); probe(t, sb, fmt.Sprintf("127.0.0.1:%d", port))[0] != "open"; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on port %d of %s after 30 s", port, sb.ID)
		}
	}
}
