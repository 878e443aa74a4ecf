package sandboxnet

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/testutil"
)

// testNet is a small network of namespaces the test makes and removes:
// nothing it sends leaves them.
type testNet struct {
	t      *testing.T
	prefix string
}

func newTestNet(t *testing.T) *testNet {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "ip")
	testutil.RequireBinary(t, "nft")
	return &testNet{t: t, prefix: fmt.Sprintf("dnp%d", os.Getpid()%100000)}
}

// ns makes a namespace with its loopback up.
func (n *testNet) ns(name string) string {
	n.t.Helper()
	full := n.prefix + name
	n.run("ip", "netns", "add", full)
	n.t.Cleanup(func() { exec.Command("ip", "netns", "del", full).Run() })
	n.in(full, "ip", "link", "set", "lo", "up")
	return full
}

func (n *testNet) run(args ...string) string {
	n.t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		n.t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func (n *testNet) in(ns string, args ...string) string {
	n.t.Helper()
	return n.run(append([]string{"ip", "netns", "exec", ns}, args...)...)
}

// nft loads a script into ns's nftables.
func (n *testNet) nft(ns, script string) error {
	cmd := exec.Command("ip", "netns", "exec", ns, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%v: %s\nscript:\n%s", err, out, script)
	}
	return nil
}

// link joins two namespaces with a veth: name a in ns a with address
// addrA, name b in ns b with addrB (CIDR forms).
func (n *testNet) link(nsA, a, addrA, nsB, b, addrB string) {
	n.t.Helper()
	n.run("ip", "link", "add", a, "netns", nsA, "type", "veth", "peer", "name", b, "netns", nsB)
	n.in(nsA, "ip", "addr", "add", addrA, "dev", a)
	n.in(nsA, "ip", "link", "set", a, "up")
	n.in(nsB, "ip", "addr", "add", addrB, "dev", b)
	n.in(nsB, "ip", "link", "set", b, "up")
}

// inNS runs fn in the test namespace ns.
func inNS(t *testing.T, ns string, fn func()) {
	t.Helper()
	if err := InNetNS(filepath.Join("/var/run/netns", ns), func() error { fn(); return nil }); err != nil {
		t.Fatal(err)
	}
}

// serve listens on addr inside ns and accepts until the test ends.
func serve(t *testing.T, ns, addr string) {
	t.Helper()
	var l net.Listener
	var err error
	inNS(t, ns, func() { l, err = net.Listen("tcp", addr) })
	if err != nil {
		t.Fatalf("listen %s in %s: %v", addr, ns, err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
}

// dial reports how a TCP connection from ns to addr ends: "ok",
// "refused", "timeout" or the error.
func dial(t *testing.T, ns, addr string) string {
	t.Helper()
	return dialFrom(t, ns, "", addr)
}

// dialFrom is dial from a given source address (empty: any).
func dialFrom(t *testing.T, ns, local, addr string) string {
	t.Helper()
	var err error
	inNS(t, ns, func() {
		d := net.Dialer{Timeout: 2 * time.Second}
		if local != "" {
			d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
		}
		var c net.Conn
		if c, err = d.Dial("tcp", addr); err == nil {
			c.Close()
		}
	})
	var ne net.Error
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return err.Error()
}
