package main

import (
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
)

// registry lists the backends built into this binary; this is the one
// place they are registered.
func registry() *backend.Registry {
	r := &backend.Registry{}
	r.Register(container.Name, container.New)
	r.Register(gvisor.Name, gvisor.New)
	return r
}
