package embed

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"time"

	"github.com/opendsec/opendsec/internal/apiserver"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/metrics"
	"github.com/opendsec/opendsec/internal/pki"
	"github.com/opendsec/opendsec/internal/watcher"
)

// startAPIServer runs apiserver number i with its own non-voting IAM
// replica, joined to the cluster's.
func (c *Cluster) startAPIServer(ctx, runCtx context.Context, i int, cfg Config, ca *pki.CA, w *watcher.Watcher, pool *edgeclient.Pool, store *image.Store, protos *http.Protocols) error {
	id := fmt.Sprintf("apiserver-%d", i)
	cert, err := ca.Issue("iam-"+id, pki.RoleIAM, []string{"127.0.0.1", "localhost"})
	if err != nil {
		return err
	}
	rep, err := iam.Open(iam.Config{
		Dir: filepath.Join(cfg.StateDir, id, "iam"), NodeID: id, Bind: "127.0.0.1:0",
		ServerTLS: ca.ServerConfig(cert, pki.RoleIAM), ClientTLS: ca.ClientConfig(cert),
	}, c.log)
	if err != nil {
		return err
	}
	c.readers = append(c.readers, rep)
	// Joined on every start: its port is new each time.
	if err := c.IAM.Join(ctx, iam.Member{ID: id, Addr: rep.Addr()}); err != nil {
		return err
	}
	// Caught up with what the leader had committed when it joined.
	wait, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = rep.CatchUp(wait, c.IAM.Status().CommitIndex)
	cancel()
	if err != nil {
		return err
	}
	api := apiserver.New(apiserver.Config{K: cfg.PlacementK, Registries: cfg.Registries, PoolSyncEvery: cfg.PoolSyncEvery}, apiserver.Deps{IAM: rep, Watcher: w, Edges: pool, Images: store, Log: c.log.With("apiserver", id), Metrics: metrics.Instance(c.reg, fmt.Sprintf("apiserver-%d", i))})
	go api.Run(runCtx)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: api.Handler(), Protocols: protos, TLSConfig: c.apiTLS, ReadHeaderTimeout: 10 * time.Second}
	c.APIURLs = append(c.APIURLs, c.serveAPI(srv, ln))
	return nil
}
