package main

import (
	"os"
	"path/filepath"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
)

// registry lists the backends built into this binary; this is the one
// place they are registered.
func registry() *backend.Registry {
	r := &backend.Registry{}
	r.Register(container.Name, container.New)
	r.Register(gvisor.Name, gvisor.New)
	r.Register(microvm.Name, microvm.New)
	return r
}

// backendOptions are the options every backend gets (each reads its own):
// the container backend's OCI runtime, gVisor's platform and newer runsc,
// and the microvm backend's guest kernel directory and init, found next to
// dsec (make build and make deps put them there) unless given.
func backendOptions(runtime, platform, runscNet, guest string) map[string]string {
	o := map[string]string{"runtime": runtime, "platform": platform, "runsc-network": findRunscNet(runscNet)}
	self, err := os.Executable()
	if err != nil {
		return o
	}
	bin := filepath.Dir(self)
	o["init"] = filepath.Join(bin, "dsec-vminit")
	if guest == "" {
		guest = filepath.Join(bin, "..", ".cache", "guest")
	}
	o["guest"], _ = filepath.Abs(guest)
	return o
}
