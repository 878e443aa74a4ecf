package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/sandboxnet"
)

// The guest's network setup, run in a network namespace of the test's
// own: the NIC with the given MAC comes up with its /32 address, a link
// route to the gateway and the default route through it, as the host's
// sandbox network gives them to a container.
func TestNetConfigApplies(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (a network namespace)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip (iproute2)")
	}
	ns := "dsect-vminit-net"
	exec.Command("ip", "netns", "del", ns).Run()
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	if out, err := exec.Command("ip", "-n", ns, "link", "add", "eth7", "address", "02:00:0a:40:00:05", "type", "veth", "peer", "name", "peer7").CombinedOutput(); err != nil {
		t.Fatalf("veth: %v: %s", err, out)
	}
	exec.Command("ip", "-n", ns, "link", "set", "peer7", "up").Run()
	n := &netConfig{Address: "10.64.0.5", Gateway: "10.64.0.1", MAC: "02:00:0a:40:00:05"}
	if err := sandboxnet.InNetNS("/run/netns/"+ns, func() error {
		if err := upLoopback(); err != nil {
			return err
		}
		return n.apply()
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
	for _, bad := range []*netConfig{
		{Address: "x", Gateway: "10.64.0.1", MAC: n.MAC},
		{Address: "10.64.0.6", Gateway: "10.64.0.1", MAC: "02:00:00:00:00:99"},
	} {
		err := sandboxnet.InNetNS("/run/netns/"+ns, bad.apply)
		if err == nil || !(strings.Contains(err.Error(), "address \"x\"") || strings.Contains(err.Error(), "no interface has MAC")) {
			t.Errorf("%+v: %v", bad, err)
		}
	}
}
