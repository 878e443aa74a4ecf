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

func TestChooseTakesTheNextFreeSubnetAndPrefix(t *testing.T) {
	node := "yc6vww42"
	first := Choice{Subnet: defaultSubnet(node), IfPrefix: "syc"}
	eth := hostIf{Name: "eth0", Addrs: []netip.Prefix{netip.MustParsePrefix("192.0.2.10/24")}}
	got, err := choose(node, netip.Prefix{}, Choice{}, nil, []hostIf{eth}, nil)
	if err != nil || got != first {
		t.Fatalf("alone on the machine: %+v, %v; want the id's own %+v", got, err, first)
	}
	// Another node's veths hold the gateway of the same /20 and start
	// with the same prefix (the CI failure: 10.64.208.1/32 on syndf…).
	other := hostIf{Name: "syc0123456789ab", Addrs: []netip.Prefix{netip.PrefixFrom(first.Subnet.Addr().Next(), 32)}}
	got, err = choose(node, netip.Prefix{}, Choice{}, nil, []hostIf{eth, other}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got.Subnet != subnetSlot(node, 1) || got.IfPrefix == "syc" || len(got.IfPrefix) != 3 || got.IfPrefix[0] != 's' {
		t.Errorf("beside another node on its defaults: %+v, want the next /20 %s and another s?? prefix", got, subnetSlot(node, 1))
	}
	if err := check(got, nil, []hostIf{eth, other}, nil); err != nil {
		t.Errorf("the choice fails its own check: %v", err)
	}
}

func TestChooseKeepsWhatItsSandboxesUse(t *testing.T) {
	node := "yc6vww42"
	kept := Choice{Subnet: subnetSlot(node, 3), IfPrefix: "sq7"}
	veth := hostIf{Name: ifNameFor("sq7", "yc6vww42-sb1"), Addrs: []netip.Prefix{netip.PrefixFrom(kept.Subnet.Addr().Next(), 32)}}
	got, err := choose(node, netip.Prefix{}, kept, []string{"yc6vww42-sb1"}, []hostIf{veth}, nil)
	if err != nil || got != kept {
		t.Errorf("restart with its sandbox's veth: %+v, %v; want what it kept %+v", got, err, kept)
	}
	// A node of a release that kept nothing has its sandboxes on the id's defaults.
	legacy := Choice{Subnet: defaultSubnet(node), IfPrefix: "syc"}
	old := hostIf{Name: ifNameFor("syc", "yc6vww42-sb1"), Addrs: []netip.Prefix{netip.PrefixFrom(legacy.Subnet.Addr().Next(), 32)}}
	if got, err := choose(node, netip.Prefix{}, Choice{}, []string{"yc6vww42-sb1"}, []hostIf{old}, nil); err != nil || got != legacy {
		t.Errorf("upgrade of a node with sandboxes and nothing kept: %+v, %v; want the defaults %+v", got, err, legacy)
	}
	// Nothing of its own uses what it kept and another took it: anew.
	taker := hostIf{Name: "br0", Addrs: []netip.Prefix{netip.PrefixFrom(kept.Subnet.Addr(), 24)}}
	got, err = choose(node, netip.Prefix{}, kept, nil, []hostIf{taker}, nil)
	if err != nil || got.Subnet == kept.Subnet || got.Subnet.Overlaps(taker.Addrs[0]) {
		t.Errorf("kept subnet taken, no sandbox: %+v, %v; want another subnet", got, err)
	}
	// Its sandboxes use it and another took it: a clear error, nothing moved.
	_, err = choose(node, netip.Prefix{}, kept, []string{"yc6vww42-sb1"}, []hostIf{veth, taker}, nil)
	if err == nil || !strings.Contains(err.Error(), "overlaps "+taker.Addrs[0].String()+" on the node's interface br0") {
		t.Errorf("kept subnet taken under running sandboxes: %v, want the overlap named", err)
	}
}

func TestChooseHonoursTheOperatorsSubnet(t *testing.T) {
	node := "n1"
	want := netip.MustParsePrefix("10.200.0.0/16")
	got, err := choose(node, netip.MustParsePrefix("10.200.3.4/16"), Choice{Subnet: subnetSlot(node, 2), IfPrefix: "sn1"}, nil, nil, nil)
	if err != nil || got.Subnet != want || got.IfPrefix != "sn1" {
		t.Errorf("operator's subnet over a kept one: %+v, %v; want %s with the kept prefix", got, err, want)
	}
	eth := hostIf{Name: "eth0", Addrs: []netip.Prefix{netip.MustParsePrefix("10.200.9.1/24")}}
	if _, err := choose(node, want, Choice{}, nil, []hostIf{eth}, nil); err == nil || !strings.Contains(err.Error(), "overlaps 10.200.9.1/24 on the node's interface eth0") {
		t.Errorf("operator's subnet over the node's address: %v, want the overlap named", err)
	}
	if _, err := choose("n", netip.Prefix{}, Choice{}, nil, nil, nil); err == nil || !strings.Contains(err.Error(), "at least 2 characters") {
		t.Errorf("a one-character node id: %v", err)
	}
}

func TestTheChoiceIsKeptAndReadBack(t *testing.T) {
	path := filepath.Join(t.TempDir(), "network.json")
	if c, err := readChoice(path); err != nil || c != (Choice{}) {
		t.Fatalf("no file: %+v, %v; want nothing kept", c, err)
	}
	want := Choice{Subnet: netip.MustParsePrefix("10.77.16.0/20"), IfPrefix: "s4x"}
	if err := keepChoice(path, want); err != nil {
		t.Fatal(err)
	}
	if got, err := readChoice(path); err != nil || got != want {
		t.Errorf("read back %+v, %v; want %+v", got, err, want)
	}
	for _, bad := range []string{`{`, `{"subnet":"10.0.0.0/20","if_prefix":"s-x"}`, `{"subnet":"::/64","if_prefix":"sx"}`, `{"if_prefix":"sx"}`} {
		if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := readChoice(path); err == nil || !strings.Contains(err.Error(), "remove it to choose anew") {
			t.Errorf("%s: %v, want an error saying how to recover", bad, err)
		}
	}
}

func TestChooseStepsAroundClaimsOfOtherTables(t *testing.T) {
	node := "yc6vww42"
	claimed := []Choice{{Subnet: subnetSlot(node, 0), IfPrefix: "syc"}, {Subnet: netip.MustParsePrefix("10.64.0.0/10").Masked(), IfPrefix: "zzz"}}
	if _, err := choose(node, netip.Prefix{}, Choice{}, nil, nil, claimed); err == nil || !strings.Contains(err.Error(), "every /20") {
		t.Errorf("every /20 claimed: %v, want an error saying so", err)
	}
	got, err := choose(node, netip.Prefix{}, Choice{}, nil, nil, claimed[:1])
	if err != nil || got.Subnet != subnetSlot(node, 1) || got.IfPrefix == "syc" {
		t.Errorf("beside a table claiming the id's defaults: %+v, %v", got, err)
	}
	// A node whose sandboxes run on what another table claims is told so.
	if _, err := choose(node, netip.Prefix{}, Choice{}, []string{"yc6vww42-sb1"}, nil, claimed[:1]); err == nil || !strings.Contains(err.Error(), "another node's nftables table claims it") {
		t.Errorf("own sandboxes on a claimed prefix: %v", err)
	}
}

func TestParseClaimReadsTheNodeScriptsMasqueradeRule(t *testing.T) {
	want := Choice{Subnet: netip.MustParsePrefix("10.64.208.0/20"), IfPrefix: "syc"}
	// What `nft -t list chain` prints of NodeScript's postrouting chain.
	chain := "table inet dsec_yc6vww42 {\n\tchain postrouting {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n\t\tip saddr 10.64.208.0/20 oifname != \"syc*\" masquerade\n\t}\n}\n"
	if got, ok := parseClaim(chain); !ok || got != want {
		t.Errorf("parsed %+v, %v; want %+v", got, ok, want)
	}
	if !strings.Contains(NodeScript(Node{Table: "dsec_x", Subnet: want.Subnet, IfPrefix: want.IfPrefix}), `ip saddr 10.64.208.0/20 oifname != "syc*" masquerade`) {
		t.Error("NodeScript no longer writes the rule parseClaim reads")
	}
	for _, bad := range []string{"", "ip saddr 10.64.208.0/20 oifname != \"s-c*\" masquerade", "ip saddr fd00::/64 oifname != \"syc*\" masquerade", "ip saddr 10.64.208.0/20 oifname != \"*\" masquerade", "ip saddr nonsense oifname != \"syc*\" masquerade"} {
		if got, ok := parseClaim(bad); ok {
			t.Errorf("%q parsed as %+v", bad, got)
		}
	}
}

// parseClaim reads nft's output of tables other nodes (any release) made.
func FuzzParseClaim(f *testing.F) {
	f.Add("\t\tip saddr 10.64.208.0/20 oifname != \"syc*\" masquerade\n")
	f.Add("ip saddr 10.0.0.0/8 oifname != \"a*\" masquerade\nip saddr 1.2.3.4/32 oifname != \"b*\" masquerade")
	f.Add("ip saddr ::/0 oifname != \"\"\" masquerade")
	f.Fuzz(func(t *testing.T, chain string) {
		c, ok := parseClaim(chain)
		if !ok {
			return
		}
		if !c.Subnet.Addr().Is4() || c.IfPrefix == "" || ident(c.IfPrefix) != c.IfPrefix {
			t.Fatalf("%q parsed as %+v: want an IPv4 subnet and a prefix of letters and digits", chain, c)
		}
		if !strings.Contains(chain, c.Subnet.String()) || !strings.Contains(chain, c.IfPrefix+"*") {
			t.Fatalf("%q parsed as %+v, which it does not name", chain, c)
		}
	})
}
