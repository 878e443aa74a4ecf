// Package benchcluster starts the whole platform in the benchmark's own
// process, on a scratch directory, the way every bench under bench/ measures
// it.
package benchcluster

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/embed"
)

// Cluster is a running platform and its scratch directory.
type Cluster struct {
	*embed.Cluster
	// Work is the scratch directory; the cluster's state is Work/state,
	// and a bench may keep its own files (bare-runtime bundles) beside it.
	Work string
}

// Backend names one isolation backend to enable.
type Backend struct {
	Name    string
	Factory backend.Factory
	Config  map[string]string
}

// Start runs apiserver, watcher, IAM and one edge with be enabled, the
// agent binary and image store given (relative paths are fine), after
// adjust (may be nil) has seen the configuration. Close stops it all and
// removes the scratch directory.
func Start(ctx context.Context, storeDir, agent string, be Backend, adjust func(*embed.Config)) (*Cluster, error) {
	work, err := os.MkdirTemp("", "dsec-bench-"+be.Name+"-")
	if err != nil {
		return nil, err
	}
	agentAbs, err := filepath.Abs(agent)
	if err != nil {
		os.RemoveAll(work)
		return nil, err
	}
	storeAbs, err := filepath.Abs(storeDir)
	if err != nil {
		os.RemoveAll(work)
		return nil, err
	}
	reg := &backend.Registry{}
	reg.Register(be.Name, be.Factory)
	cfg := embed.Config{
		StateDir: filepath.Join(work, "state"), Listen: "127.0.0.1:0", AgentPath: agentAbs, ImageStore: storeAbs,
		Backends: map[string]map[string]string{be.Name: be.Config},
	}
	if adjust != nil {
		adjust(&cfg)
	}
	// DSEC_BENCH_LOG names a file for the cluster's log (the edge's
	// "sandbox started took=" lines time each create's own part).
	var log *slog.Logger
	if path := os.Getenv("DSEC_BENCH_LOG"); path != "" {
		f, err := os.Create(path)
		if err != nil {
			os.RemoveAll(work)
			return nil, err
		}
		log = slog.New(slog.NewTextHandler(f, nil))
	}
	c, err := embed.Start(ctx, cfg, reg, log)
	if err != nil {
		os.RemoveAll(work)
		return nil, err
	}
	return &Cluster{Cluster: c, Work: work}, nil
}

// Close stops the cluster and removes the scratch directory.
func (c *Cluster) Close() {
	// Sandboxes outlive their edge by design; a bench that stopped on an
	// error must not leave its own running.
	c.Edge.DestroyAll(context.Background(), "root") //nolint:errcheck // best effort
	c.Cluster.Close()
	os.RemoveAll(c.Work) //nolint:errcheck // scratch
}
