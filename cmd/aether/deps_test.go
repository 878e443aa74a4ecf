package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/testutil"
)

// allowedDeps is every package outside the standard library that the
// agent links, by module for others' code and by package for ours. The
// agent runs in every sandbox: what it links is memory in each of
// thousands of sandboxes and code a hostile process can reach. Adding
// one is a decision; say it in the commit that changes this list.
var allowedDeps = struct{ modules, ours []string }{
	modules: []string{
		"connectrpc.com/connect",
		"github.com/creack/pty",
		"golang.org/x/sys",
		"google.golang.org/protobuf",
	},
	ours: []string{
		"api/gen/opendsec/agent/v1",
		"api/gen/opendsec/agent/v1/agentv1connect",
		"cmd/aether",
		"internal/aether",
		"internal/agentlink",
		"internal/cgroups",
		"internal/chronus",
		"internal/errdefs",
		"internal/filemeta",
		"internal/guestnet",
		"internal/headers",
		"internal/logging",
		"internal/rpcopts",
		"internal/spawn",
		"internal/sudo",
		"internal/sysuser",
		"internal/version",
	},
}

// TestTheAgentLinksOnlyWhatItMay pins the agent's dependencies, as
// tailscale's depaware pins its binaries' (see allowedDeps).
func TestTheAgentLinksOnlyWhatItMay(t *testing.T) {
	out := testutil.GoList(t, "-deps", "-f",
		"{{if not .Standard}}{{.ImportPath}} {{with .Module}}{{.Path}}{{end}}{{end}}", ".")
	const self = "github.com/opendsec/opendsec"
	modules, ours := map[string]bool{}, map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		pkg, module, _ := strings.Cut(line, " ")
		if module == self {
			ours[strings.TrimPrefix(pkg, self+"/")] = true
		} else {
			modules[module] = true
		}
	}
	check := func(kind string, got map[string]bool, allowed []string) {
		t.Helper()
		for name := range got {
			if !slices.Contains(allowed, name) {
				t.Errorf("the agent now links %s %s, which allowedDeps does not list: every sandbox would carry it (see allowedDeps)", kind, name)
			}
		}
		for _, name := range allowed {
			if !got[name] {
				t.Errorf("the agent no longer links %s %s: take it out of allowedDeps", kind, name)
			}
		}
	}
	check("module", modules, allowedDeps.modules)
	check("package", ours, allowedDeps.ours)
}
