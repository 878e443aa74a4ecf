package edge

import (
	"sort"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// backendSet is a node's backends: those that run here, and why each of
// the others does not. It is filled at the edge's start and not changed
// after.
type backendSet struct {
	node        sandboxid.NodeID
	usable      map[string]backend.Backend
	unavailable map[string]string // name -> why it cannot run here
}

func newBackendSet(node sandboxid.NodeID) backendSet {
	return backendSet{node: node, usable: map[string]backend.Backend{}, unavailable: map[string]string{}}
}

// names lists the backends this node can run, then the others.
func (s backendSet) names() (usable, unusable []string) {
	for n := range s.usable {
		usable = append(usable, n)
	}
	for n := range s.unavailable {
		unusable = append(unusable, n)
	}
	sort.Strings(usable)
	sort.Strings(unusable)
	return usable, unusable
}

// known lists every backend the node knows of, usable or not.
func (s backendSet) known() []string {
	usable, unusable := s.names()
	return append(usable, unusable...)
}

// get is the backend called name, or why a sandbox cannot have it here.
func (s backendSet) get(name string) (backend.Backend, error) {
	if b, ok := s.usable[name]; ok {
		return b, nil
	}
	if why, ok := s.unavailable[name]; ok {
		return nil, errdefs.FailedPrecondition("backend %q cannot run on node %s: %s", name, s.node, why)
	}
	usable, _ := s.names()
	return nil, errdefs.InvalidArgument("backend %q: unknown; node %s offers %s", name, s.node, strings.Join(usable, ", "))
}
