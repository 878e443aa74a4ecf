package aether

import (
	"os"
	"path/filepath"
	"strings"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// A sandbox created from a template snapshot (a booted guest of its image
// and shape, restored) starts with the template's settings; its first
// request, SetIdentity, carries its own.

// maxSettingsFile bounds /etc/hosts and /etc/resolv.conf in a SetIdentity.
const maxSettingsFile = 64 << 10

// checkSettings validates a template copy's settings and returns its
// environment as a map.
func checkSettings(st *agentv1.SandboxSettings) (map[string]string, error) {
	env := make(map[string]string, len(st.Env))
	for i, kv := range st.Env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" || strings.Contains(kv, "\x00") {
			return nil, errdefs.InvalidArgument("settings.env[%d]: want KEY=VALUE with a non-empty KEY and no NUL", i)
		}
		env[k] = v
	}
	if st.WorkDir != "" && (!filepath.IsAbs(st.WorkDir) || strings.Contains(st.WorkDir, "\x00")) {
		return nil, errdefs.InvalidArgument("settings.work_dir %q: want an absolute path", st.WorkDir)
	}
	if len(st.Hosts) > maxSettingsFile || len(st.ResolvConf) > maxSettingsFile {
		return nil, errdefs.InvalidArgument("settings.hosts and settings.resolv_conf: at most %d bytes each", maxSettingsFile)
	}
	return env, nil
}

// applySettings writes a template copy's /etc/hosts and /etc/resolv.conf,
// makes its working directory and takes its environment as the agent's.
func applySettings(st *agentv1.SandboxSettings, env map[string]string) error {
	if st.WorkDir != "" {
		if err := os.MkdirAll(st.WorkDir, 0o755); err != nil {
			return errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "make the working directory")
		}
	}
	for name, data := range map[string]string{"/etc/hosts": st.Hosts, "/etc/resolv.conf": st.ResolvConf} {
		if data == "" {
			continue
		}
		if err := os.WriteFile(name, []byte(data), 0o644); err != nil {
			return errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "write %s", name)
		}
	}
	for k, v := range env {
		if k != agentlink.ImageUserEnv {
			os.Setenv(k, v) //nolint:errcheck // checked above
		}
	}
	return nil
}
