package iam

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/pki"
)

func tlsConfigs(t *testing.T, ca *pki.CA, name string) Config {
	cert, err := ca.Issue(name, pki.RoleIAM, []string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	return Config{ServerTLS: ca.ServerConfig(cert, pki.RoleIAM), ClientTLS: ca.ClientConfig(cert)}
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

func TestThreeReplicasSurviveLeaderLoss(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	nodes := []*Service{open(t, ca, dir, "iam-1", true, false)}
	if _, err := nodes[0].EnsureRoot(ctx(t)); err != nil {
		t.Fatal(err)
	}
	for i := 2; i <= 3; i++ {
		n := open(t, ca, dir, fmt.Sprintf("iam-%d", i), false, false)
		if err := nodes[0].AddVoter(fmt.Sprintf("iam-%d", i), n.Addr()); err != nil {
			t.Fatal(err)
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
	if _, err := nodes[0].CreateProject(ctx(t), "root", "a", fsm.Quota{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { _, ok := nodes[2].State().Project("root/a"); return ok })
	// A follower refuses writes and says who leads.
	if _, err := nodes[1].CreateProject(ctx(t), "root", "b", fsm.Quota{}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("write on follower: %v", err)
	}
	nodes[0].Close()
	nodes[0] = nil
	var leader *Service
	waitFor(t, func() bool {
		for _, n := range nodes[1:] {
			if n.raft.State().String() == "Leader" {
				leader = n
				return true
			}
		}
		return false
	})
	if _, err := leader.CreateProject(ctx(t), "root", "after-failover", fsm.Quota{}); err != nil {
		t.Fatalf("write after failover: %v", err)
	}
	for _, n := range nodes[1:] {
		n := n
		waitFor(t, func() bool { _, ok := n.State().Project("root/after-failover"); return ok })
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
