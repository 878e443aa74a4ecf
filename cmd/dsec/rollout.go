package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/opendsec/opendsec/internal/rollout"
)

// cmdRollout rolls a new build out over a cluster's components in waves,
// with health gates after each and a rollback when one fails.
func cmdRollout(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("rollout", flag.ExitOnError)
	planFile := fs.String("plan", "", "the cluster's plan: its components, their binaries, restart commands and metrics (scripts/cluster.sh and deploy/quickstart.sh write one) (required)")
	binary := fs.String("binary", "", "the new dsec binary (required but with --rollback)")
	agent := fs.String("agent", "", "the new aether binary, for the edges (optional; the edges keep theirs without it)")
	statePath := fs.String("state", "", "the rollout's record, resumed if present (default: the plan's path + .state)")
	rollback := fs.Bool("rollback", false, "put the previous build back on every component the recorded rollout replaced")
	g := rollout.DefaultGates
	fs.DurationVar(&g.Soak, "soak", g.Soak, "how long each wave is watched before the next")
	fs.DurationVar(&g.Ready, "ready-timeout", g.Ready, "how long a restarted component has to answer as the new version")
	fs.Float64Var(&g.MaxErrorRate, "max-error-rate", g.MaxErrorRate, "gate: share of calls answered with a server error during a soak")
	fs.DurationVar(&g.MaxCreateP99, "max-create-p99", g.MaxCreateP99, "gate: the edges' create time p99 during a soak")
	fs.IntVar(&g.MaxStuck, "max-stuck", g.MaxStuck, "gate: sandboxes creating or stopping at every poll of a soak")
	edgeShare := fs.Float64("edge-share", 0, "share of the edges each edge wave takes (0: one at a time)")
	lf := addLogFlags(fs)
	fs.Parse(args)
	if *planFile == "" || (*binary == "" && !*rollback) {
		return errors.New("rollout: --plan and --binary are required (--binary not with --rollback)")
	}
	if *edgeShare < 0 || *edgeShare > 1 {
		return fmt.Errorf("rollout: --edge-share %g: want 0 to 1", *edgeShare)
	}
	plan, err := rollout.LoadPlan(*planFile)
	if err != nil {
		return fmt.Errorf("rollout: %w", err)
	}
	if *statePath == "" {
		*statePath = *planFile + ".state"
	}
	cfg := rollout.Config{Plan: plan, StatePath: *statePath, Binary: *binary, Agent: *agent, Gates: g, EdgeShare: *edgeShare}
	if *rollback {
		st, err := rollout.LoadState(*statePath)
		if err != nil || st == nil {
			return fmt.Errorf("rollout --rollback: no recorded rollout in %s (%v)", *statePath, err)
		}
		cfg.Version = st.Version
	} else if cfg.Version, err = binaryVersion(ctx, *binary, "version"); err != nil {
		return fmt.Errorf("rollout: --binary: %w", err)
	}
	if *agent != "" {
		v, err := binaryVersion(ctx, *agent, "--version")
		if err != nil {
			return fmt.Errorf("rollout: --agent: %w", err)
		}
		if v != cfg.Version {
			return fmt.Errorf("rollout: --agent says version %q and --binary %q: roll out one build", v, cfg.Version)
		}
	}
	log := lf.logger().With("rollout", cfg.Version)
	deps := rollout.Deps{Scrape: scrapeMetrics, Run: runRestart, Sleep: sleepCtx, Log: log}
	open := rollout.Open
	if *rollback {
		open = rollout.OpenRecorded // finished rollouts too
	}
	r, err := open(cfg, deps)
	if err != nil {
		return fmt.Errorf("rollout: %w", err)
	}
	if *rollback {
		if err := r.Rollback(ctx, nil); err != nil {
			return err
		}
		fmt.Printf("rolled back: %d components on their previous build\n", len(r.State().Replaced))
		return nil
	}
	if err := r.Run(ctx); err != nil {
		return err
	}
	fmt.Printf("rolled out %s to %d components\n", cfg.Version, len(plan.Components))
	return nil
}

// binaryVersion runs a binary for the version it says.
func binaryVersion(ctx context.Context, bin, arg string) (string, error) {
	out, err := exec.CommandContext(ctx, bin, arg).Output()
	v := strings.TrimSpace(string(out))
	if err != nil || v == "" || strings.ContainsAny(v, " \n") {
		return "", fmt.Errorf("%s %s says no version (%q, %v)", bin, arg, v, err)
	}
	return v, nil
}

var scrapeClient = &http.Client{Timeout: 5 * time.Second}

// scrapeMetrics reads a component's metrics as Prometheus does.
func scrapeMetrics(ctx context.Context, url string) (rollout.Families, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := scrapeClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	return fams, nil
}

// runRestart runs a component's restart command, its output to ours.
func runRestart(ctx context.Context, argv []string) error {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	return cmd.Run()
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}
