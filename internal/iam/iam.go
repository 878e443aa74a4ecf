// Package iam is identity and access: projects, quotas and API keys,
// replicated with hashicorp/raft over mutual TLS, with the log in bbolt
// [paper: nested projects and delegation; ours: Raft]. Reads come from the
// local replica; writes go to the leader, from whichever replica gets them.
package iam

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam/boltstore"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/project"
)

// Config configures a replica.
type Config struct {
	Dir string
	// NodeID names this replica in the Raft configuration.
	NodeID string
	// Bind is the Raft listen address (host:port); port 0 picks one.
	Bind string
	// Advertise is the address other replicas dial (default: the
	// listener's).
	Advertise string
	// ServerTLS and ClientTLS secure Raft traffic between replicas.
	ServerTLS, ClientTLS *tls.Config
	// Bootstrap starts a new cluster with this replica as its only voter
	// when it has no state yet.
	Bootstrap bool
	// SingleNode tunes timeouts for a one-replica cluster (dsec up).
	SingleNode bool
	// SnapshotThreshold is how many log entries since the last snapshot
	// make the next one (and compact the log); 0 is Raft's 8192.
	SnapshotThreshold uint64
}

// Service is one IAM replica.
type Service struct {
	id string
	// incarnation names this run of the replica: a reservation it holds
	// is known dead once another run of the same id reads it.
	incarnation string
	raft        *raft.Raft
	fsm         *fsm.FSM
	store       *boltstore.Store
	trans       *raft.NetworkTransport
	layer       *tlsLayer
	clientTLS   *tls.Config
	log         *slog.Logger
	stats       *raftStats
	// handingOff is set once a stopping leader takes no more changes
	// (handOff): they are answered not-leader and go to the next.
	handingOff atomic.Bool
	// applying is held (shared) by each change from the handingOff check
	// to its answer; handOff takes it to set handingOff, so no change
	// passes the check and enters the log after the hand-off began.
	applying sync.RWMutex
	// requests counts the request connections being answered; once
	// draining is set (Close) new ones are told "not the leader" and Close
	// waits for these, so a stopping replica answers what it took instead
	// of ending it with the connection (EOF: the sender cannot tell
	// whether it ran).
	reqMu    sync.Mutex
	requests sync.WaitGroup
	draining bool // guarded by reqMu
}

// Principal is an authenticated caller.
type Principal struct {
	KeyID   string
	Project string
	Role    fsm.Role
}

// CanAccess reports whether p may act on project (its own or below it).
func (p Principal) CanAccess(path string) bool { return project.Within(path, p.Project) }

// Open starts a replica.
func Open(cfg Config, log *slog.Logger) (*Service, error) {
	log = logging.OrDiscard(log).With(logging.Component, "iam")
	if err := os.MkdirAll(filepath.Join(cfg.Dir, "snapshots"), 0o700); err != nil {
		return nil, err
	}
	store, err := boltstore.Open(filepath.Join(cfg.Dir, "raft.db"))
	if err != nil {
		return nil, fmt.Errorf("iam: open raft log: %w", err)
	}
	hlog := hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Error, Output: slogWriter{log}})
	snaps, err := raft.NewFileSnapshotStoreWithLogger(filepath.Join(cfg.Dir, "snapshots"), 2, hlog)
	if err != nil {
		store.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.Bind)
	if err != nil {
		store.Close()
		return nil, fmt.Errorf("iam: raft listen %s: %w", cfg.Bind, err)
	}
	layer := newTLSLayer(ln, cfg.ServerTLS, cfg.ClientTLS)
	if cfg.Advertise != "" {
		if layer.advertise, err = net.ResolveTCPAddr("tcp", cfg.Advertise); err != nil {
			ln.Close()
			store.Close()
			return nil, fmt.Errorf("iam: advertise %s: %w", cfg.Advertise, err)
		}
	}
	trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{Stream: layer, MaxPool: 3, Timeout: 10 * time.Second, Logger: hlog})
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.NodeID)
	rc.Logger = hlog
	if cfg.SnapshotThreshold > 0 {
		rc.SnapshotThreshold = cfg.SnapshotThreshold
		rc.TrailingLogs = cfg.SnapshotThreshold
		rc.SnapshotInterval = time.Second
	}
	if cfg.SingleNode {
		rc.HeartbeatTimeout, rc.ElectionTimeout, rc.LeaderLeaseTimeout = 100*time.Millisecond, 100*time.Millisecond, 50*time.Millisecond
	}
	f := fsm.New()
	r, err := raft.NewRaft(rc, f, store, store, snaps, trans)
	if err != nil {
		trans.Close()
		store.Close()
		return nil, err
	}
	s := &Service{id: cfg.NodeID, incarnation: randomHex(6), raft: r, fsm: f, store: store, trans: trans, layer: layer, clientTLS: cfg.ClientTLS, log: log, stats: watchRaft(r)}
	layer.serve = s.serveRequest
	go layer.run()
	if cfg.Bootstrap {
		has, err := raft.HasExistingState(store, store, snaps)
		if err != nil {
			s.Close()
			return nil, err
		}
		if !has {
			conf := raft.Configuration{Servers: []raft.Server{{ID: rc.LocalID, Address: trans.LocalAddr()}}}
			if err := r.BootstrapCluster(conf).Error(); err != nil {
				s.Close()
				return nil, fmt.Errorf("iam: bootstrap: %w", err)
			}
		}
	}
	return s, nil
}

// Addr is the Raft address others join.
func (s *Service) Addr() string { return string(s.trans.LocalAddr()) }

// Close stops the replica.
func (s *Service) Close() error {
	s.handOff()
	s.drainRequests(10 * time.Second)
	s.stats.stop(s.raft)
	err := s.raft.Shutdown().Error()
	s.trans.Close()
	if n := s.layer.drain(5 * time.Second); n > 0 {
		s.log.Warn("raft connections still open at close", "connections", n)
	}
	return errors.Join(err, s.store.Close())
}

// WaitLeader waits until the cluster has a leader and this replica has
// applied everything committed before.
func (s *Service) WaitLeader(ctx context.Context) error {
	for {
		if addr, _ := s.raft.LeaderWithID(); addr != "" {
			if s.raft.State() != raft.Leader {
				return nil
			}
			return s.raft.Barrier(10 * time.Second).Error()
		}
		select {
		case <-ctx.Done():
			return errdefs.Wrap(errdefs.ErrUnavailable, ctx.Err(), "iam: no raft leader")
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// AddVoter adds a replica, through whichever replica this is.
func (s *Service) AddVoter(id, addr string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	return s.Join(ctx, Member{ID: id, Addr: addr, Voter: true})
}

// apply replicates a command: here on the leader, or sent to it. It
// returns once this replica has applied it too, so a read that follows
// sees the write (an apiserver's non-voting replica lags the leader).
func (s *Service) apply(ctx context.Context, t fsm.CommandType, body any) error {
	data, err := fsm.Encode(t, body)
	if err != nil {
		return err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
	}
	out, err := s.toLeader(ctx, opApply, data)
	if err != nil || len(out) != 8 {
		return err
	}
	idx := binary.BigEndian.Uint64(out)
	for !s.holds(idx) {
		select {
		case <-ctx.Done():
			return errdefs.Wrap(errdefs.ErrUnavailable, ctx.Err(), "iam: the change was made, but this replica has not caught up with it yet")
		case <-time.After(2 * time.Millisecond):
		}
	}
	return nil
}

// holds reports whether this replica's state includes log index idx.
// Raft's AppliedIndex moves when entries are handed to the FSM, before
// they are applied; the FSM records the last command it applied. Entries
// after that one that are not commands (configuration changes, a new
// leader's no-op) change no state, and a snapshot restored past it
// (raft restores before it moves AppliedIndex) holds everything up to its
// index.
func (s *Service) holds(idx uint64) bool {
	from := s.fsm.Applied()
	if from >= idx {
		return true
	}
	if s.raft.AppliedIndex() < idx {
		return false
	}
	if snap := s.Status().LastSnapshotIndex; snap > from {
		from = snap
	}
	for i := from + 1; i <= idx; i++ {
		var l raft.Log
		if err := s.store.GetLog(i, &l); err != nil || l.Type == raft.LogCommand {
			return false
		}
	}
	return true
}

// applyHere replicates an encoded command from the leader and returns its
// log index.
func (s *Service) applyHere(ctx context.Context, data []byte) (uint64, error) {
	if err := fsm.Check(data); err != nil {
		return 0, err
	}
	timeout := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		timeout = time.Until(d)
	}
	s.applying.RLock()
	defer s.applying.RUnlock()
	if s.handingOff.Load() {
		return 0, errNotLeader // not in the log: the sender tries the next leader
	}
	began := time.Now()
	fut := s.raft.Apply(data, timeout)
	err := fut.Error()
	s.stats.applies.Observe(time.Since(began).Seconds())
	if err != nil {
		if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipTransferInProgress) {
			return 0, errNotLeader // not in the log: the sender tries the new leader
		}
		return 0, errdefs.Wrap(errdefs.ErrUnavailable, err, "iam: replicate (the change may or may not have been made)")
	}
	if resp, ok := fut.Response().(error); ok && resp != nil {
		return 0, resp
	}
	return fut.Index(), nil
}

// KeyPrefix starts every API key secret of our own format.
const KeyPrefix = "dsec_"

// E2BKeyPrefix starts keys in E2B's format ("e2b_" + 40 hex characters).
const E2BKeyPrefix = "e2b_"

// KeyFormat chooses the shape of a new key's secret.
type KeyFormat int

// Key formats.
const (
	FormatDsec KeyFormat = iota
	FormatE2B
)

// HashSecret is what IAM stores for a key secret.
func HashSecret(secret string) string {
	sum := sha256.Sum256([]byte(secret))
	return hex.EncodeToString(sum[:])
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic("iam: crypto/rand failed: " + err.Error())
	}
	return hex.EncodeToString(b)
}

// Authenticate resolves a key secret to its principal.
func (s *Service) Authenticate(secret string) (Principal, error) {
	if secret == "" {
		return Principal{}, errdefs.Unauthenticated("missing API key: send it as \"Authorization: Bearer <key>\" or \"X-API-Key: <key>\"")
	}
	hash := HashSecret(secret)
	k, ok := s.fsm.KeyByHash(hash)
	if !ok || subtle.ConstantTimeCompare([]byte(k.Hash), []byte(hash)) != 1 {
		return Principal{}, errdefs.Unauthenticated("invalid API key")
	}
	return Principal{KeyID: k.ID, Project: k.Project, Role: k.Role}, nil
}

// EnsureRoot creates the root project and an admin key on an empty
// cluster and returns the key's secret; on a cluster that has state it
// returns "".
func (s *Service) EnsureRoot(ctx context.Context) (string, error) {
	if err := s.WaitLeader(ctx); err != nil {
		return "", err
	}
	if !s.fsm.Empty() {
		return "", nil
	}
	// A restarted replica may see a leader before its own state has caught
	// up with the log: root's existence is the answer then (a rollout's
	// restart of the bootstrap replica once stopped here).
	if err := s.apply(ctx, fsm.CmdCreateProject, fsm.CreateProject{Name: project.Root, At: time.Now().UTC()}); errors.Is(err, errdefs.ErrAlreadyExists) {
		return "", nil
	} else if err != nil {
		return "", err
	}
	_, secret, err := s.CreateKey(ctx, project.Root, "admin", fsm.RoleAdmin, FormatDsec)
	return secret, err
}

// CreateKey makes an API key for project and returns it with its secret.
func (s *Service) CreateKey(ctx context.Context, project, name string, role fsm.Role, format KeyFormat) (fsm.Key, string, error) {
	if len(name) > 64 {
		return fsm.Key{}, "", errdefs.InvalidArgument("name: at most 64 characters")
	}
	secret := KeyPrefix + randomHex(24)
	if format == FormatE2B {
		secret = E2BKeyPrefix + randomHex(20)
	}
	k := fsm.Key{ID: "key-" + randomHex(8), Project: project, Name: name, Role: role, Hash: HashSecret(secret), CreatedAt: time.Now().UTC()}
	if err := s.apply(ctx, fsm.CmdCreateKey, fsm.CreateKey{Key: k}); err != nil {
		return fsm.Key{}, "", err
	}
	return k, secret, nil
}

// RevokeKey deletes a key.
func (s *Service) RevokeKey(ctx context.Context, id string) error {
	return s.apply(ctx, fsm.CmdRevokeKey, fsm.RevokeKey{ID: id})
}

// CreateProject creates parent/name.
func (s *Service) CreateProject(ctx context.Context, parent, name string, q fsm.Quota) (fsm.Project, error) {
	if err := s.apply(ctx, fsm.CmdCreateProject, fsm.CreateProject{Parent: parent, Name: name, Quota: q, At: time.Now().UTC()}); err != nil {
		return fsm.Project{}, err
	}
	p, _ := s.fsm.Project(parent + "/" + name)
	return p, nil
}

// SetQuota replaces a project's quota.
func (s *Service) SetQuota(ctx context.Context, path string, q fsm.Quota) (fsm.Project, error) {
	if err := s.apply(ctx, fsm.CmdSetQuota, fsm.SetQuota{Path: path, Quota: q}); err != nil {
		return fsm.Project{}, err
	}
	p, _ := s.fsm.Project(path)
	return p, nil
}

// DeleteProject deletes a leaf project without keys.
func (s *Service) DeleteProject(ctx context.Context, path string) error {
	return s.apply(ctx, fsm.CmdDeleteProject, fsm.DeleteProject{Path: path})
}

// SetPool keeps a warm pool's setting (size 0: its removal) for every
// node to take; p.At is when it was set (zero: now).
func (s *Service) SetPool(ctx context.Context, p fsm.PoolSetting) error {
	if p.At.IsZero() {
		p.At = time.Now().UTC()
	}
	return s.apply(ctx, fsm.CmdSetPool, fsm.SetPool{Pool: p})
}

// State gives read access to the local replica.
func (s *Service) State() *fsm.FSM { return s.fsm }

// slogWriter sends hclog's lines to slog.
type slogWriter struct{ log *slog.Logger }

func (w slogWriter) Write(p []byte) (int, error) {
	w.log.Warn(strings.TrimSpace(string(p)))
	return len(p), nil
}

var _ io.Writer = slogWriter{}

// handOff, on a leader with other voters, lets the changes under way
// finish and hands leadership to another voter before the replica stops:
// a leader that just stops fails the applies in flight as "may or may not
// have been made" (an upgrade restarts every replica in turn). From the
// start new changes are refused as not-leader (they are not in the log,
// so their senders try the next leader), the ones in the log are waited
// for, then another voter is made leader.
func (s *Service) handOff() {
	if s.raft.State() != raft.Leader {
		return
	}
	voters := 0
	for _, m := range s.members() {
		if m.Voter {
			voters++
		}
	}
	if voters < 2 {
		return
	}
	s.applying.Lock() // the changes under way are answered first
	s.handingOff.Store(true)
	s.applying.Unlock()
	if err := s.raft.Barrier(2 * time.Second).Error(); err != nil {
		s.log.Warn("hand-off: changes under way did not finish", logging.Error, err)
	}
	began := time.Now()
	done := make(chan error, 1)
	go func() { done <- s.raft.LeadershipTransfer().Error() }()
	select {
	case err := <-done:
		if err != nil {
			s.log.Warn("hand-off: leadership transfer failed; stopping as leader", logging.Error, err)
			return
		}
		s.log.Info("handed leadership over before stopping", "took", time.Since(began).Round(time.Millisecond))
	case <-time.After(5 * time.Second):
		s.log.Warn("hand-off: leadership transfer took over 5 s; stopping as leader")
	}
}
