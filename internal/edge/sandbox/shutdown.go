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
	if err := os.WriteFile(filepath.Join(sb.runDir, "boot_id"), []byte(newUUID()+"\n"), 0o644); err != nil {
		return err
	}
	sb.rec.FilesystemOnly = true
	sb.log.Info("sandbox processes ended for a filesystem-only pause", "ended", res.Msg.Ended)
	return sb.save()
}
