package edge

import (
	"crypto/tls"
	"net/http"
	"time"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/internal/snapxfer"
)

// Cross-node fork and restore [ours]: the edge holding a snapshot exports
// it (a token and a lease), the apiserver hands the token to the edges
// that run copies, and they pull the snapshot's files straight from the
// holder (internal/snapxfer) into a cache of pulled snapshots. The
// apiserver never carries snapshot bytes.
// The snapshot store (snapstore.go) keeps the exports and pulled
// snapshots under its own lock.

// exportLease is how long an export stays open when it is not released
// (the apiserver that asked for it died mid-fork).
const exportLease = 10 * time.Minute

// pulledIdle is how long a pulled snapshot is kept after its last restore:
// restores of one fork arrive together; later ones pull again.
const pulledIdle = 2 * time.Minute

// transferEvery is how often exports and pulled snapshots are swept.
const transferEvery = 10 * time.Second

type export struct {
	snap     *snapshot
	token    string
	manifest *snapxfer.Manifest
	expires  time.Time
}

// pulled is a snapshot copied from another node, for restores here.
type pulled struct {
	snap     *snapshot
	users    int       // restores running from it
	lastUsed time.Time // when the last one ended
}

// pull is a transfer in progress; concurrent restores of one snapshot
// wait for the same one.
type pull struct {
	done chan struct{}
	err  error
}

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
	return e.snaps.export(snapID, scope)
}

// ReleaseExport ends an export; an ephemeral (fork) snapshot with no other
// export goes with it.
func (e *Edge) ReleaseExport(snapID, token string) error {
	return e.snaps.releaseExport(snapID, token)
}

// SnapshotHandler serves exported snapshots (snapxfer.Prefix).
func (e *Edge) SnapshotHandler() http.Handler { return snapxfer.Handler(e.snaps.exportedFile) }

func (e *Edge) transferLoop() {
	defer e.wg.Done()
	tick := time.NewTicker(transferEvery)
	defer tick.Stop()
	for {
		select {
		case <-e.stop:
			return
		case now := <-tick.C:
			e.snaps.sweep(now)
		}
	}
}
