package iam

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/version"
	"github.com/prometheus/client_golang/prometheus"
)

// ServeConfig configures a replica run as its own daemon (dsec iam).
type ServeConfig struct {
	Config
	// Join lists replicas of an existing cluster; a replica with no state
	// asks them, one after another, to add it as a voter.
	Join []string
	// AdminKeyFile receives the root project's first admin key when
	// Bootstrap makes it.
	AdminKeyFile string
	// Ready, if set, is called once the replica is in a cluster with a
	// leader.
	Ready func(*Service)
	// Metrics registers the replica's metrics (nil: none).
	Metrics prometheus.Registerer
}

// Serve runs a replica until ctx ends.
func Serve(ctx context.Context, cfg ServeConfig, log *slog.Logger) error {
	if cfg.Bootstrap && len(cfg.Join) > 0 {
		return errors.New("iam: --bootstrap starts a new cluster, --join enters one: give one of them")
	}
	s, err := Open(cfg.Config, log)
	if err != nil {
		return err
	}
	defer s.Close()
	if cfg.Metrics != nil {
		cfg.Metrics.MustRegister(Collector(s))
	}
	if err := s.JoinVia(ctx, cfg.Join, true); err != nil {
		return err
	}
	wait, cancel := context.WithTimeout(ctx, 60*time.Second)
	err = s.WaitLeader(wait)
	cancel()
	if err != nil {
		return err
	}
	if cfg.Bootstrap {
		secret, err := s.EnsureRoot(ctx)
		if err != nil {
			return err
		}
		if secret != "" && cfg.AdminKeyFile != "" {
			if err := os.WriteFile(cfg.AdminKeyFile, []byte(secret+"\n"), 0o600); err != nil {
				return fmt.Errorf("iam: admin key: %w", err)
			}
		}
	}
	st := s.Status()
	s.log.Info("iam replica up", "version", version.Version, "id", st.ID, "addr", s.Addr(), "state", st.State, "leader", st.LeaderID, "members", len(st.Members))
	if cfg.Ready != nil {
		cfg.Ready(s)
	}
	<-ctx.Done()
	return nil
}

// JoinVia asks each address in turn to add this replica (a voter, or a
// non-voting reader such as an apiserver's), going round again (replicas of
// a new cluster start together) for up to a minute. A replica that is a
// member already, or has no addresses to ask, does nothing.
func (s *Service) JoinVia(ctx context.Context, addrs []string, voter bool) error {
	if len(addrs) == 0 || s.isMemberAt(s.id, s.Addr()) {
		return nil // a member at another address (a new port) joins again
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		var errs []error
		for _, a := range addrs {
			c, cancel := context.WithTimeout(ctx, 20*time.Second)
			err := RemoteJoin(c, a, s.clientTLS, Member{ID: s.id, Addr: s.Addr(), Voter: voter})
			cancel()
			if err == nil {
				return nil
			}
			errs = append(errs, fmt.Errorf("%s: %w", a, err))
		}
		select {
		case <-ctx.Done():
			return errdefs.Wrap(errdefs.ErrUnavailable, errors.Join(errs...), "iam: join (tried for a minute)")
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// CatchUp waits until this replica knows a leader and has applied every
// entry it knows to be committed, and at least index (a commit index the
// caller learned elsewhere, such as the leader's own; 0 for none).
func (s *Service) CatchUp(ctx context.Context, index uint64) error {
	for {
		st := s.Status()
		if st.LeaderID != "" && st.CommitIndex > 0 && s.holds(max(st.CommitIndex, index)) {
			return nil
		}
		select {
		case <-ctx.Done():
			return errdefs.Wrap(errdefs.ErrUnavailable, ctx.Err(), "iam: replica did not catch up to index %d (status %+v)", index, st)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
