package embed

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"time"

	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/pki"
)

// startEdge runs edge number i (from 1) and returns it with its address.
// The first keeps StateDir/edge, as a one-edge cluster always had.
func (c *Cluster) startEdge(ctx context.Context, i int, cfg Config, reg *backend.Registry, ca *pki.CA, store *image.Store) (*edge.Edge, string, error) {
	dir := filepath.Join(cfg.StateDir, "edge")
	if i > 1 {
		dir = fmt.Sprintf("%s-%d", dir, i)
	}
	backends, err := reg.Open(ctx, microvm.WithRootStore(cfg.Backends, store.VMRootDir()), filepath.Join(dir, "backends"), c.log)
	if err != nil {
		return nil, "", err
	}
	capacity := cfg.Capacity
	if cfg.EdgeCapacity != nil {
		capacity = cfg.EdgeCapacity(i)
	}
	network := cfg.Network
	if network != nil && i > 1 {
		// A subnet given for the node fits one edge; the others take the
		// one their node id chooses.
		n := *network
		n.Subnet = netip.Prefix{}
		network = &n
	}
	// The certificate serves the edge's port and pulls other edges'
	// snapshots.
	cert, err := ca.Issue(fmt.Sprintf("edge-%d", i), pki.RoleEdge, []string{"127.0.0.1", "localhost"})
	if err != nil {
		return nil, "", err
	}
	e, err := edge.New(ctx, edge.Config{StateDir: dir, AgentPath: cfg.AgentPath, Capacity: capacity, CPUOvercommit: cfg.CPUOvercommit, MemoryOvercommit: cfg.MemoryOvercommit, MaxSandboxes: cfg.MaxSandboxes, DiskOvercommit: cfg.DiskOvercommit, DiskLedgerDir: filepath.Join(cfg.StateDir, "disk-ledger"), RunBase: cfg.RunBase, WarmLayers: cfg.WarmLayers, Pools: cfg.Pools, LayerCacheLimit: cfg.LayerCacheLimit, Network: network, PeerTLS: ca.ClientConfig(cert)},
		edge.Deps{Store: store, Backends: backends, Log: c.log.With(logging.Component, "edge"), Metrics: c.reg})
	if err != nil {
		return nil, "", err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		e.Close()
		return nil, "", err
	}
	srv := &http.Server{Handler: e.Handler(), TLSConfig: ca.ServerConfig(cert, pki.RoleAPIServer, pki.RoleWatcher, pki.RoleEdge), ReadHeaderTimeout: 10 * time.Second}
	c.serve(srv, func() error { return srv.ServeTLS(ln, "", "") })
	return e, ln.Addr().String(), nil
}
