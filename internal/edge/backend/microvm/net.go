package microvm

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/backend"
)

// A microvm sandbox's network [ours]. The edge gives the sandbox a network
// namespace whose eth0 (a veth to the node) has the sandbox's /32 address,
// a link route to the gateway and the default route through it; the
// policy is enforced on the node's side of the veth. The guest gets the
// same: a TAP device in the namespace, joined to eth0 by tc mirred
// redirects both ways (every frame in on one leaves on the other, before
// the namespace's own stack sees it), the VMM started inside the
// namespace on that TAP with eth0's MAC, and the guest's init setting
// eth0's address and routes on that NIC (GuestNet). The host side does
// not change, so policies, the DNS proxy and port forwarding work as for
// the other backends.

// GuestNet is the guest's network interface, in the guest's config (read
// there as guestnet.Config) and in a restored copy's handle, which the
// edge sends to its agent.
type GuestNet = backend.GuestNetwork

// NetModules are the modules a guest with a NIC loads after ModuleOrder's.
var NetModules = []string{"failover", "net_failover", "virtio_net"}

// guestTap is the TAP's name in the sandbox's namespace.
const guestTap = "tap0"

// inNetNS prefixes a command with nsenter into the namespace at path.
func inNetNS(path string, args ...string) []string {
	return append([]string{"nsenter", "--net=" + path, "--"}, args...)
}

func runIn(ctx context.Context, netns string, args ...string) ([]byte, error) {
	argv := inNetNS(netns, args...)
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return out, nil
}

// readGuestNet reads eth0's IPv4 address and MAC and the default gateway
// of the namespace at netns.
func readGuestNet(ctx context.Context, netns string) (GuestNet, error) {
	var n GuestNet
	out, err := runIn(ctx, netns, "ip", "-j", "-4", "addr", "show", "dev", "eth0")
	if err != nil {
		return n, fmt.Errorf("microvm: the sandbox's network: %w", err)
	}
	var links []struct {
		Address  string `json:"address"`
		AddrInfo []struct {
			Local string `json:"local"`
		} `json:"addr_info"`
	}
	if err := json.Unmarshal(out, &links); err != nil || len(links) != 1 || len(links[0].AddrInfo) == 0 {
		return n, fmt.Errorf("microvm: the sandbox's network: eth0 has no IPv4 address (%v): %s", err, out)
	}
	n.Address = links[0].AddrInfo[0].Local
	if out, err = runIn(ctx, netns, "ip", "-j", "link", "show", "dev", "eth0"); err == nil {
		json.Unmarshal(out, &links) //nolint:errcheck // checked below
		if len(links) == 1 {
			n.MAC = links[0].Address
		}
	}
	out, err = runIn(ctx, netns, "ip", "-j", "-4", "route", "show", "default")
	if err != nil {
		return n, fmt.Errorf("microvm: the sandbox's network: %w", err)
	}
	var routes []struct {
		Gateway string `json:"gateway"`
	}
	if json.Unmarshal(out, &routes) != nil || len(routes) == 0 || routes[0].Gateway == "" || n.MAC == "" {
		return n, fmt.Errorf("microvm: the sandbox's network: no default gateway or MAC in its namespace: %s", out)
	}
	n.Gateway = routes[0].Gateway
	return n, nil
}

// plugTap makes the guest's TAP in the namespace (kept there: the VMM
// opens it by name, again after a restart) and joins it to eth0. Safe to
// run again.
func plugTap(ctx context.Context, netns string) error {
	if _, err := runIn(ctx, netns, "ip", "link", "show", "dev", guestTap); err != nil {
		if _, err := runIn(ctx, netns, "ip", "tuntap", "add", "dev", guestTap, "mode", "tap"); err != nil {
			return fmt.Errorf("microvm: the guest's TAP: %w", err)
		}
	}
	if _, err := runIn(ctx, netns, "ip", "link", "set", guestTap, "up"); err != nil {
		return fmt.Errorf("microvm: the guest's TAP: %w", err)
	}
	for _, pair := range [][2]string{{"eth0", guestTap}, {guestTap, "eth0"}} {
		runIn(ctx, netns, "tc", "qdisc", "del", "dev", pair[0], "ingress") //nolint:errcheck // absent the first time
		if _, err := runIn(ctx, netns, "tc", "qdisc", "add", "dev", pair[0], "ingress"); err != nil {
			return fmt.Errorf("microvm: join %s to %s: %w", pair[0], pair[1], err)
		}
		if _, err := runIn(ctx, netns, "tc", "filter", "add", "dev", pair[0], "parent", "ffff:", "protocol", "all",
			"u32", "match", "u8", "0", "0", "action", "mirred", "egress", "redirect", "dev", pair[1]); err != nil {
			return fmt.Errorf("microvm: join %s to %s: %w", pair[0], pair[1], err)
		}
	}
	return nil
}
