package iam

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/pki"
)

func tlsConfigs(t *testing.T, ca *pki.CA, name string) Config {
	cert, err := ca.Issue(name, pki.RoleIAM, []string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	return Config{ServerTLS: ca.ServerConfig(cert, pki.RoleIAM, pki.RoleAPIServer), ClientTLS: ca.ClientConfig(cert)}
}

func open(t *testing.T, ca *pki.CA, dir, id string, bootstrap, single bool) *Service {
	t.Helper()
	cfg := tlsConfigs(t, ca, id)
	cfg.Dir, cfg.NodeID, cfg.Bind, cfg.Bootstrap, cfg.SingleNode = filepath.Join(dir, id), id, "127.0.0.1:0", bootstrap, single
	s, err := Open(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestSingleNodeBootstrapAuthAndRestart(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	s := open(t, ca, dir, "iam-1", true, true)
	secret, err := s.EnsureRoot(ctx(t))
	if err != nil || !strings.HasPrefix(secret, KeyPrefix) || len(secret) != len(KeyPrefix)+48 {
		t.Fatalf("EnsureRoot = %q, %v", secret, err)
	}
	p, err := s.Authenticate(secret)
	if err != nil || p.Project != "root" || p.Role != fsm.RoleAdmin {
		t.Fatalf("Authenticate = %+v, %v", p, err)
	}
	if _, err := s.Authenticate("dsec_wrong"); !errors.Is(err, errdefs.ErrUnauthenticated) {
		t.Fatalf("wrong key: %v", err)
	}
	if _, err := s.Authenticate(""); !errors.Is(err, errdefs.ErrUnauthenticated) {
		t.Fatalf("no key: %v", err)
	}
	if _, err := s.CreateProject(ctx(t), "root", "team", fsm.Quota{CPUCores: 4}); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s = open(t, ca, dir, "iam-1", true, true)
	defer s.Close()
	if again, err := s.EnsureRoot(ctx(t)); err != nil || again != "" {
		t.Fatalf("second EnsureRoot = %q, %v", again, err)
	}
	if _, err := s.Authenticate(secret); err != nil {
		t.Fatalf("key lost across restart: %v", err)
	}
	if q := s.State().Effective("root/team"); q.CPUCores != 4 {
		t.Fatalf("project lost across restart: %+v", q)
	}
}

func TestThreeReplicasForwardWritesAndSurviveLeaderLoss(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	nodes := []*Service{open(t, ca, dir, "iam-1", true, false)}
	if _, err := nodes[0].EnsureRoot(ctx(t)); err != nil {
		t.Fatal(err)
	}
	for i := 2; i <= 3; i++ {
		n := open(t, ca, dir, fmt.Sprintf("iam-%d", i), false, false)
		// iam-3 joins through iam-2, a follower: the join reaches the leader.
		if err := nodes[len(nodes)-1].Join(ctx(t), Member{ID: fmt.Sprintf("iam-%d", i), Addr: n.Addr(), Voter: true}); err != nil {
			t.Fatalf("join iam-%d: %v", i, err)
		}
		nodes = append(nodes, n)
	}
	defer func() {
		for _, n := range nodes {
			if n != nil {
				n.Close()
			}
		}
	}()
	// A write sent to a follower is made by the leader, and every replica sees it.
	if nodes[1].raft.State() == raft.Leader {
		t.Fatal("iam-2 leads; the test wants a follower")
	}
	if _, err := nodes[1].CreateProject(ctx(t), "root", "via-follower", fsm.Quota{CPUCores: 2}); err != nil {
		t.Fatalf("write on a follower: %v", err)
	}
	for _, n := range nodes {
		waitFor(t, func() bool { _, ok := n.State().Project("root/via-follower"); return ok })
	}
	// An error from the leader's state machine comes back classed.
	if _, err := nodes[2].CreateProject(ctx(t), "root", "via-follower", fsm.Quota{}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("duplicate project through a follower: %v, want AlreadyExists", err)
	}
	st := nodes[2].Status()
	if st.LeaderID != "iam-1" || st.State != "Follower" || len(st.Members) != 3 || st.Term == 0 || st.AppliedIndex == 0 {
		t.Fatalf("status of iam-3: %+v", st)
	}
	// The status of another replica, asked over its port.
	remote, err := RemoteStatus(ctx(t), nodes[0].Addr(), tlsConfigs(t, ca, "asker").ClientTLS)
	if err != nil || remote.ID != "iam-1" || remote.State != "Leader" {
		t.Fatalf("remote status of iam-1: %+v, %v", remote, err)
	}

	nodes[0].Close()
	nodes[0] = nil
	// Writes go on through whichever replica gets them once a new leader is elected.
	for i, n := range nodes[1:] {
		if _, err := n.CreateProject(ctx(t), "root", fmt.Sprintf("after-failover-%d", i), fsm.Quota{}); err != nil {
			t.Fatalf("write on iam-%d after the leader died: %v", i+2, err)
		}
	}
	// The dead replica is removed through a follower; the other two go on.
	var follower *Service
	for _, n := range nodes[1:] {
		if n.raft.State() != raft.Leader {
			follower = n
		}
	}
	if err := follower.Remove(ctx(t), "iam-1"); err != nil {
		t.Fatalf("remove iam-1: %v", err)
	}
	if err := follower.Remove(ctx(t), "iam-9"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("remove an unknown replica: %v, want NotFound", err)
	}
	waitFor(t, func() bool { return len(follower.Status().Members) == 2 })
	for _, n := range nodes[1:] {
		for i := range 2 {
			waitFor(t, func() bool { _, ok := n.State().Project(fmt.Sprintf("root/after-failover-%d", i)); return ok })
		}
	}
}

// TestSnapshotsCompactTheLog: past the threshold a replica snapshots its
// state and drops the log before it; a restart restores from the snapshot.
func TestSnapshotsCompactTheLog(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	cfg := tlsConfigs(t, ca, "iam-1")
	cfg.Dir, cfg.NodeID, cfg.Bind, cfg.Bootstrap, cfg.SingleNode, cfg.SnapshotThreshold = filepath.Join(dir, "iam-1"), "iam-1", "127.0.0.1:0", true, true, 16
	s, err := Open(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.EnsureRoot(ctx(t)); err != nil {
		t.Fatal(err)
	}
	for i := range 60 {
		if _, err := s.CreateProject(ctx(t), "root", fmt.Sprintf("p%d", i), fsm.Quota{}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, func() bool { return s.Status().LastSnapshotIndex > 16 })
	// Raft records the snapshot before it drops the log behind it, so the
	// compaction is waited for, not read once.
	waitFor(t, func() bool { first, err := s.store.FirstIndex(); return err == nil && first > 1 })
	s.Close()
	s, err = Open(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.WaitLeader(ctx(t)); err != nil {
		t.Fatal(err)
	}
	for i := range 60 {
		if _, ok := s.State().Project(fmt.Sprintf("root/p%d", i)); !ok {
			t.Fatalf("root/p%d lost across a restart from a snapshot", i)
		}
	}
}

// TestRaftPortRefusesStrangers: a certificate of another CA, or of the
// cluster's CA with another role, is refused; no certificate at all too.
func TestRaftPortRefusesStrangers(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	s := open(t, ca, dir, "iam-1", true, true)
	defer s.Close()
	if err := s.WaitLeader(ctx(t)); err != nil {
		t.Fatal(err)
	}
	other, _ := pki.LoadOrCreateCA(filepath.Join(dir, "other-pki"))
	foreign, _ := other.Issue("iam-x", pki.RoleIAM, nil)
	edgeCert, _ := ca.Issue("edge-x", pki.RoleEdge, nil)
	foreignTLS := other.ClientConfig(foreign)
	foreignTLS.RootCAs = ca.Pool // it trusts us; we must not trust it
	for name, cfg := range map[string]*tls.Config{
		"another CA":     foreignTLS,
		"role edge":      ca.ClientConfig(edgeCert),
		"no certificate": {RootCAs: ca.Pool},
	} {
		// Refused in the handshake: a TLS alert, or a broken pipe when
		// the server has closed before the request is written.
		if st, err := RemoteStatus(ctx(t), s.Addr(), cfg); err == nil {
			t.Errorf("%s: the raft port answered: %+v", name, st)
		}
	}
	if _, err := RemoteStatus(ctx(t), s.Addr(), tlsConfigs(t, ca, "iam-2").ClientTLS); err != nil {
		t.Fatalf("a replica's certificate: %v", err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("condition not met within 20s")
}

// FuzzReplicaRequest sends arbitrary bytes, as a replica with a valid
// certificate could, to a replica's request handler: nothing may panic,
// and the replica must still apply a good write afterwards.
func FuzzReplicaRequest(f *testing.F) {
	dir := f.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	cert, _ := ca.Issue("iam-1", pki.RoleIAM, []string{"127.0.0.1"})
	s, err := Open(Config{Dir: filepath.Join(dir, "iam-1"), NodeID: "iam-1", Bind: "127.0.0.1:0", Bootstrap: true, SingleNode: true,
		ServerTLS: ca.ServerConfig(cert, pki.RoleIAM), ClientTLS: ca.ClientConfig(cert)}, nil)
	if err != nil {
		f.Fatal(err)
	}
	defer s.Close()
	if _, err := s.EnsureRoot(context.Background()); err != nil {
		f.Fatal(err)
	}
	frame := func(op byte, payload string) []byte {
		var b bytes.Buffer
		writeFrame(&b, op, []byte(payload)) //nolint:errcheck // a buffer
		return b.Bytes()
	}
	f.Add(frame(byte(opStatus), ""))
	f.Add(frame(byte(opApply), "\x01{\"parent\":\"root\",\"name\":\"x\"}"))
	f.Add(frame(byte(opApply), "\x7f{}"))
	f.Add(frame(byte(opApply), "\x86{\"entry\":{\"id\":\"rsv-1\",\"project\":\"root\",\"res\":{\"sandboxes\":1}}}"))
	f.Add(frame(byte(opJoin), "{\"id\":\"\"}"))
	f.Add(frame(byte(opRemove), "nobody"))
	f.Add(frame(byte(opApply|opNoForward), "\x05{\"id\":\"key-x\"}"))
	f.Add([]byte{1, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		client, server := net.Pipe()
		done := make(chan struct{})
		go func() { defer close(done); s.serveRequest(server, bufio.NewReader(server)) }()
		client.SetDeadline(time.Now().Add(5 * time.Second)) //nolint:errcheck // a pipe
		client.Write(data)                                  //nolint:errcheck // the handler may stop reading
		client.Close()
		<-done
	})
	if _, err := s.CreateProject(context.Background(), "root", "after-fuzz", fsm.Quota{}); err != nil && !errors.Is(err, errdefs.ErrAlreadyExists) {
		f.Fatalf("a write after the fuzzing: %v", err)
	}
}

// TestNonVoterReadsItsWritesAndCannotChangeVoters: an apiserver's
// non-voting replica sees its own writes at once (it waits for the
// leader's index), and its certificate may join as a non-voter but not
// add voters or remove replicas.
func TestNonVoterReadsItsWritesAndCannotChangeVoters(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	leader := open(t, ca, dir, "iam-1", true, false)
	defer leader.Close()
	if _, err := leader.EnsureRoot(ctx(t)); err != nil {
		t.Fatal(err)
	}
	apiCert, _ := ca.Issue("api-1", pki.RoleAPIServer, []string{"127.0.0.1"})
	reader, err := Open(Config{Dir: filepath.Join(dir, "api-1"), NodeID: "api-1", Bind: "127.0.0.1:0",
		ServerTLS: ca.ServerConfig(apiCert, pki.RoleIAM), ClientTLS: ca.ClientConfig(apiCert)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	// The leader accepts apiserver certificates (as dsec iam does).
	leaderPort := leader.Addr()
	apiTLS := ca.ClientConfig(apiCert)
	if err := RemoteJoin(ctx(t), leaderPort, apiTLS, Member{ID: "api-1", Addr: reader.Addr(), Voter: true}); err == nil {
		t.Fatal("an apiserver certificate added a voter")
	}
	if err := RemoteRemove(ctx(t), leaderPort, apiTLS, "iam-1"); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("an apiserver certificate removing a replica: %v", err)
	}
	if err := reader.JoinVia(ctx(t), []string{leaderPort}, false); err != nil {
		t.Fatalf("non-voter join: %v", err)
	}
	for i := range 20 {
		p, err := reader.CreateProject(ctx(t), "root", fmt.Sprintf("r%d", i), fsm.Quota{MaxSandboxes: 3})
		if err != nil || p.Path != fmt.Sprintf("root/r%d", i) || p.Quota.MaxSandboxes != 3 {
			t.Fatalf("create through the non-voter, read at once: %+v, %v", p, err)
		}
	}
}

// A leader that stops hands over first: writes sent through the followers
// while it stops all succeed (none fails as "may or may not have been
// made"), and another replica leads.
func TestAStoppingLeaderHandsOverWithoutFailingWrites(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	nodes := []*Service{open(t, ca, dir, "iam-1", true, false)}
	if _, err := nodes[0].EnsureRoot(ctx(t)); err != nil {
		t.Fatal(err)
	}
	for i := 2; i <= 3; i++ {
		n := open(t, ca, dir, fmt.Sprintf("iam-%d", i), false, false)
		if err := nodes[0].Join(ctx(t), Member{ID: fmt.Sprintf("iam-%d", i), Addr: n.Addr(), Voter: true}); err != nil {
			t.Fatalf("join iam-%d: %v", i, err)
		}
		nodes = append(nodes, n)
	}
	defer func() {
		for _, n := range nodes[1:] {
			n.Close()
		}
	}()
	var wg sync.WaitGroup
	var stop atomic.Bool
	var mu sync.Mutex
	var errs []error
	writes := 0
	for w, n := range nodes[1:] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				_, err := n.CreateProject(ctx(t), "root", fmt.Sprintf("w%d-%d", w, i), fsm.Quota{})
				mu.Lock()
				writes++
				if err != nil {
					errs = append(errs, err)
				}
				mu.Unlock()
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	nodes[0].Close()
	time.Sleep(time.Second)
	stop.Store(true)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d of %d writes failed while the leader stopped: %v", len(errs), writes, errs[0])
	}
	if st := nodes[1].Status(); st.LeaderID == "" || st.LeaderID == "iam-1" {
		t.Fatalf("after the leader stopped: %+v", st)
	}
	t.Logf("%d writes, none failed, while the leader handed over and stopped", writes)
}

// A stopping replica answers the requests it took before it goes, and
// sends new ones to the leader ("not the leader") instead of ending them
// with its connection: their senders cannot tell an EOF from a change
// made (an upgrade of the leader lost a create so).
func TestStoppingReplicaAnswersWhatItTook(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	s := open(t, ca, dir, "iam-1", true, true)
	defer s.Close()
	s.requests.Add(1) // a request being answered
	drained := make(chan struct{})
	go func() { s.drainRequests(10 * time.Second); close(drained) }()
	select {
	case <-drained:
		t.Fatal("the drain did not wait for the request being answered")
	case <-time.After(100 * time.Millisecond):
	}
	client, server := net.Pipe()
	go s.serveRequest(server, bufio.NewReader(server))
	client.SetDeadline(time.Now().Add(5 * time.Second)) //nolint:errcheck // a pipe
	if err := writeFrame(client, byte(opStatus), nil); err != nil {
		t.Fatal(err)
	}
	if code, _, err := readFrame(client); err != nil || byte(code) != codeNotLeader {
		t.Fatalf("a request while draining: code %d, %v; want not-the-leader", code, err)
	}
	client.Close()
	s.requests.Done()
	select {
	case <-drained:
	case <-time.After(5 * time.Second):
		t.Fatal("the drain did not end once the request was answered")
	}
}

// A request taken before a replica stopped, still looking for the leader
// when Raft shut down, is answered at once: "not the leader" to a replica
// that sent it (which asks the leader itself), Unavailable here; it used
// to look for a leader until its deadline, outliving the stop's drains.
func TestForwardingEndsWhenRaftShutsDown(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	s := open(t, ca, dir, "iam-1", true, true)
	defer s.Close()
	if err := s.raft.Shutdown().Error(); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	_, err := s.toLeader(ctx(t), opApply, nil)
	if !errors.Is(err, errNotLeader) || !errors.Is(err, errdefs.ErrUnavailable) || time.Since(began) > time.Second {
		t.Fatalf("forwarding on a shut-down replica: %v after %s", err, time.Since(began))
	}
}
