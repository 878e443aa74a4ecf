package sandbox

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// shutDownLocked is the first half of a filesystem-only pause: every
// process of sb but its agent ends, as at a power-off, and sb gets a new
// boot id, so that what its resume brings back is a fresh start on the
// same files (E2B's pause without memory). A paused sandbox is resumed
// for it. The caller then pauses sb as deep as it can. Callers hold sb.mu.
func (sb *Sandbox) shutDownLocked(ctx context.Context) error {
	if sb.rec.FilesystemOnly {
		return nil // shut down already, and paused since
	}
	if sb.rec.State == records.StatePaused {
		if err := sb.resumeLocked(ctx); err != nil {
			return err
		}
	}
	if sb.rec.State != records.StateRunning || sb.link == nil {
		return errdefs.FailedPrecondition("sandbox %s is %s; only a running or paused sandbox can be paused", sb.id, sb.rec.State)
	}
	c := agentv1connect.NewAgentServiceClient(&http.Client{Transport: sb.link}, "http://agent")
	res, err := c.EndProcesses(ctx, connect.NewRequest(&agentv1.EndProcessesRequest{}))
	if err != nil {
		return fmt.Errorf("sandbox %s: end its processes for a filesystem-only pause: %w", sb.id, errdefs.FromConnect(err))
	}
	// Where the runtime's /proc has no boot id, the backend shows this
	// file in its place (see Start); elsewhere the kernel's stays.
	if err := sb.newBootID(); err != nil {
		return err
	}
	sb.rec.FilesystemOnly = true
	sb.log.Info("sandbox processes ended for a filesystem-only pause", "ended", res.Msg.Ended)
	return sb.save()
}

// startAfreshLocked ends a filesystem-only pause's mark on a sandbox that
// runs again (resumed, or not paused after all) and starts the image's
// service, as at its create. Callers hold sb.mu.
func (sb *Sandbox) startAfreshLocked(ctx context.Context) error {
	sb.rec.FilesystemOnly = false
	if err := sb.save(); err != nil {
		return err
	}
	return sb.startService(ctx, sb.rec.Service)
}

// bootIDFile is the sandbox's own boot id, for runtimes whose /proc has
// none (Debian's runsc: the gvisor backend mounts it where compat/gvisor
// reads it).
func (sb *Sandbox) bootIDFile() string { return filepath.Join(sb.runDir, "boot_id") }

// newBootID gives sb a boot id of its own.
func (sb *Sandbox) newBootID() error {
	return os.WriteFile(sb.bootIDFile(), []byte(newUUID()+"\n"), 0o644)
}
