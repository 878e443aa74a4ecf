package apiserver

import (
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/testutil"
)

// TestTheAPIServerLinksNoNodePlumbing: the apiserver checks network
// policies with internal/netpolicy, which is pure; the node's plumbing
// (nftables, network namespaces, the DNS proxy) belongs to edges alone.
func TestTheAPIServerLinksNoNodePlumbing(t *testing.T) {
	t.Parallel()
	out := testutil.GoList(t, "-deps", ".")
	const self = "github.com/opendsec/opendsec/"
	banned := []string{self + "internal/sandboxnet", self + "internal/edge", "github.com/google/nftables", "github.com/miekg/dns", "github.com/vishvananda/netns", "github.com/vishvananda/netlink"}
	for _, pkg := range strings.Fields(out) {
		for _, b := range banned {
			if pkg == b || strings.HasPrefix(pkg, b+"/") {
				t.Errorf("the apiserver links %s, the node's plumbing", pkg)
			}
		}
	}
}
