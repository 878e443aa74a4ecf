package microvm

import (
	"testing"

	"github.com/opendsec/opendsec/internal/image"
)

func TestSharedRootKeyIsTheImagesLayers(t *testing.T) {
	a := []string{"/n1/edge/cache/0123456789abcdef/fs", "/n1/edge/cache/fedcba9876543210/fs"}
	b := []string{"/other/node/cache/0123456789abcdef/fs", "/other/node/cache/fedcba9876543210/fs/"}
	ka, ok := sharedRootKey(a)
	kb, okb := sharedRootKey(b)
	if !ok || !okb || ka != kb || ka != image.VMRootKey([]string{"0123456789abcdef", "fedcba9876543210"}) {
		t.Fatalf("keys %q %v, %q %v: two nodes' directories of one image's layers must name one root, the store's", ka, ok, kb, okb)
	}
	if k, _ := sharedRootKey([]string{a[1], a[0]}); k == ka {
		t.Fatal("layers in another order made the same key")
	}
	if _, ok := sharedRootKey([]string{"/tmp/some/tree"}); ok {
		t.Fatal("a directory that is no layer of a node's cache got a shared key")
	}
}

func TestWithRootStoreLeavesTheCallersOptions(t *testing.T) {
	opts := map[string]map[string]string{"microvm": {"guest": "/g"}, "vm": {"guest": "/v"}, "container": {}}
	got := WithRootStore(opts, "/store/blobs/vm-root")
	if got["microvm"]["root-store"] != "/store/blobs/vm-root" || got["microvm"]["guest"] != "/g" || opts["microvm"]["root-store"] != "" {
		t.Fatalf("got %v; the caller's is now %v", got, opts)
	}
	if got["vm"]["root-store"] != "/store/blobs/vm-root" || got["vm"]["guest"] != "/v" || opts["vm"]["root-store"] != "" || len(got["container"]) != 0 {
		t.Fatalf("the vm backend's: got %v; the caller's is now %v", got, opts)
	}
	own := map[string]map[string]string{"microvm": {"root-store": "/mine"}}
	if WithRootStore(own, "/x")["microvm"]["root-store"] != "/mine" {
		t.Fatal("an operator's root store was replaced")
	}
	if _, ok := WithRootStore(map[string]map[string]string{"container": {}}, "/x")["microvm"]; ok {
		t.Fatal("microvm options were added to a node without microvm")
	}
}
