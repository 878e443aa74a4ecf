package apiserver

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/placement"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/watcher"
)

// Quotas [ours]: every create first reserves its resources in IAM's
// replicated ledger (iam/fsm/ledger.go), which Raft orders, so creates
// through any number of apiservers can never pass a quota together. The
// reservation is bound to the sandboxes made, or released when none was;
// a removal through an apiserver releases its entry; the reconciler below
// releases entries whose sandbox vanished otherwise.

// holdQuota reserves need in proj's quota, under a create's idempotency
// key if it has one.
func (s *Server) holdQuota(ctx context.Context, proj string, need placement.Resources, key string) (string, error) {
	rsv, err := s.iam.Reserve(ctx, proj, fsm.Resources{Sandboxes: need.Sandboxes, CPUCores: need.CPUCores, MemoryMB: need.MemoryMB}, key)
	if err != nil {
		s.placeStats.held(err)
	}
	return rsv, err
}

// maxIdempotencyKey bounds the Idempotency-Key header.
const maxIdempotencyKey = 128

// idempotencyKey reads a create's Idempotency-Key header.
func idempotencyKey(h http.Header) (string, error) {
	k := h.Get("Idempotency-Key")
	if len(k) > maxIdempotencyKey {
		return "", errdefs.InvalidArgument("Idempotency-Key: %d bytes, at most %d", len(k), maxIdempotencyKey)
	}
	for _, r := range k {
		if r < 0x21 || r > 0x7e {
			return "", errdefs.InvalidArgument("Idempotency-Key: printable ASCII without spaces only")
		}
	}
	return k, nil
}

// replay answers a create retried with the idempotency key of an earlier
// one in proj: once that one made its sandbox, with that sandbox; while it
// runs, after waiting for it. ok is false when no create holds the key (it
// never ran, or failed and gave it back): then this one goes ahead.
func (s *Server) replay(ctx context.Context, proj, key string) (sb *sandboxv1.Sandbox, ok bool, err error) {
	for {
		e, found := s.iam.State().EntryByKey(proj, key, time.Now())
		switch {
		case !found:
			return nil, false, nil
		case !strings.HasPrefix(e.ID, "rsv-"):
			c, err := s.sandboxEdge(e.ID)
			if err != nil {
				return nil, true, err
			}
			resp, err := c.Edge.GetSandbox(ctx, connect.NewRequest(&edgev1.GetSandboxRequest{SandboxId: e.ID, Scope: proj}))
			if err != nil {
				return nil, true, err
			}
			return resp.Msg.Sandbox, true, nil
		}
		// A reservation: its create is running, on this apiserver or
		// another, or its apiserver died with it.
		if s.iam.HolderGone(e.Holder) {
			sb, done, err := s.takeOver(ctx, proj, e)
			if done || err != nil {
				return sb, true, err
			}
			continue // released: the caller reserves afresh
		}
		select {
		case <-ctx.Done():
			return nil, true, errdefs.Retry(errdefs.Unavailable("idempotency key %q: the create that holds it is still running; retry", key))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// takeOver settles the reservation of a create whose apiserver died, for
// its client's retry [ours]. Every edge is fenced (no later create for the
// reservation is admitted) and asked what it made for it: a sandbox made
// is bound to the reservation and answered; one still being made is
// waited for; none made anywhere releases the reservation (done false),
// and the retry makes its own. An edge that cannot be asked leaves it
// undecided: Unavailable, retry.
func (s *Server) takeOver(ctx context.Context, proj string, e fsm.Entry) (*sandboxv1.Sandbox, bool, error) {
	for {
		nodes := s.watcher.View().Nodes
		var (
			mu      sync.Mutex
			wg      sync.WaitGroup
			found   []*sandboxv1.Sandbox
			unasked []string
		)
		for _, n := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := s.edges.Get(n.Addr).Edge.FenceReservation(ctx, connect.NewRequest(&edgev1.FenceReservationRequest{Reservation: e.ID}))
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					unasked = append(unasked, n.ID)
					return
				}
				found = append(found, resp.Msg.Sandboxes...)
			}()
		}
		wg.Wait()
		creating := false
		for _, sb := range found {
			switch sb.State {
			case sandboxv1.SandboxState_SANDBOX_STATE_RUNNING:
				s.log.Info("took over the create of a departed apiserver: its sandbox stands", "reservation", e.ID, logging.SandboxID, sb.Id)
				if err := s.iam.Bind(ctx, e.ID, []string{sb.Id}); err != nil {
					return nil, true, err
				}
				return sb, true, nil
			case sandboxv1.SandboxState_SANDBOX_STATE_CREATING:
				creating = true
			}
		}
		switch {
		case len(unasked) > 0:
			return nil, true, errdefs.Retry(errdefs.Unavailable("idempotency key %q: its create's apiserver is gone and nodes %v cannot be asked what it made; retry", e.Key, unasked))
		case !creating:
			s.log.Info("took over the create of a departed apiserver: it made nothing", "reservation", e.ID)
			return nil, false, s.iam.Release(ctx, e.ID)
		}
		select {
		case <-ctx.Done():
			return nil, true, errdefs.Retry(errdefs.Unavailable("idempotency key %q: its sandbox is still being made; retry", e.Key))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// settleQuota binds reservation rsv to the sandboxes made, or releases it
// when none was. It runs whatever became of the caller's request.
func (s *Server) settleQuota(rsv string, made []string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var err error
	if len(made) == 0 {
		err = s.iam.Release(ctx, rsv)
	} else {
		err = s.iam.Bind(ctx, rsv, made)
	}
	if err != nil {
		// The reservation lapses by itself (iam.ReservationTTL); a
		// sandbox left unbound is not counted until then.
		s.log.Warn("quota reservation not settled", "reservation", rsv, "sandboxes", made, logging.Error, err)
	}
}

// releaseQuota gives back a removed sandbox's entry.
func (s *Server) releaseQuota(sandboxID string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.iam.Release(ctx, sandboxID); err != nil {
		s.log.Warn("quota entry of a removed sandbox not released; the reconciler will", logging.SandboxID, sandboxID, logging.Error, err)
	}
}

// ReconcileEvery is how often an apiserver compares the ledger with the
// sandboxes the edges hold.
const ReconcileEvery = 2 * time.Second

// reconcileMargin covers clock skew between the apiserver that bound an
// entry and this one: an entry bound later than a listing began, less
// this, may be missing from that listing and is kept.
const reconcileMargin = 2 * time.Second

// lostAfter is how long a node the watcher knows may go unanswered before
// its sandboxes' entries are released (the edge is lost). A node absent
// from the view (never reached by this apiserver) is never judged lost;
// if a lost node comes back, its running sandboxes are adopted again.
const lostAfter = 5 * time.Minute

// adoptAfter is how old a running sandbox without an entry must be before
// the reconciler counts it: its create's bind comes well within it.
const adoptAfter = 30 * time.Second

// lost reports whether node has been unreachable in every view for
// lostAfter; only the reconciler calls it.
func (s *Server) lost(view *watcher.View, node string, now time.Time) bool {
	n, ok := view.Node(node)
	if !ok || n.Healthy {
		delete(s.missingSince, node)
		return false
	}
	since, ok := s.missingSince[node]
	if !ok {
		s.missingSince[node] = now
		return false
	}
	return now.Sub(since) > lostAfter
}

// Run reconciles the quota ledger and the nodes' pools until ctx ends.
func (s *Server) Run(ctx context.Context) {
	t := time.NewTicker(ReconcileEvery)
	defer t.Stop()
	pools := time.NewTicker(s.cfg.PoolSyncEvery)
	defer pools.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.reconcileQuota(ctx)
		case now := <-pools.C:
			s.syncPools(ctx, now)
		}
	}
}

// reconcileQuota releases the entries of sandboxes that are gone: their
// node answered a listing begun after the entry was bound and did not
// name them, or their node has not answered for lostAfter. A node that
// does not answer keeps its entries meanwhile: its sandboxes may well be
// running. Running sandboxes without an entry are adopted.
func (s *Server) reconcileQuota(ctx context.Context) {
	began := time.Now()
	view := s.watcher.View()
	counted := map[string]bool{}
	for _, e := range s.iam.State().Entries() {
		counted[e.ID] = true
	}
	var adopt []fsm.Entry
	live := map[string]map[string]bool{} // node -> sandbox ids, for nodes that answered
	for _, n := range view.Healthy() {
		lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		resp, err := s.edges.Get(n.Addr).Edge.ListSandboxes(lctx, connect.NewRequest(&edgev1.ListSandboxesRequest{Scope: project.Root}))
		cancel()
		if err != nil {
			continue
		}
		ids := map[string]bool{}
		for _, sb := range resp.Msg.Sandboxes {
			ids[sb.Id] = true
			if !counted[sb.Id] && sb.CreatedAt != nil && sb.CreatedAt.AsTime().Before(began.Add(-adoptAfter)) {
				r := sb.Spec.GetResources()
				adopt = append(adopt, fsm.Entry{ID: sb.Id, Project: sb.Project, At: began,
					Res: fsm.Resources{Sandboxes: 1, CPUCores: r.GetCpuCores(), MemoryMB: r.GetMemoryMb()}})
			}
		}
		live[n.ID] = ids
	}
	var gone []string
	for _, e := range s.iam.State().Entries() {
		if strings.HasPrefix(e.ID, "rsv-") || !e.At.Before(began.Add(-reconcileMargin)) {
			continue
		}
		_, node, err := sandboxid.Parse(e.ID)
		if err != nil {
			continue
		}
		ids, answered := live[string(node)]
		if (answered && !ids[e.ID]) || s.lost(view, string(node), began) {
			gone = append(gone, e.ID)
		}
	}
	if len(adopt) > 0 {
		if err := s.iam.Adopt(ctx, adopt); err != nil {
			s.log.Warn("quota reconcile: adopt failed", "sandboxes", len(adopt), logging.Error, err)
		} else {
			s.log.Info("quota reconcile: counted running sandboxes that had no entry", "sandboxes", len(adopt))
		}
	}
	if len(gone) == 0 {
		return
	}
	if err := s.iam.Release(ctx, gone...); err != nil {
		s.log.Warn("quota reconcile: release failed", "sandboxes", len(gone), logging.Error, err)
		return
	}
	s.log.Info("quota reconcile: released the entries of vanished sandboxes", "sandboxes", len(gone))
}
