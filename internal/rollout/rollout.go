package rollout

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// Deps are how a rollout reaches the cluster (fakes in tests).
type Deps struct {
	// Scrape reads a component's metrics.
	Scrape func(ctx context.Context, url string) (Families, error)
	// Run runs a restart command to its end.
	Run func(ctx context.Context, argv []string) error
	// Sleep waits d or until ctx ends.
	Sleep func(ctx context.Context, d time.Duration) error
	Log   *slog.Logger
}

// Config is one rollout: the build to roll out and how.
type Config struct {
	Plan *Plan
	// StatePath is the rollout's record (resumed if it is there).
	StatePath string
	// Binary is the new dsec, Agent the new aether (optional), Version
	// what both say they are.
	Binary, Agent, Version string
	Gates                  Gates
	// EdgeShare is the share of the edges each edge wave takes (0: one).
	EdgeShare float64
}

// Rollout owns one rollout of a build over a cluster, from its state file.
type Rollout struct {
	cfg  Config
	deps Deps
	st   *State
}

// Open starts a rollout of cfg.Version, or resumes the one the state file
// records for it. A state file of another version that is not finished
// is refused: it must be rolled back (or its file removed) first.
func Open(cfg Config, deps Deps) (*Rollout, error) {
	st, err := LoadState(cfg.StatePath)
	if err != nil {
		return nil, err
	}
	switch {
	case st == nil || st.Phase == PhaseDone || st.Phase == PhaseRolledBack:
		st = &State{Version: cfg.Version, Phase: PhaseRolling, Backups: map[string]string{}, Before: map[string]string{}}
	case st.Version != cfg.Version:
		return nil, fmt.Errorf("%s records an unfinished rollout of %s (%s): resume it with that build, or roll it back (--rollback) first", cfg.StatePath, st.Version, st.Phase)
	}
	return &Rollout{cfg: cfg, deps: deps, st: st}, nil
}

// OpenRecorded opens the rollout the state file records, as it stands
// (finished ones too), for --rollback: what it replaced, and the builds
// they ran before, are put back.
func OpenRecorded(cfg Config, deps Deps) (*Rollout, error) {
	st, err := LoadState(cfg.StatePath)
	if err != nil {
		return nil, err
	}
	if st == nil {
		return nil, fmt.Errorf("%s records no rollout", cfg.StatePath)
	}
	cfg.Version = st.Version
	return &Rollout{cfg: cfg, deps: deps, st: st}, nil
}

// State is the rollout's record as it stands.
func (r *Rollout) State() State { return *r.st }

// Run takes every wave not yet done; on a failed gate it rolls back and
// returns the gate's error. A rollout recorded as rolling back goes on
// rolling back.
func (r *Rollout) Run(ctx context.Context) error {
	if r.st.Phase == PhaseRollingBack {
		return r.Rollback(ctx, errors.New(r.st.Failure))
	}
	waves := r.cfg.Plan.Waves(r.cfg.EdgeShare)
	for i, wave := range waves {
		for _, c := range wave {
			if r.st.replaced(c.Name) {
				// Recorded before its restart: a rollout cut short between
				// the two restarts it now.
				if err := r.catchUp(ctx, c); err != nil {
					return r.Rollback(ctx, fmt.Errorf("wave %d/%d, %s: %w", i+1, len(waves), c.Name, err))
				}
				continue
			}
			if err := r.replace(ctx, c); err != nil {
				return r.Rollback(ctx, fmt.Errorf("wave %d/%d, %s: %w", i+1, len(waves), c.Name, err))
			}
		}
		r.deps.Log.Info("wave replaced; soaking", "wave", i+1, "of", len(waves), "components", names(wave), "soak", r.cfg.Gates.Soak)
		if err := r.soak(ctx); err != nil {
			return r.Rollback(ctx, fmt.Errorf("after wave %d/%d (%v): %w", i+1, len(waves), names(wave), err))
		}
	}
	r.st.Phase = PhaseDone
	return r.st.save(r.cfg.StatePath)
}

// replace installs the new build where c runs it from and restarts c.
func (r *Rollout) replace(ctx context.Context, c Component) error {
	if _, ok := r.st.Before[c.Name]; !ok {
		f, err := r.deps.Scrape(ctx, c.Metrics)
		if err != nil {
			return &GateError{Gate: "target up", Detail: fmt.Sprintf("before its upgrade: %v", err)}
		}
		r.st.Before[c.Name] = versionOf(f)
	}
	if err := r.install(c.Binary, r.cfg.Binary); err != nil {
		return err
	}
	if c.Agent != "" && r.cfg.Agent != "" {
		if err := r.install(c.Agent, r.cfg.Agent); err != nil {
			return err
		}
	}
	// Recorded before the restart: a rollout cut short during it rolls c
	// back too.
	r.st.Replaced = append(r.st.Replaced, c.Name)
	if err := r.st.save(r.cfg.StatePath); err != nil {
		return err
	}
	return r.restart(ctx, c, r.cfg.Version)
}

// catchUp restarts c, recorded as replaced, unless it already answers as
// the new build.
func (r *Rollout) catchUp(ctx context.Context, c Component) error {
	if f, err := r.deps.Scrape(ctx, c.Metrics); err == nil && versionOf(f) == r.cfg.Version {
		return nil
	}
	r.deps.Log.Info("replaced but not restarted (the rollout was cut short): restarting", "component", c.Name)
	return r.restart(ctx, c, r.cfg.Version)
}

// install puts src at path, keeping what path held for a rollback (once:
// a path several components share is replaced by the first).
func (r *Rollout) install(path, src string) error {
	if _, ok := r.st.Backups[path]; ok {
		return nil
	}
	backup := path + ".rollback"
	if err := copyFile(path, backup); err != nil {
		return fmt.Errorf("keep %s for a rollback: %w", path, err)
	}
	r.st.Backups[path] = backup
	if err := r.st.save(r.cfg.StatePath); err != nil {
		return err
	}
	if err := copyFile(src, path); err != nil {
		return fmt.Errorf("install %s at %s: %w", src, path, err)
	}
	return nil
}

// restart runs c's restart command and waits until its metrics say version.
func (r *Rollout) restart(ctx context.Context, c Component, version string) error {
	began := time.Now()
	if err := r.deps.Run(ctx, c.Restart); err != nil {
		return fmt.Errorf("restart %s (%v): %w", c.Name, c.Restart, err)
	}
	var last string
	var lastErr error
	for deadline := time.Now().Add(r.cfg.Gates.Ready); ; {
		f, err := r.deps.Scrape(ctx, c.Metrics)
		if err == nil && versionOf(f) == version {
			r.deps.Log.Info("component back", "component", c.Name, "version", version, "took", time.Since(began).Round(time.Millisecond))
			return nil
		}
		if err == nil {
			last = versionOf(f)
		}
		lastErr = err
		if time.Now().After(deadline) {
			if lastErr != nil {
				return &GateError{Gate: "target up", Detail: fmt.Sprintf("%s did not answer within %v: %v", c.Name, r.cfg.Gates.Ready, lastErr)}
			}
			return &GateError{Gate: "target up", Detail: fmt.Sprintf("%s answers as version %q, not %q, after %v", c.Name, last, version, r.cfg.Gates.Ready)}
		}
		if err := r.deps.Sleep(ctx, min(r.cfg.Gates.Poll, readyPoll)); err != nil {
			return err
		}
	}
}

// readyPoll is how often a restarted component is asked whether it is
// back: a scrape is cheap, and each wave waits on it.
const readyPoll = 100 * time.Millisecond

// soak polls every component for the soak time and judges the gates.
func (r *Rollout) soak(ctx context.Context) error {
	s := newSoak()
	// Polled at its start and its end at least: the gates judge what
	// changed between.
	for end, polls := time.Now().Add(r.cfg.Gates.Soak), 0; ; polls++ {
		scrapes, errs := map[string]Families{}, map[string]error{}
		for _, c := range r.cfg.Plan.Components {
			if f, err := r.deps.Scrape(ctx, c.Metrics); err != nil {
				errs[c.Name] = err
			} else {
				scrapes[c.Name] = f
			}
		}
		s.add(scrapes, errs)
		if polls > 0 && !time.Now().Before(end) {
			return s.verdict(r.cfg.Gates)
		}
		if err := r.deps.Sleep(ctx, r.cfg.Gates.Poll); err != nil {
			return err
		}
	}
}

// Rollback puts the previous build back at every path the rollout
// replaced and restarts every component it replaced, newest first, each
// until it answers as its version before. why is the failure that calls
// for it (nil when asked for); the result wraps it.
func (r *Rollout) Rollback(ctx context.Context, why error) error {
	if why != nil {
		r.deps.Log.Error("rolling back", "error", why)
		r.st.Failure = why.Error()
	}
	r.st.Phase = PhaseRollingBack
	if err := r.st.save(r.cfg.StatePath); err != nil {
		return err
	}
	for path, backup := range r.st.Backups {
		if err := copyFile(backup, path); err != nil {
			return fmt.Errorf("rollback: restore %s: %w", path, err)
		}
	}
	byName := map[string]Component{}
	for _, c := range r.cfg.Plan.Components {
		byName[c.Name] = c
	}
	var failed []error
	for i := len(r.st.Replaced) - 1; i >= 0; i-- {
		c, ok := byName[r.st.Replaced[i]]
		if !ok {
			failed = append(failed, fmt.Errorf("%s is not in the plan", r.st.Replaced[i]))
			continue
		}
		if err := r.restart(ctx, c, r.st.Before[c.Name]); err != nil {
			failed = append(failed, err)
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("rollback incomplete (run it again with --rollback): %w", errors.Join(failed...))
	}
	r.st.Phase = PhaseRolledBack
	if err := r.st.save(r.cfg.StatePath); err != nil {
		return err
	}
	if why == nil {
		return nil
	}
	return &RolledBack{Cause: why, Components: r.st.Replaced}
}

// RolledBack is a rollout that failed and was rolled back.
type RolledBack struct {
	Cause      error
	Components []string
}

func (e *RolledBack) Error() string {
	return fmt.Sprintf("%v; rolled back %d components to their previous build (%v)", e.Cause, len(e.Components), e.Components)
}

func (e *RolledBack) Unwrap() error { return e.Cause }

func names(cs []Component) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.Name
	}
	return out
}
