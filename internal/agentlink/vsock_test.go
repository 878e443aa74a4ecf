package agentlink

import (
	"context"
	"strings"
	"testing"
)

func TestParseVsock(t *testing.T) {
	for addr, want := range map[string][2]uint32{"2:1024": {2, 1024}, "3:0": {3, 0}} {
		cid, port, err := parseVsock(addr)
		if err != nil || cid != want[0] || port != want[1] {
			t.Errorf("%q: %d %d %v", addr, cid, port, err)
		}
	}
	for _, bad := range []string{"", "2", "2:", ":1", "a:1", "2:b", "2:1:3", "4294967296:1", "-1:2"} {
		if _, _, err := parseVsock(bad); err == nil || !strings.Contains(err.Error(), "CID:PORT") {
			t.Errorf("%q: %v, want an error naming the form", bad, err)
		}
	}
}

// On a host (no guest's vsock transport answers CID 2 here) a vsock dial
// fails with the address in the error, not a hang or a panic.
func TestDialVsockFailsClearlyWithoutAHost(t *testing.T) {
	_, err := dial(context.Background(), VsockPrefix+"2:1024")
	if err == nil {
		t.Skip("something answers vsock 2:1024 on this machine")
	}
	if !strings.Contains(err.Error(), "vsock") {
		t.Fatalf("error %v does not say vsock", err)
	}
	if _, err := dial(context.Background(), VsockPrefix+"x"); err == nil || !strings.Contains(err.Error(), "CID:PORT") {
		t.Fatalf("a bad address: %v", err)
	}
}
