package snapshots

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/snapxfer"
)

// ExportLease is how long an export stays open when it is not released
// (the apiserver that asked for it died mid-fork).
const ExportLease = 10 * time.Minute

// PulledIdle is how long a pulled snapshot is kept after its last restore:
// restores of one fork arrive together; later ones pull again.
const PulledIdle = 2 * time.Minute

type export struct {
	snap     *Snapshot
	token    string
	manifest *snapxfer.Manifest
	expires  time.Time
}

// pulled is a snapshot copied from another node, for restores here.
type pulled struct {
	snap     *Snapshot
	users    int       // restores running from it
	lastUsed time.Time // when the last one ended
}

// pull is a transfer in progress; concurrent restores of one snapshot
// wait for the same one.
type pull struct {
	done chan struct{}
	err  error
}

// Transfers counts a node's snapshot pulls: bytes pulled, pulls that
// failed.
type Transfers struct {
	PulledBytes, PullFailures atomic.Int64
}

// Store keeps a node's snapshots, its exports and the snapshots it pulled.
// Its lock is its own, apart from the edge's registry of sandboxes: no
// other lock is taken under it, and no snapshot's files are read or
// written under it. A Snapshot, once added, is not changed.
type Store struct {
	node       sandboxid.NodeID
	dir        string       // this node's snapshots, one directory each
	pulledRoot string       // snapshots pulled from other nodes
	peers      *http.Client // pulls from other edges; nil without PeerTLS
	log        *slog.Logger
	// Transfers counts the pulls of this node (for its metrics).
	Transfers Transfers

	mu        sync.Mutex
	snapshots map[sandboxid.SnapshotID]*Snapshot // guarded by mu
	// naming holds the names of snapshots being taken (ReserveName), by
	// project and name.
	naming  map[[2]string]bool               // guarded by mu
	exports map[string]*export               // guarded by mu; by token
	pulled  map[sandboxid.SnapshotID]*pulled // guarded by mu
	pulls   map[sandboxid.SnapshotID]*pull   // guarded by mu
}

// New is the store of node under stateDir ("snapshots" for its own,
// "pulled" for other nodes'), pulling with peers (nil: it cannot pull).
// Load reads what a previous run left.
func New(node sandboxid.NodeID, stateDir string, peers *http.Client, log *slog.Logger) *Store {
	return &Store{node: node, dir: filepath.Join(stateDir, "snapshots"), pulledRoot: filepath.Join(stateDir, "pulled"), peers: peers, log: log,
		snapshots: map[sandboxid.SnapshotID]*Snapshot{}, naming: map[[2]string]bool{}, exports: map[string]*export{},
		pulled: map[sandboxid.SnapshotID]*pulled{}, pulls: map[sandboxid.SnapshotID]*pull{}}
}

// Add keeps a snapshot just written.
func (st *Store) Add(s *Snapshot) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.snapshots[s.ID] = s
}

// List is the snapshots in scope, of one sandbox if given; foreign says a
// snapshot of that sandbox is outside the scope.
func (st *Store) List(scope, sandbox string) (out []*sandboxv1.Snapshot, foreign bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, s := range st.snapshots {
		if s.Ephemeral || (sandbox != "" && string(s.SourceSandbox) != sandbox) {
			continue
		}
		if project.Within(s.Project, scope) {
			out = append(out, s.Proto(st.node))
		} else {
			foreign = true
		}
	}
	return out, foreign
}

// ImageDigests are the images the snapshots were taken on, whose layers
// the cache keeps.
func (st *Store) ImageDigests() []string {
	st.mu.Lock()
	defer st.mu.Unlock()
	out := make([]string, 0, len(st.snapshots))
	for _, s := range st.snapshots {
		out = append(out, s.ImageDigest)
	}
	return out
}

// OpenExport opens an export of snap (its manifest hashes the snapshot's
// files).
func (st *Store) OpenExport(snap *Snapshot) (*edgev1.SnapshotExport, error) {
	meta, err := snap.Encode()
	if err != nil {
		return nil, err
	}
	m, err := snapxfer.Build(snap.Dir, meta, File)
	if err != nil {
		return nil, err
	}
	tok := make([]byte, 32)
	rand.Read(tok) //nolint:errcheck // crypto/rand does not fail on Linux
	x := &export{snap: snap, token: hex.EncodeToString(tok), manifest: m, expires: time.Now().Add(ExportLease)}
	st.mu.Lock()
	st.exports[x.token] = x
	st.mu.Unlock()
	st.log.Info("snapshot exported", logging.SnapshotID, snap.ID, "size", m.Total(), "files", len(m.Files))
	return &edgev1.SnapshotExport{SnapshotId: string(snap.ID), Token: x.token, SizeBytes: m.Total(), ExpiresAt: timestamppb.New(x.expires)}, nil
}

// Export lets other edges pull a snapshot of this node for a while.
func (st *Store) Export(snapID, scope string) (*edgev1.SnapshotExport, error) {
	snap, err := st.Lookup(snapID, scope)
	if err != nil {
		return nil, err
	}
	return st.OpenExport(snap)
}

// ReleaseExport ends an export; an ephemeral (fork) snapshot with no other
// export goes with it.
func (st *Store) ReleaseExport(snapID, token string) error {
	st.mu.Lock()
	x, ok := st.exports[token]
	if !ok || string(x.snap.ID) != snapID {
		st.mu.Unlock()
		return errdefs.NotFound("snapshot %s: no export with that token", snapID)
	}
	delete(st.exports, token)
	drop := x.snap.Ephemeral && !st.exportedLocked(x.snap)
	st.mu.Unlock()
	if drop {
		return st.Drop(x.snap)
	}
	return nil
}

func (st *Store) exportedLocked(s *Snapshot) bool {
	for _, x := range st.exports {
		if x.snap == s {
			return true
		}
	}
	return false
}

// ExportedFile serves the files of exported snapshots to other edges.
func (st *Store) ExportedFile(id, token string) (string, *snapxfer.Manifest, error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for tok, x := range st.exports {
		if subtle.ConstantTimeCompare([]byte(tok), []byte(token)) == 1 && string(x.snap.ID) == id && time.Now().Before(x.expires) {
			return x.snap.Dir, x.manifest, nil
		}
	}
	return "", nil, errdefs.PermissionDenied("snapshot %s: not exported to this token (or its lease ended)", errdefs.Clip(id, 140))
}

// Pulled returns the snapshot id, pulling it from src unless it is
// here already, and counts a user of it until release is called.
func (st *Store) Pulled(ctx context.Context, id sandboxid.SnapshotID, src *edgev1.SnapshotSource) (*Snapshot, func(), error) {
	if st.peers == nil {
		return nil, nil, errdefs.FailedPrecondition("snapshot %s is held by another node, and this edge has no certificate to pull it (edge.Config.PeerTLS)", id)
	}
	for {
		st.mu.Lock()
		if p, ok := st.pulled[id]; ok {
			p.users++
			st.mu.Unlock()
			return p.snap, func() { st.releasePulled(id) }, nil
		}
		if p, ok := st.pulls[id]; ok {
			st.mu.Unlock()
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
		st.pulls[id] = p
		st.mu.Unlock()
		snap, err := st.fetch(context.WithoutCancel(ctx), id, src)
		st.mu.Lock()
		delete(st.pulls, id)
		if err == nil {
			st.pulled[id] = &pulled{snap: snap, lastUsed: time.Now()}
		}
		p.err = err
		st.mu.Unlock()
		close(p.done)
		if err != nil {
			return nil, nil, err
		}
	}
}

func (st *Store) releasePulled(id sandboxid.SnapshotID) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if p, ok := st.pulled[id]; ok {
		p.users--
		p.lastUsed = time.Now()
	}
}

// Dir is where a snapshot of this node is written.
func (st *Store) Dir(id sandboxid.SnapshotID) string {
	return filepath.Join(st.dir, string(id))
}

// PulledDir is where a pulled snapshot is kept, apart from this node's own.
func (st *Store) PulledDir(id sandboxid.SnapshotID) string {
	return filepath.Join(st.pulledRoot, string(id))
}

// fetch copies a snapshot from its holder and reads its description.
func (st *Store) fetch(ctx context.Context, id sandboxid.SnapshotID, src *edgev1.SnapshotSource) (*Snapshot, error) {
	log := st.log.With(logging.SnapshotID, id, "from", src.Addr)
	began := time.Now()
	dir := st.PulledDir(id)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	m, err := snapxfer.Pull(ctx, snapxfer.Source{Client: st.peers, BaseURL: "https://" + src.Addr, ID: string(id), Token: src.Token, Received: &st.Transfers.PulledBytes}, dir, nil)
	if err != nil {
		// What arrived stays for a retry to resume, until the sweep.
		st.Transfers.PullFailures.Add(1)
		log.Warn("snapshot pull failed", logging.Error, err)
		return nil, err
	}
	s, err := Decode(m.Snapshot)
	if err != nil {
		return nil, errdefs.FailedPrecondition("snapshot %s: the holder's description: %v", id, err)
	}
	if s.ID != id {
		return nil, errdefs.FailedPrecondition("snapshot %s: the holder described snapshot %q", id, s.ID)
	}
	s.Dir = dir
	log.Info("snapshot pulled", "size", m.Total(), "took", time.Since(began).Round(time.Millisecond))
	return s, nil
}

// Sweep ends lapsed exports and drops pulled snapshots nobody
// restored from for PulledIdle, and pulls left half done as long.
func (st *Store) Sweep(now time.Time) {
	var drop []*Snapshot
	var dirs []string
	st.mu.Lock()
	for tok, x := range st.exports {
		if now.After(x.expires) {
			delete(st.exports, tok)
			if x.snap.Ephemeral && !st.exportedLocked(x.snap) {
				drop = append(drop, x.snap)
			}
		}
	}
	for id, p := range st.pulled {
		if p.users == 0 && now.Sub(p.lastUsed) > PulledIdle {
			delete(st.pulled, id)
			dirs = append(dirs, p.snap.Dir)
		}
	}
	ents, _ := os.ReadDir(st.pulledRoot)
	for _, ent := range ents {
		id := sandboxid.SnapshotID(ent.Name())
		_, kept := st.pulled[id]
		_, pulling := st.pulls[id]
		if fi, err := ent.Info(); err == nil && !kept && !pulling && now.Sub(fi.ModTime()) > PulledIdle {
			dirs = append(dirs, st.PulledDir(id))
		}
	}
	st.mu.Unlock()
	for _, s := range drop {
		st.log.Info("export lease ended; fork snapshot deleted", logging.SnapshotID, s.ID)
		if err := st.Drop(s); err != nil {
			st.log.Warn("drop a lapsed fork snapshot", logging.Error, err)
		}
	}
	for _, d := range dirs {
		if err := os.RemoveAll(d); err != nil {
			st.log.Warn("drop a pulled snapshot", "dir", d, logging.Error, err)
		}
	}
}

// Load finds the snapshots a previous run left; the ephemeral
// ones of an interrupted fork, and half-written ones (no description), are
// deleted. One whose description this release cannot read (a newer
// release's layout) is kept for the release that can, and not listed. It
// runs once, before the store is used.
func (st *Store) Load() {
	root := st.dir
	ents, _ := os.ReadDir(root)
	for _, ent := range ents {
		dir := filepath.Join(root, ent.Name())
		data, err := os.ReadFile(filepath.Join(dir, File))
		if errors.Is(err, fs.ErrNotExist) {
			st.log.Info("removing leftover snapshot directory", "dir", dir, logging.Error, err)
			os.RemoveAll(dir)
			continue
		}
		if err != nil {
			st.log.Error("could not read a snapshot's description; it is kept", "dir", dir, logging.Error, err)
			continue
		}
		s, err := Decode(data)
		if err != nil {
			st.log.Error("could not read a snapshot's description; it is kept", "dir", dir, logging.Error, err)
			continue
		}
		if s.Ephemeral {
			st.log.Info("removing an interrupted fork's snapshot", "dir", dir)
			os.RemoveAll(dir)
			continue
		}
		s.Dir = dir
		st.snapshots[s.ID] = s
	}
}

// ReserveName holds name for a snapshot of project about to be taken, or
// says the project has one of that name on this node (or one being taken);
// release lets the name go once the snapshot is added, or failed.
func (st *Store) ReserveName(project, name string) (release func(), err error) {
	key := [2]string{project, name}
	st.mu.Lock()
	defer st.mu.Unlock()
	taken := st.naming[key]
	for _, s := range st.snapshots {
		taken = taken || (s.Name == name && s.Project == project && !s.Ephemeral)
	}
	if taken {
		return nil, errdefs.AlreadyExists("snapshot name %q: project %s has a snapshot of that name on node %s", name, project, st.node)
	}
	st.naming[key] = true
	var once sync.Once
	return func() {
		once.Do(func() {
			st.mu.Lock()
			delete(st.naming, key)
			st.mu.Unlock()
		})
	}, nil
}

// Lookup is the snapshot id of this node, if it is in scope and not a
// fork's.
func (st *Store) Lookup(id, scope string) (*Snapshot, error) {
	sid, node, err := sandboxid.ParseSnapshot(id)
	if err != nil {
		return nil, err
	}
	if node != st.node {
		return nil, errdefs.NotFound("snapshot %s: held by node %s, not %s", id, node, st.node)
	}
	st.mu.Lock()
	s, ok := st.snapshots[sid]
	st.mu.Unlock()
	if !ok || s.Ephemeral || !project.Within(s.Project, scope) {
		return nil, errdefs.NotFound("snapshot %s: no such snapshot", id)
	}
	return s, nil
}

// Drop forgets s and deletes its files.
func (st *Store) Drop(s *Snapshot) error {
	st.mu.Lock()
	delete(st.snapshots, s.ID)
	st.mu.Unlock()
	if err := os.RemoveAll(s.Dir); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", s.ID, err)
	}
	return nil
}

// Len is how many snapshots of its own it holds, ephemeral ones included.
func (st *Store) Len() int {
	st.mu.Lock()
	defer st.mu.Unlock()
	return len(st.snapshots)
}
