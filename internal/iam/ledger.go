package iam

import (
	"context"
	"errors"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/iam/fsm"
)

// ReservationTTL is how long a reservation waits to be bound to the
// sandboxes its create made before it lapses (its apiserver died).
const ReservationTTL = 10 * time.Minute

// Reserve holds res in project's quota (and its ancestors') for a create
// about to be tried, and returns the reservation's id. It is refused with
// ResourceExhausted, naming the project and the limit, when it does not fit,
// and with AlreadyExists when key (a create's idempotency key; "" for
// none) is in use in project.
func (s *Service) Reserve(ctx context.Context, project string, res fsm.Resources, key string) (string, error) {
	now := time.Now().UTC()
	id := "rsv-" + randomHex(12)
	err := s.apply(ctx, fsm.CmdReserve, fsm.Reserve{Entry: fsm.Entry{ID: id, Project: project, Res: res, At: now, Expires: now.Add(ReservationTTL), Key: key, Holder: s.id + "/" + s.incarnation}})
	return id, err
}

// HolderGone reports whether the replica that made a reservation is gone:
// an earlier run of this replica, a replica no longer in the cluster, or
// one whose port refuses connections. A holder that cannot be told gone
// is taken as alive.
func (s *Service) HolderGone(holder string) bool {
	id, inc, ok := strings.Cut(holder, "/")
	if !ok {
		return false
	}
	if id == s.id {
		return inc != s.incarnation
	}
	for _, m := range s.members() {
		if m.ID != id {
			continue
		}
		c, err := net.DialTimeout("tcp", m.Addr, time.Second)
		if err != nil {
			return errors.Is(err, syscall.ECONNREFUSED)
		}
		c.Close()
		return false
	}
	return true
}

// Bind gives reservation id to the sandboxes its create made; a share not
// used is given back.
func (s *Service) Bind(ctx context.Context, id string, sandboxIDs []string) error {
	return s.apply(ctx, fsm.CmdBind, fsm.Bind{ID: id, SandboxIDs: sandboxIDs, At: time.Now().UTC()})
}

// Release gives back reservations or sandboxes' entries; unknown ids are
// ignored.
func (s *Service) Release(ctx context.Context, ids ...string) error {
	if len(ids) == 0 {
		return nil
	}
	return s.apply(ctx, fsm.CmdRelease, fsm.Release{IDs: ids})
}

// Adopt counts running sandboxes that have no entry (see fsm.Adopt).
func (s *Service) Adopt(ctx context.Context, entries []fsm.Entry) error {
	if len(entries) == 0 {
		return nil
	}
	return s.apply(ctx, fsm.CmdAdopt, fsm.Adopt{Entries: entries})
}
