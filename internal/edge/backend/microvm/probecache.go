package microvm

import (
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/opendsec/opendsec/internal/atomicfile"
)

// The probe boot takes seconds (3.7 s under TCG here) and would delay
// every start of the edge, also the restart after a crash that the
// sandboxes wait on. Its answer depends only on the host as booted and on
// the parts it boots, so it is kept in the backend's state directory with
// what it depends on, and a later start of the same boot with the same
// parts takes it from there.

const probeCacheFile = "probe.json"

type probeCache struct {
	Key    string       `json:"key"`
	Result *ProbeResult `json:"result"`
}

// probeKey names what a probe's answer depends on: the host's boot, and
// the hypervisors, kernel and init it boots (path, size, modification time).
func (b *Backend) probeKey() (string, error) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	parts := []string{strings.TrimSpace(string(boot)), "machine:" + cmp.Or(b.qemu.Machine, MachineMicrovm)}
	bins := []string{b.qemu.Binary, b.qemu.Kernel, b.qemu.Init, b.qemu.Modules}
	if b.fc != nil {
		bins = append(bins, b.fc.Binary)
	}
	for _, p := range bins {
		if p == "" {
			continue
		}
		if !filepath.IsAbs(p) {
			if lp, err := exec.LookPath(p); err == nil {
				p = lp
			}
		}
		fi, err := os.Stat(p)
		if err != nil {
			return "", err
		}
		parts = append(parts, fmt.Sprintf("%s:%d:%d", p, fi.Size(), fi.ModTime().UnixNano()))
	}
	return strings.Join(parts, "|"), nil
}

// cachedProbe returns the answer of an earlier probe of this boot and
// these parts, or nil.
func (b *Backend) cachedProbe(key string) *ProbeResult {
	data, err := os.ReadFile(filepath.Join(b.cfg.StateDir, probeCacheFile))
	if err != nil {
		return nil
	}
	var c probeCache
	if json.Unmarshal(data, &c) != nil || c.Key != key || c.Result == nil || c.Result.Driver == "" {
		return nil
	}
	return c.Result
}

// saveProbe keeps a probe's answer for the next start of this boot.
func (b *Backend) saveProbe(key string, res *ProbeResult) {
	data, err := json.Marshal(probeCache{Key: key, Result: res})
	if err != nil {
		return
	}
	atomicfile.Write(filepath.Join(b.cfg.StateDir, probeCacheFile), data, 0o600) //nolint:errcheck // only a later start is slower without it
}
