package iam

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// ServeConfig configures a replica run as its own daemon (dsec iam).
type ServeConfig struct {
	Config
	// Join lists replicas of an existing cluster; a replica with no state
	// asks them, one after another, to add it as a voter.
	Join []string
	// Ready, if set, is called once the replica is in a cluster with a
	// leader.
	Ready func(*Service)
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
	if len(cfg.Join) > 0 && !s.isMember(cfg.NodeID) {
		if err := s.joinVia(ctx, cfg.Join); err != nil {
			return err
		}
	}
	wait, cancel := context.WithTimeout(ctx, 60*time.Second)
	err = s.WaitLeader(wait)
	cancel()
	if err != nil {
		return err
	}
	if cfg.Bootstrap {
		if _, err := s.EnsureRoot(ctx); err != nil {
			return err
		}
	}
	st := s.Status()
	s.log.Info("iam replica up", "id", st.ID, "addr", s.Addr(), "state", st.State, "leader", st.LeaderID, "members", len(st.Members))
	if cfg.Ready != nil {
		cfg.Ready(s)
	}
	<-ctx.Done()
	return nil
}

// joinVia asks each address in turn to add this replica, going round
// again (replicas of a new cluster start together) for up to a minute.
func (s *Service) joinVia(ctx context.Context, addrs []string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		var errs []error
		for _, a := range addrs {
			c, cancel := context.WithTimeout(ctx, 20*time.Second)
			err := RemoteJoin(c, a, s.clientTLS, Member{ID: s.id, Addr: s.Addr(), Voter: true})
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
