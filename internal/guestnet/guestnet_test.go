package guestnet

import (
	"encoding/json"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/sandboxnet"
)

// testNetNS makes the network namespace name for the test (root and
// iproute2 needed), removed at its end.
func testNetNS(t *testing.T, name string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (a network namespace)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip (iproute2)")
	}
	exec.Command("ip", "netns", "del", name).Run()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	return name
}

// The guest's network setup, run in a network namespace of the test's
// own: the NIC with the given MAC comes up with its /32 address, a link
// route to the gateway and the default route through it, as the host's
// sandbox network gives them to a container.
func TestNetConfigApplies(t *testing.T) {
	ns := testNetNS(t, "dsect-vminit-net")
	if out, err := exec.Command("ip", "-n", ns, "link", "add", "eth7", "address", "02:00:0a:40:00:05", "type", "veth", "peer", "name", "peer7").CombinedOutput(); err != nil {
		t.Fatalf("veth: %v: %s", err, out)
	}
	exec.Command("ip", "-n", ns, "link", "set", "peer7", "up").Run()
	n := &Config{Address: "10.64.0.5", Gateway: "10.64.0.1", MAC: "02:00:0a:40:00:05"}
	if err := sandboxnet.InNetNS("/run/netns/"+ns, func() error {
		if err := UpLoopback(); err != nil {
			return err
		}
		return n.Apply()
	}); err != nil {
		t.Fatal(err)
	}
	show := func(args ...string) string {
		out, err := exec.Command("ip", append([]string{"-n", ns}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
		return string(out)
	}
	var addrs []struct {
		IfName   string   `json:"ifname"`
		Flags    []string `json:"flags"`
		AddrInfo []struct {
			Local     string `json:"local"`
			PrefixLen int    `json:"prefixlen"`
		} `json:"addr_info"`
	}
	json.Unmarshal([]byte(show("-j", "-4", "addr", "show")), &addrs)
	got := map[string]string{}
	for _, a := range addrs {
		for _, i := range a.AddrInfo {
			got[a.IfName] = i.Local + "/" + strconv.Itoa(i.PrefixLen)
		}
		if a.IfName == "eth7" && !strings.Contains(strings.Join(a.Flags, ","), "UP") {
			t.Errorf("eth7 is not up: %v", a.Flags)
		}
	}
	if got["eth7"] != "10.64.0.5/32" || got["lo"] != "127.0.0.1/8" {
		t.Fatalf("addresses: %v", got)
	}
	routes := show("-4", "route", "show")
	for _, want := range []string{"default via 10.64.0.1 dev eth7", "10.64.0.1 dev eth7"} {
		if !strings.Contains(routes, want) {
			t.Fatalf("routes lack %q:\n%s", want, routes)
		}
	}
	// Errors name what is wrong.
	for _, bad := range []*Config{
		{Address: "x", Gateway: "10.64.0.1", MAC: n.MAC},
		{Address: "10.64.0.6", Gateway: "10.64.0.1", MAC: "02:00:00:00:00:99"},
	} {
		err := sandboxnet.InNetNS("/run/netns/"+ns, bad.Apply)
		if err == nil || !(strings.Contains(err.Error(), "address \"x\"") || strings.Contains(err.Error(), "no interface has MAC")) {
			t.Errorf("%+v: %v", bad, err)
		}
	}
}

// A restored copy's NIC, configured as its source's, takes its own MAC,
// address and routes; its source's address goes.
func TestReaddressTakesTheCopysNetwork(t *testing.T) {
	ns := testNetNS(t, "dsect-guestnet-copy")
	// One NIC in the namespace, as in a guest: the veth's peer leaves.
	for _, args := range [][]string{
		{"-n", ns, "link", "add", "eth0", "address", "02:00:0a:40:00:05", "type", "veth", "peer", "name", "dsectpeer"},
		{"-n", ns, "link", "set", "dsectpeer", "netns", "1"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	t.Cleanup(func() { exec.Command("ip", "link", "del", "dsectpeer").Run() })
	source := &Config{Address: "10.64.0.5", Gateway: "10.64.0.1", MAC: "02:00:0a:40:00:05"}
	cp := &Config{Address: "10.64.0.9", Gateway: "10.64.0.1", MAC: "02:00:0a:40:00:09"}
	if err := sandboxnet.InNetNS("/run/netns/"+ns, func() error {
		if err := source.Apply(); err != nil {
			return err
		}
		return cp.Readdress()
	}); err != nil {
		t.Fatal(err)
	}
	out, _ := exec.Command("ip", "-n", ns, "-4", "addr", "show", "dev", "eth0").CombinedOutput()
	link, _ := exec.Command("ip", "-n", ns, "link", "show", "dev", "eth0").CombinedOutput()
	routes, _ := exec.Command("ip", "-n", ns, "-4", "route", "show").CombinedOutput()
	if !strings.Contains(string(out), "10.64.0.9/32") || strings.Contains(string(out), "10.64.0.5") {
		t.Fatalf("addresses after Readdress:\n%s", out)
	}
	if !strings.Contains(string(link), "02:00:0a:40:00:09") || !strings.Contains(string(link), "UP") {
		t.Fatalf("link after Readdress:\n%s", link)
	}
	if !strings.Contains(string(routes), "default via 10.64.0.1 dev eth0") {
		t.Fatalf("routes after Readdress:\n%s", routes)
	}
	for _, bad := range []*Config{
		{Address: "10.64.0.9", Gateway: "nope", MAC: cp.MAC},
		{Address: "10.64.0.9", Gateway: "10.64.0.1", MAC: "zz"},
	} {
		if err := bad.Readdress(); err == nil || !strings.Contains(err.Error(), "want") {
			t.Errorf("%+v: %v", bad, err)
		}
	}
}
