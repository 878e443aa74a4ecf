// Package rollout replaces the components of a running cluster by a new
// build in waves, checks health gates read from the components' metrics
// after each wave, and puts the previous build back on every replaced
// component when a gate fails (`dsec rollout`).
//
// What it acts on is a plan: the cluster's components, where each runs
// its binary from, how to restart it and where its metrics are.
// scripts/cluster.sh writes one for its processes and deploy/quickstart.sh
// one for its systemd units. Every step is recorded in a state file first,
// so a rollout cut short (kill -9) is resumed or rolled back from it.
package rollout

import (
	"encoding/json"
	"fmt"
	"math"
	"net/url"
	"os"
	"path/filepath"
)

// Kinds of component, in the order a rollout takes them.
var Kinds = []string{"iam", "watcher", "apiserver", "edge", "gateway"}

// Component is one process of the cluster.
type Component struct {
	Name string `json:"name"`
	Kind string `json:"kind"`
	// Binary is the dsec binary the component runs (several may share
	// one: it is replaced once, before the first of them restarts).
	Binary string `json:"binary"`
	// Agent is, for an edge, the agent binary it stages into new sandboxes.
	Agent string `json:"agent,omitempty"`
	// Restart is the command that restarts the component, run from its
	// binary's path as it then is (e.g. systemctl restart dsec-edge).
	Restart []string `json:"restart"`
	// Metrics is the URL of its /metrics.
	Metrics string `json:"metrics"`
}

// Plan is a cluster's components.
type Plan struct {
	Components []Component `json:"components"`
}

// LoadPlan reads and checks a plan file.
func LoadPlan(path string) (*Plan, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("plan: %w", err)
	}
	var p Plan
	if err := json.Unmarshal(data, &p); err != nil {
		return nil, fmt.Errorf("plan %s: %w", path, err)
	}
	if err := p.Check(); err != nil {
		return nil, fmt.Errorf("plan %s: %w", path, err)
	}
	return &p, nil
}

// Check says what is wrong with the plan, naming the component and field.
func (p *Plan) Check() error {
	if len(p.Components) == 0 {
		return fmt.Errorf("components: none; want the cluster's processes")
	}
	seen := map[string]bool{}
	for i, c := range p.Components {
		at := fmt.Sprintf("components[%d] (%q)", i, c.Name)
		switch {
		case c.Name == "":
			return fmt.Errorf("components[%d].name: empty", i)
		case seen[c.Name]:
			return fmt.Errorf("%s.name: used twice", at)
		case !knownKind(c.Kind):
			return fmt.Errorf("%s.kind %q: want one of %v", at, c.Kind, Kinds)
		case !filepath.IsAbs(c.Binary):
			return fmt.Errorf("%s.binary %q: want an absolute path", at, c.Binary)
		case c.Agent != "" && c.Kind != "edge":
			return fmt.Errorf("%s.agent: only an edge has one", at)
		case c.Agent != "" && !filepath.IsAbs(c.Agent):
			return fmt.Errorf("%s.agent %q: want an absolute path", at, c.Agent)
		case len(c.Restart) == 0 || c.Restart[0] == "":
			return fmt.Errorf("%s.restart: empty; want the command that restarts it", at)
		}
		u, err := url.Parse(c.Metrics)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%s.metrics %q: want the http(s) URL of its /metrics", at, c.Metrics)
		}
		seen[c.Name] = true
	}
	return nil
}

func knownKind(k string) bool {
	for _, x := range Kinds {
		if x == k {
			return true
		}
	}
	return false
}

// Waves orders the components: IAM replicas, the watchers and the
// apiservers one at a time (each kind keeps its clients served by the
// others), then the edges in waves of edgeShare of them (at least one; 0
// means one at a time), then the gateways one at a time.
func (p *Plan) Waves(edgeShare float64) [][]Component {
	var waves [][]Component
	for _, kind := range Kinds {
		var of []Component
		for _, c := range p.Components {
			if c.Kind == kind {
				of = append(of, c)
			}
		}
		size := 1
		if kind == "edge" && edgeShare > 0 {
			size = max(1, int(math.Floor(edgeShare*float64(len(of)))))
		}
		for len(of) > 0 {
			n := min(size, len(of))
			waves = append(waves, of[:n])
			of = of[n:]
		}
	}
	return waves
}
