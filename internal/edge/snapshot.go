package edge

import (
	"context"
	"regexp"
	"sort"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// Snapshot snapshots a sandbox; it keeps running.
func (e *Edge) Snapshot(ctx context.Context, id, scope, name string) (*sandboxv1.Snapshot, error) {
	if name != "" && (!snapshotNameRE.MatchString(name) || sandboxid.IsSnapshot(name)) {
		return nil, errdefs.InvalidArgument("name %q: 1 to 128 letters, digits, '.', '_' and '-', starting with a letter or digit, and not a snapshot id (\"snap-<node>-<16 characters>\")", errdefs.Clip(name, 140))
	}
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	began := time.Now()
	snap, _, err := sb.Snapshot(ctx, e.snaps, name, false, nil)
	e.prom.took("snapshot", sb.Backend().Name(), began, err)
	if err != nil {
		return nil, err
	}
	return snap.Proto(e.node), nil
}

var snapshotNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ListSnapshots lists the snapshots in scope, of one sandbox if given.
func (e *Edge) ListSnapshots(scope, sandbox string) ([]*sandboxv1.Snapshot, error) {
	out, foreign := e.snaps.List(scope, sandbox)
	if sandbox != "" && len(out) == 0 {
		// Another project's sandbox is not found here, as in every other
		// call; an empty list would say it exists. (The caller's own
		// sandbox that is gone, with no snapshots left, lists none.)
		if _, err := e.lookup(sandbox, scope); err != nil {
			_, anyErr := e.lookup(sandbox, "")
			if elsewhere := foreign || anyErr == nil; elsewhere || !errdefs.IsNotFound(err) {
				return nil, err
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.AsTime().Before(out[j].CreatedAt.AsTime()) })
	return out, nil
}

// DeleteSnapshot deletes a snapshot and frees its storage.
func (e *Edge) DeleteSnapshot(id, scope string) error {
	s, err := e.snaps.Lookup(id, scope)
	if err != nil {
		return err
	}
	return e.snaps.Drop(s)
}

// copyOptions are the differences a restored copy may have: its project
// and what a restore may override.
type copyOptions struct {
	project string
	RestoreOptions
}

// RestoreOptions override a restored sandbox's spec: its time to live
// (0: the snapshot's), metadata (nil: the snapshot's) and what happens
// when its time to live runs out (unspecified: the snapshot's), and
// whether only an explicit resume wakes it (nil: the snapshot's).
type RestoreOptions struct {
	Timeout        int64
	Metadata       map[string]string
	OnTimeout      sandboxv1.OnTimeout
	ExplicitResume *bool
}

// startCopy admits and starts one sandbox from a snapshot, with its own id,
// directory, agent socket and identity. On failure nothing of it remains.
func (e *Edge) startCopy(ctx context.Context, snap *snapshots.Snapshot, sn backend.Snapshotter, be backend.Backend, o copyOptions) (_ *sandboxv1.Sandbox, err error) {
	defer func(began time.Time) { e.prom.took("restore", be.Name(), began, err) }(time.Now())
	spec := proto.Clone(snap.SandboxSpec).(*sandboxv1.SandboxSpec)
	if o.Timeout != 0 {
		if err := sandboxspec.CheckTimeout(o.Timeout, e.cfg.Limits); err != nil {
			return nil, err
		}
		spec.TimeoutSeconds = o.Timeout
	}
	if len(o.Metadata) > 0 {
		if err := sandboxspec.CheckMetadata(o.Metadata); err != nil {
			return nil, err
		}
		spec.Metadata = o.Metadata
	}
	if o.OnTimeout != sandboxv1.OnTimeout_ON_TIMEOUT_UNSPECIFIED {
		if _, ok := sandboxv1.OnTimeout_name[int32(o.OnTimeout)]; !ok {
			return nil, errdefs.InvalidArgument("on_timeout %d: want KILL or PAUSE", o.OnTimeout)
		}
		spec.OnTimeout = o.OnTimeout
	}
	if o.ExplicitResume != nil {
		spec.ExplicitResume = *o.ExplicitResume
	}
	// The source's policy, admitted on its node, is admitted again on this
	// one (which may keep other addresses closed).
	if err := checkPolicy(asSandboxNetwork(e.net), "network.rules", spec.Network); err != nil {
		return nil, err
	}
	rec := &records.Record{ID: sandboxid.New(e.node), Project: o.project, State: records.StateCreating, CreatedAt: time.Now(), ImageDigest: snap.ImageDigest, SourceSnapshot: string(snap.ID),
		AgentKey: snap.AgentKey, AgentVersion: snap.AgentVersion}
	if err := rec.SetSpec(spec); err != nil {
		return nil, err
	}
	sb, err := e.admit(rec, be)
	if err != nil {
		return nil, err
	}
	if err := sb.RestoreInto(ctx, snap, sn); err != nil {
		if cerr := sb.Discard(context.WithoutCancel(ctx)); cerr != nil {
			e.log.Error("clean up a copy that failed to start", logging.SandboxID, rec.ID, logging.Error, cerr)
		}
		return nil, err
	}
	return sb.View(), nil
}

// Restore starts a new sandbox in project into (empty: the snapshot's)
// from a snapshot: one of this node's, or,
// with src, one another node exported, pulled from there first.
func (e *Edge) Restore(ctx context.Context, snapID, scope, into string, o RestoreOptions, src *edgev1.SnapshotSource) (*sandboxv1.Sandbox, error) {
	var snap *snapshots.Snapshot
	sid, node, err := sandboxid.ParseSnapshot(snapID)
	if err != nil {
		return nil, err
	}
	if node != e.node && src != nil {
		if src.Addr == "" || src.Token == "" {
			return nil, errdefs.InvalidArgument("source: the holder's addr and the export's token are both required")
		}
		s, release, err := e.snaps.Pulled(ctx, sid, src)
		if err != nil {
			return nil, err
		}
		defer release()
		if !project.Within(s.Project, scope) {
			return nil, errdefs.NotFound("snapshot %s: no such snapshot", snapID)
		}
		snap = s
	} else if snap, err = e.snaps.Lookup(snapID, scope); err != nil {
		return nil, err
	}
	if into == "" {
		into = snap.Project
	}
	if !project.Within(into, scope) {
		return nil, errdefs.PermissionDenied("project %q: outside your scope %q", into, scope)
	}
	be, err := e.backends.get(snap.Backend)
	if err != nil {
		return nil, err
	}
	sn, err := sandbox.Snapshotter(be)
	if err != nil {
		return nil, err
	}
	return e.startCopy(ctx, snap, sn, be, copyOptions{project: into, RestoreOptions: o})
}

// ForkResult is one copy's outcome.
type ForkResult struct {
	Sandbox *sandboxv1.Sandbox
	Err     error
}

// ForkOutcome is what a fork did.
type ForkOutcome struct {
	Results []ForkResult
	// SourcePaused is how long the source did not run.
	SourcePaused time.Duration
	// SourceErr is set when the source could not be brought back.
	SourceErr error
	// Export lets other edges pull the fork's snapshot (ForkRequest.Export);
	// ExportErr says why there is none (the copies here stand).
	Export    *edgev1.SnapshotExport
	ExportErr error
}

// ForkRequest is what a fork makes.
type ForkRequest struct {
	Count    int
	Timeout  int64             // copies' time to live; 0: the source's
	Metadata map[string]string // copies' metadata; empty: the source's
	// Export keeps the snapshot for other edges to pull (their copies), until
	// ReleaseExport or the lease ends; Count may then be 0.
	Export bool
}

// Fork captures a running sandbox, brings it back, and starts count copies
// of it. Each copy's outcome is reported; a failed copy leaves nothing.
func (e *Edge) Fork(ctx context.Context, id, scope string, req ForkRequest) (*ForkOutcome, error) {
	count, timeout, metadata := req.Count, req.Timeout, req.Metadata
	if count < 0 || count > sandboxspec.MaxForkCount || count == 0 && !req.Export {
		return nil, errdefs.InvalidArgument("count %d: want 1 to %d (0 only with export)", count, sandboxspec.MaxForkCount)
	}
	if len(metadata) > 0 {
		if err := sandboxspec.CheckMetadata(metadata); err != nil {
			return nil, err
		}
	}
	if timeout != 0 {
		if err := sandboxspec.CheckTimeout(timeout, e.cfg.Limits); err != nil {
			return nil, err
		}
	}
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	sn, err := sandbox.Snapshotter(sb.Backend())
	if err != nil {
		return nil, err
	}
	var export *edgev1.SnapshotExport
	var exportErr error
	exported := make(chan struct{})
	results := make([]ForkResult, count)
	began := time.Now()
	snap, paused, srcErr := sb.Snapshot(ctx, e.snaps, "", true, func(snap *snapshots.Snapshot) {
		if req.Export {
			// Hashed for the manifest while the copies here start.
			go func() {
				defer close(exported)
				export, exportErr = e.snaps.OpenExport(snap)
			}()
		} else {
			close(exported)
		}
		var wg sync.WaitGroup
		for i := range results {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := e.startCopy(ctx, snap, sn, sb.Backend(), copyOptions{project: sb.Project(), RestoreOptions: RestoreOptions{Timeout: timeout, Metadata: metadata}})
				results[i] = ForkResult{Sandbox: s, Err: err}
			}()
		}
		wg.Wait()
	})
	if snap == nil {
		e.prom.took("fork", sb.Backend().Name(), began, srcErr)
		return nil, srcErr // the checkpoint failed
	}
	e.prom.took("fork", sb.Backend().Name(), began, nil)
	e.prom.sourcePaused(sb.Backend().Name(), paused)
	<-exported
	if export == nil {
		// An export is deleted when it is released or lapses.
		if err := e.snaps.Drop(snap); err != nil {
			e.log.Error("drop fork snapshot", logging.Error, err)
		}
	}
	if exportErr != nil {
		e.log.Error("export fork snapshot", logging.SandboxID, sb.ID(), logging.Error, exportErr)
	}
	ok := 0
	for _, r := range results {
		if r.Err == nil {
			ok++
		}
	}
	e.log.Info("fork done", logging.SandboxID, sb.ID(), "copies", ok, "failed", count-ok, "source_paused", paused.Round(time.Millisecond))
	return &ForkOutcome{Results: results, SourcePaused: paused, SourceErr: srcErr, Export: export, ExportErr: exportErr}, nil
}
