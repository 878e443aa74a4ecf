package oci

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/testutil"
)

// Every runtime the backends drive reads alike: an unknown container is
// not found for state, and nothing to do for kill and delete; another
// failure names the binary and verb and carries the runtime's words.
func TestRuntimeReadsUnknownContainersAlike(t *testing.T) {
	testutil.RequireRoot(t)
	ctx := context.Background()
	for _, bin := range []string{"crun", "runc", "runsc"} {
		t.Run(bin, func(t *testing.T) {
			path := testutil.RequireBinary(t, bin)
			flags := []string{"--root", t.TempDir()}
			if bin == "runsc" {
				flags = append(flags, "--platform=ptrace", "--network=none")
			}
			r := Runtime{Binary: path, Flags: flags}
			if _, err := r.State(ctx, "dsec-no-such"); !errors.Is(err, errdefs.ErrNotFound) {
				t.Fatalf("state of an unknown container: %v, want not found", err)
			}
			if err := r.Kill(ctx, "dsec-no-such", "KILL", true); err != nil {
				t.Fatalf("kill of an unknown container: %v", err)
			}
			if err := r.Delete(ctx, "dsec-no-such"); err != nil {
				t.Fatalf("delete of an unknown container: %v", err)
			}
			_, err := r.Run(ctx, "no-such-verb")
			if err == nil || Gone(err) || !strings.Contains(err.Error(), path+" no-such-verb") {
				t.Fatalf("an unknown verb: %v, want an error naming %s and the verb", err, path)
			}
			r.Detail = func() string { return "from the log" }
			if _, err := r.Run(ctx, "no-such-verb"); err == nil || !strings.Contains(err.Error(), "from the log") {
				t.Fatalf("with Detail: %v", err)
			}
		})
	}
}
