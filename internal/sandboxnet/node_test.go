package sandboxnet

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestDefaultSubnetIsANodesOwnTwentyOfTenSixtyFour(t *testing.T) {
	// The mapping is what an upgraded node must keep: its recorded
	// sandboxes' addresses are in the subnet its name chose.
	pool := netip.MustParsePrefix("10.64.0.0/10")
	for node, want := range map[string]string{
		"eczow5px": "10.88.96.0/20", "aaaaaaaa": "10.126.208.0/20", "aaaaaaab": "10.115.64.0/20",
		"zzzzzzzz": "10.104.80.0/20", "n1": "10.64.0.0/20", "n2": "10.75.144.0/20",
	} {
		p := defaultSubnet(node)
		if p.String() != want {
			t.Errorf("node %s: subnet %s, want %s", node, p, want)
		}
		if p.Bits() != 20 || !pool.Contains(p.Addr()) || p.Masked() != p {
			t.Errorf("node %s: subnet %s, want a /20 inside %s", node, p, pool)
		}
	}
}

func TestResolvConfServersTakesIPv4NameServers(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	got, err := resolvConfServers(write("ok", "# comment\nsearch example.org\nnameserver 192.0.2.53\nnameserver 2001:db8::53\nnameserver   198.51.100.1  # second\nnameserver not-an-address\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"192.0.2.53:53", "198.51.100.1:53"}; !slices.Equal(got, want) {
		t.Errorf("servers %v, want %v", got, want)
	}
	if _, err := resolvConfServers(write("v6only", "nameserver ::1\n")); err == nil || !strings.Contains(err.Error(), "no IPv4 name server") {
		t.Errorf("a file with only IPv6 servers: %v, want an error naming the missing IPv4 server", err)
	}
	if _, err := resolvConfServers(filepath.Join(dir, "missing")); err == nil || !strings.Contains(err.Error(), "no upstream given") {
		t.Errorf("a missing file: %v, want an error saying no upstream was given", err)
	}
}
