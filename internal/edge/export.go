package edge

import (
	"crypto/tls"
	"net/http"
	"time"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
)

// Cross-node fork and restore [ours]: the edge holding a snapshot exports
// it (a token and a lease), the apiserver hands the token to the edges
// that run copies, and they pull the snapshot's files straight from the
// holder (internal/snapxfer) into a cache of pulled snapshots. The
// apiserver never carries snapshot bytes.
// The snapshot store (internal/edge/snapshots) keeps the exports and pulled
// snapshots under its own lock.

// transferEvery is how often exports and pulled snapshots are swept.
const transferEvery = 10 * time.Second

// peerClient reaches other edges over HTTP/2 with this edge's certificate.
func peerClient(cfg *tls.Config) *http.Client {
	if cfg == nil {
		return nil
	}
	var protos http.Protocols
	protos.SetHTTP2(true)
	return &http.Client{Transport: &http.Transport{
		TLSClientConfig: cfg.Clone(), Protocols: &protos, IdleConnTimeout: 90 * time.Second,
		TLSHandshakeTimeout: 10 * time.Second, ResponseHeaderTimeout: time.Minute,
	}}
}

// Export lets other edges pull a snapshot of this node for a while.
func (e *Edge) Export(snapID, scope string) (*edgev1.SnapshotExport, error) {
	return e.snaps.Export(snapID, scope)
}

// ReleaseExport ends an export; an ephemeral (fork) snapshot with no other
// export goes with it.
func (e *Edge) ReleaseExport(snapID, token string) error {
	return e.snaps.ReleaseExport(snapID, token)
}
