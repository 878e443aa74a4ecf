package runbase

import (
	"context"
	"log/slog"
	"os/exec"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/logging"
)

// AgentVersion asks the agent binary at path for its version (`aether
// --version`): the version every sandbox the edge starts from now on runs,
// against which the edge tells the sandboxes made before an upgrade. It is
// "" when the binary would not say (an old agent, a test's stand-in).
func AgentVersion(ctx context.Context, path string, log *slog.Logger) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, "--version").Output()
	v := strings.TrimSpace(string(out))
	if err != nil || v == "" || len(v) > 128 || strings.ContainsAny(v, " \n\t") {
		log.Warn("the agent does not say its version: sandboxes of an older agent cannot be told", "agent", path, logging.Error, err)
		return ""
	}
	return v
}
