package main

import (
	"flag"
	"slices"
	"testing"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/edge/backend/vm"
)

// Every backend built in takes every option the flags give it: each
// refuses one it does not know, so a flag handed to the wrong backend
// would stop the edge at start.
func TestEveryBackendTakesItsFlags(t *testing.T) {
	fs := flag.NewFlagSet("edge", flag.ContinueOnError)
	bf := addBackendFlags(fs)
	if err := fs.Parse([]string{"--cgroup-parent", "/opendsec.slice", "--microvm-firecracker", "/usr/bin/firecracker", "--gvisor-runsc-network", "none", "--microvm-templates", "off", "--vm-devices", "0000:01:00.0"}); err != nil {
		t.Fatal(err)
	}
	into := map[string]any{container.Name: &container.Options{}, gvisor.Name: &gvisor.Options{}, microvm.Name: &microvm.Options{}, vm.Name: &microvm.Options{}}
	var names []string
	for name := range into {
		names = append(names, name)
	}
	slices.Sort(names)
	if got := registry().Names(); !slices.Equal(got, names) {
		t.Fatalf("registered %v; this test covers %v", got, names)
	}
	for name, dst := range into {
		opts := bf.options(name)
		if opts["cgroup-parent"] != "/opendsec.slice" {
			t.Errorf("%s: options %v lack the cgroup parent", name, opts)
		}
		if err := backend.DecodeOptions(name, opts, dst); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		if name == vm.Name && (opts["firecracker"] != "" || opts["devices"] != "0000:01:00.0") {
			t.Errorf("vm: handed --microvm-firecracker, which it refuses, or not --vm-devices: %v", opts)
		}
		if name != vm.Name && opts["devices"] != "" {
			t.Errorf("%s: handed --vm-devices: %v", name, opts)
		}
	}
	if o := into[microvm.Name].(*microvm.Options); o.Firecracker != "/usr/bin/firecracker" || o.Init == "" || o.Templates != "off" {
		t.Errorf("microvm options %+v", o)
	}
}
