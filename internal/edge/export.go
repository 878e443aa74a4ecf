package edge

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"crypto/tls"
	"encoding/hex"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/snapxfer"
)

// Cross-node fork and restore [ours]: the edge holding a snapshot exports
// it (a token and a lease), the apiserver hands the token to the edges
// that run copies, and they pull the snapshot's files straight from the
// holder (internal/snapxfer) into a cache of pulled snapshots. The
// apiserver never carries snapshot bytes.
//
// Lock order: Edge.mu guards exports, pulled and pulls; no other lock is
// taken under it, and no I/O is done under it.

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

// openExport opens an export of snap. Callers must not hold e.mu (the
// manifest hashes the snapshot's files).
func (e *Edge) openExport(snap *snapshot) (*edgev1.SnapshotExport, error) {
	meta, err := snap.encode()
	if err != nil {
		return nil, err
	}
	m, err := snapxfer.Build(snap.dir, meta, snapshotFile)
	if err != nil {
		return nil, err
	}
	tok := make([]byte, 32)
	rand.Read(tok) //nolint:errcheck // crypto/rand does not fail on Linux
	x := &export{snap: snap, token: hex.EncodeToString(tok), manifest: m, expires: time.Now().Add(exportLease)}
	e.mu.Lock()
	e.exports[x.token] = x
	e.mu.Unlock()
	e.log.Info("snapshot exported", logging.SnapshotID, snap.ID, "size", m.Total(), "files", len(m.Files))
	return &edgev1.SnapshotExport{SnapshotId: string(snap.ID), Token: x.token, SizeBytes: m.Total(), ExpiresAt: timestamppb.New(x.expires)}, nil
}

// Export lets other edges pull a snapshot of this node for a while.
func (e *Edge) Export(snapID, scope string) (*edgev1.SnapshotExport, error) {
	snap, err := e.lookupSnapshot(snapID, scope)
	if err != nil {
		return nil, err
	}
	return e.openExport(snap)
}

// ReleaseExport ends an export; an ephemeral (fork) snapshot with no other
// export goes with it.
func (e *Edge) ReleaseExport(snapID, token string) error {
	e.mu.Lock()
	x, ok := e.exports[token]
	if !ok || string(x.snap.ID) != snapID {
		e.mu.Unlock()
		return errdefs.NotFound("snapshot %s: no export with that token", snapID)
	}
	delete(e.exports, token)
	drop := x.snap.Ephemeral && !e.exportedLocked(x.snap)
	e.mu.Unlock()
	if drop {
		return e.dropSnapshot(x.snap)
	}
	return nil
}

func (e *Edge) exportedLocked(s *snapshot) bool {
	for _, x := range e.exports {
		if x.snap == s {
			return true
		}
	}
	return false
}

// exportedFile serves the files of exported snapshots to other edges.
func (e *Edge) exportedFile(id, token string) (string, *snapxfer.Manifest, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for tok, x := range e.exports {
		if subtle.ConstantTimeCompare([]byte(tok), []byte(token)) == 1 && string(x.snap.ID) == id && time.Now().Before(x.expires) {
			return x.snap.dir, x.manifest, nil
		}
	}
	return "", nil, errdefs.PermissionDenied("snapshot %s: not exported to this token (or its lease ended)", errdefs.Clip(id, 140))
}

// SnapshotHandler serves exported snapshots (snapxfer.Prefix).
func (e *Edge) SnapshotHandler() http.Handler { return snapxfer.Handler(e.exportedFile) }

// pulledSnapshot returns the snapshot id, pulling it from src unless it is
// here already, and counts a user of it until release is called.
func (e *Edge) pulledSnapshot(ctx context.Context, id sandboxid.SnapshotID, src *edgev1.SnapshotSource) (*snapshot, func(), error) {
	if e.peers == nil {
		return nil, nil, errdefs.FailedPrecondition("snapshot %s is held by another node, and this edge has no certificate to pull it (edge.Config.PeerTLS)", id)
	}
	for {
		e.mu.Lock()
		if p, ok := e.pulled[id]; ok {
			p.users++
			e.mu.Unlock()
			return p.snap, func() { e.releasePulled(id) }, nil
		}
		if p, ok := e.pulls[id]; ok {
			e.mu.Unlock()
			select {
			case <-p.done:
			case <-ctx.Done():
				return nil, nil, ctx.Err()
			}
			if p.err != nil {
				return nil, nil, p.err
			}
			continue
		}
		p := &pull{done: make(chan struct{})}
		e.pulls[id] = p
		e.mu.Unlock()
		snap, err := e.fetch(context.WithoutCancel(ctx), id, src)
		e.mu.Lock()
		delete(e.pulls, id)
		if err == nil {
			e.pulled[id] = &pulled{snap: snap, lastUsed: time.Now()}
		}
		p.err = err
		e.mu.Unlock()
		close(p.done)
		if err != nil {
			return nil, nil, err
		}
	}
}

func (e *Edge) releasePulled(id sandboxid.SnapshotID) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if p, ok := e.pulled[id]; ok {
		p.users--
		p.lastUsed = time.Now()
	}
}

// pulledDir is where pulled snapshots are kept, apart from this node's own.
func (e *Edge) pulledDir(id sandboxid.SnapshotID) string {
	return filepath.Join(e.cfg.StateDir, "pulled", string(id))
}

// fetch copies a snapshot from its holder and reads its description.
func (e *Edge) fetch(ctx context.Context, id sandboxid.SnapshotID, src *edgev1.SnapshotSource) (*snapshot, error) {
	log := e.log.With(logging.SnapshotID, id, "from", src.Addr)
	began := time.Now()
	dir := e.pulledDir(id)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	m, err := snapxfer.Pull(ctx, snapxfer.Source{Client: e.peers, BaseURL: "https://" + src.Addr, ID: string(id), Token: src.Token}, dir, nil)
	if err != nil {
		// What arrived stays for a retry to resume, until the sweep.
		log.Warn("snapshot pull failed", logging.Error, err)
		return nil, err
	}
	s, err := decodeSnapshot(m.Snapshot)
	if err != nil {
		return nil, errdefs.FailedPrecondition("snapshot %s: the holder's description: %v", id, err)
	}
	if s.ID != id {
		return nil, errdefs.FailedPrecondition("snapshot %s: the holder described snapshot %q", id, s.ID)
	}
	s.dir = dir
	log.Info("snapshot pulled", "size", m.Total(), "took", time.Since(began).Round(time.Millisecond))
	return s, nil
}

// sweepTransfers ends lapsed exports and drops pulled snapshots nobody
// restored from for pulledIdle, and pulls left half done as long.
func (e *Edge) sweepTransfers(now time.Time) {
	var drop []*snapshot
	var dirs []string
	e.mu.Lock()
	for tok, x := range e.exports {
		if now.After(x.expires) {
			delete(e.exports, tok)
			if x.snap.Ephemeral && !e.exportedLocked(x.snap) {
				drop = append(drop, x.snap)
			}
		}
	}
	for id, p := range e.pulled {
		if p.users == 0 && now.Sub(p.lastUsed) > pulledIdle {
			delete(e.pulled, id)
			dirs = append(dirs, p.snap.dir)
		}
	}
	ents, _ := os.ReadDir(filepath.Join(e.cfg.StateDir, "pulled"))
	for _, ent := range ents {
		id := sandboxid.SnapshotID(ent.Name())
		_, kept := e.pulled[id]
		_, pulling := e.pulls[id]
		if fi, err := ent.Info(); err == nil && !kept && !pulling && now.Sub(fi.ModTime()) > pulledIdle {
			dirs = append(dirs, e.pulledDir(id))
		}
	}
	e.mu.Unlock()
	for _, s := range drop {
		e.log.Info("export lease ended; fork snapshot deleted", logging.SnapshotID, s.ID)
		if err := e.dropSnapshot(s); err != nil {
			e.log.Warn("drop a lapsed fork snapshot", logging.Error, err)
		}
	}
	for _, d := range dirs {
		if err := os.RemoveAll(d); err != nil {
			e.log.Warn("drop a pulled snapshot", "dir", d, logging.Error, err)
		}
	}
}

func (e *Edge) transferLoop() {
	defer e.wg.Done()
	tick := time.NewTicker(transferEvery)
	defer tick.Stop()
	for {
		select {
		case <-e.stop:
			return
		case now := <-tick.C:
			e.sweepTransfers(now)
		}
	}
}
