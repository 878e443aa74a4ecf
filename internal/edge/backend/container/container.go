// Package container is the "container" backend: Linux namespaces and cgroups
// through an OCI runtime, crun by default (runc accepted) [ours]. The rootfs
// is overlayfs over the image's layers; pause uses the cgroup freezer. Memory
// snapshots need CRIU, which is detected (criu check's output, since it exits
// 0 even when it fails) and reported as the reason when missing.
package container

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/oci"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// Name is the backend's name in requests.
const Name = "container"

// Backend runs sandboxes with crun or runc.
type Backend struct {
	runtime string // binary: crun or runc
	root    string // the runtime's state directory
	log     *slog.Logger
	caps    backend.Capabilities
	// protectAgent is whether the agent can be kept off the OOM killer
	// (needs CAP_SYS_RESOURCE, which some hosts withhold even from root).
	protectAgent bool
	// nofile is the open-file limit in sandboxes: 1M, or the host's hard
	// limit when raising it is not allowed.
	nofile uint64
	// cg is the node's cgroups.
	cg *cgroups.Host

	mu    sync.Mutex
	boxes map[sandboxid.ID]*box // guarded by mu
}

type box struct {
	dir string
}

// handleState is Handle.State for this backend.
type handleState struct {
	Dir     string `json:"dir"`
	Runtime string `json:"runtime"`
}

var (
	_ backend.Backend   = (*Backend)(nil)
	_ backend.Pauser    = (*Backend)(nil)
	_ backend.Diagnoser = (*Backend)(nil)
	_ backend.Continuer = (*Backend)(nil)
)

// Options are the container backend's options.
type Options struct {
	// Runtime is the OCI runtime: crun (the default) or runc.
	Runtime string `option:"runtime"`
	// CgroupParent is the sandboxes' parent cgroup (oci.Cgroups).
	CgroupParent string `option:"cgroup-parent"`
}

// New returns a container backend.
func New(ctx context.Context, cfg backend.Config) (backend.Backend, error) {
	var o Options
	if err := backend.DecodeOptions(Name, cfg.Options, &o); err != nil {
		return nil, err
	}
	rt := o.Runtime
	if rt == "" {
		rt = "crun"
	}
	if rt != "crun" && rt != "runc" {
		return nil, errdefs.InvalidArgument("container backend: runtime %q; want crun or runc", rt)
	}
	cg, err := oci.Cgroups(o.CgroupParent)
	if err != nil {
		return nil, err
	}
	b := &Backend{
		cg:      cg,
		runtime: rt,
		root:    filepath.Join(cfg.StateDir, rt),
		log:     logging.OrDiscard(cfg.Log).With(logging.Backend, Name),
		boxes:   map[sandboxid.ID]*box{},
	}
	b.caps = backend.Capabilities{Isolation: "container", Pause: true, DiskLayer: true}
	b.protectAgent = hasCapability(capSysResource)
	b.nofile = 1 << 20
	var rl syscall.Rlimit
	if !b.protectAgent && syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl) == nil {
		b.nofile = min(b.nofile, rl.Max)
	}
	if !b.protectAgent {
		b.log.Info("no CAP_SYS_RESOURCE: the agent gets the default OOM score")
	}
	if why := criuUnavailable(ctx); why != "" {
		b.caps.SnapshotUnavailable = why
	} else {
		// CRIU passes its self-check, but checkpoint support is not wired
		// into this backend yet; say so rather than pretend.
		b.caps.SnapshotUnavailable = "memory snapshots of containers (CRIU) are not implemented yet; use the gvisor backend"
	}
	return b, nil
}

// Name returns "container".
func (b *Backend) Name() string { return Name }

// Capabilities reports pause and, with the reason, no memory snapshots.
func (b *Backend) Capabilities() backend.Capabilities { return b.caps }

// Probe checks the runtime binary and, for crun, hybrid cgroups.
func (b *Backend) Probe(ctx context.Context) error {
	if _, err := exec.LookPath(b.runtime); err != nil {
		return errdefs.FailedPrecondition("container backend: %s not found; install Debian's %s package", b.runtime, b.runtime)
	}
	if os.Geteuid() != 0 {
		return errdefs.FailedPrecondition("container backend: needs root")
	}
	if err := b.cg.Prepare(b.log, b.runtime == "crun"); err != nil {
		return err
	}
	if err := oci.BoundSandboxes(b.log, b.cg); err != nil {
		return errdefs.FailedPrecondition("container backend: %v", err)
	}
	return os.MkdirAll(b.root, 0o700)
}

// criuUnavailable returns why CRIU cannot checkpoint here, or "".
func criuUnavailable(ctx context.Context) string {
	if _, err := exec.LookPath("criu"); err != nil {
		return "CRIU is not installed"
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, "criu", "check").CombinedOutput()
	if !bytes.Contains(out, []byte("Looks good")) {
		first := strings.SplitN(strings.TrimSpace(string(out)), "\n", 2)[0]
		return fmt.Sprintf("CRIU cannot checkpoint on this kernel (criu check: %s)", first)
	}
	return ""
}

// cli is the runtime's command line, on the backend's state directory.
func (b *Backend) cli() oci.Runtime {
	return oci.Runtime{Binary: b.runtime, Flags: []string{"--root", b.root}}
}

const capSysResource = 24

// hasCapability reports whether this process has capability bit c.
func hasCapability(c uint) bool {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(data), "\n") {
		if hex, ok := strings.CutPrefix(line, "CapEff:"); ok {
			v, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			return err == nil && v&(1<<c) != 0
		}
	}
	return false
}

// tail returns the last n bytes of a file, for error messages.
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > n {
		f.Seek(fi.Size()-n, 0) //nolint:errcheck // a short read is fine
	}
	data := make([]byte, n)
	k, _ := f.Read(data)
	return string(bytes.TrimSpace(data[:k]))
}

// Usage reads the sandbox's cgroups.
func (b *Backend) Usage(id sandboxid.ID) (backend.Usage, error) {
	g := b.cg.Group(string(id))
	u, err := oci.ReadUsage(g)
	if err == nil {
		// The cgroup holds the sandbox's processes and nothing else.
		kills, _ := g.OOMKills()
		u.OOMKills, u.ForksRefused = int64(kills), int64(g.PidsRefused())
	}
	return u, err
}

// Create mounts the rootfs and writes the bundle; Start runs it.
func (b *Backend) Create(ctx context.Context, spec *backend.Spec) (*backend.Handle, error) {
	if spec.LayerDir == "" {
		return nil, errdefs.FailedPrecondition("container backend: no writable layer directory from the node's disk pool; the edge gives one to backends with DiskLayer")
	}
	layout := spec.RootfsLayout()
	if err := rootfs.Mount(spec.Layers, layout); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			b.cleanup(context.WithoutCancel(ctx), spec.ID, spec.Dir)
		}
	}()
	opts := oci.Options{
		CgroupsPath: b.cg.Path(string(spec.ID)), CgroupV2: b.cg.Version == cgroups.V2, ProtectAgent: b.protectAgent, NoFile: b.nofile,
		Seccomp: oci.Seccomp(), NoNewPrivileges: true, SudoBroker: true,
	}
	if b.runtime == "crun" {
		// crun loads the filter compiled once here instead of compiling
		// the OCI section at every run.
		bpf, err := oci.SeccompBPF()
		if err != nil {
			return nil, err
		}
		opts.SeccompBPF = bpf
	}
	cfg, err := json.MarshalIndent(oci.RuntimeSpec(spec, opts), "", " ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(spec.Dir, "config.json"), cfg, 0o600); err != nil {
		return nil, err
	}
	state, _ := json.Marshal(handleState{Dir: spec.Dir, Runtime: b.runtime})
	b.mu.Lock()
	b.boxes[spec.ID] = &box{dir: spec.Dir}
	b.mu.Unlock()
	ok = true
	return &backend.Handle{ID: spec.ID, Backend: Name, Version: 1, State: state}, nil
}

// Start runs the bundle (`run --detach`: one runtime call instead of
// create + start).
func (b *Backend) Start(ctx context.Context, id sandboxid.ID) error {
	b.mu.Lock()
	bx := b.boxes[id]
	b.mu.Unlock()
	if bx == nil {
		return errdefs.NotFound("sandbox %s: not created", id)
	}
	logPath := filepath.Join(bx.dir, "console.log")
	console, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer console.Close()
	cmd := exec.CommandContext(ctx, b.runtime, "--root", b.root, "run", "--detach", "--bundle", bx.dir, "--pid-file", filepath.Join(bx.dir, "init.pid"), string(id))
	// The container inherits these: files, never pipes, or the runtime and
	// anyone reading the pipe would wait for the container to exit.
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, console, console
	// Its own session: a signal to the edge's process group must not reach
	// the sandbox, which outlives the edge.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s run: %w: %s", b.runtime, err, tail(logPath, 2048))
	}
	return nil
}

// Stop sends SIGTERM, then SIGKILL after grace.
func (b *Backend) Stop(ctx context.Context, id sandboxid.ID, grace time.Duration) error {
	st, err := b.Status(ctx, id)
	if err != nil || st.State == backend.StateStopped {
		return err
	}
	if st.State == backend.StatePaused {
		b.cli().Run(ctx, "resume", string(id)) //nolint:errcheck // a frozen process cannot handle SIGTERM; best effort
	}
	if err := b.cli().Kill(ctx, string(id), "TERM", false); err != nil {
		b.log.Debug("sigterm failed", logging.SandboxID, id, logging.Error, err)
	}
	if done, err := backend.WaitStopped(ctx, b, id, grace); done || err != nil {
		return err
	}
	if err := b.cli().Kill(ctx, string(id), "KILL", true); err != nil {
		return err
	}
	if done, err := backend.WaitStopped(ctx, b, id, backend.StopAfterKill); done || err != nil {
		return err
	}
	return errdefs.Unavailable("container: sandbox %s still runs %v after SIGKILL", id, backend.StopAfterKill)
}

// Destroy kills every process and removes the container, its cgroups and
// its rootfs mount.
func (b *Backend) Destroy(ctx context.Context, id sandboxid.ID) error {
	b.mu.Lock()
	bx := b.boxes[id]
	delete(b.boxes, id)
	b.mu.Unlock()
	dir := ""
	if bx != nil {
		dir = bx.dir
	}
	return b.cleanup(ctx, id, dir)
}

func (b *Backend) cleanup(ctx context.Context, id sandboxid.ID, dir string) error {
	var errs []error
	if err := b.cli().Delete(ctx, string(id)); err != nil {
		errs = append(errs, err)
	}
	// After a crash the runtime may not know processes it started.
	if err := b.cg.Group(string(id)).KillAll(); err != nil {
		errs = append(errs, err)
	}
	if err := b.cg.Group(string(id)).Remove(); err != nil {
		errs = append(errs, err)
	}
	if dir != "" {
		if err := rootfs.Unmount(filepath.Join(dir, "rootfs")); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Status asks the runtime.
func (b *Backend) Status(ctx context.Context, id sandboxid.ID) (backend.Status, error) {
	rs, err := b.cli().State(ctx, string(id))
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return backend.Status{ID: id, State: backend.StateStopped}, nil
		}
		return backend.Status{ID: id, State: backend.StateUnknown}, err
	}
	st := backend.Status{ID: id, Pid: rs.Pid}
	switch rs.Status {
	case "created":
		st.State = backend.StateCreated
	case "running":
		st.State = backend.StateRunning
	case "paused":
		st.State = backend.StatePaused
	case "stopped":
		st.State = backend.StateStopped
	default:
		st.State = backend.StateUnknown
	}
	return st, nil
}

// Recover re-attaches after an edge restart: the container kept running.
func (b *Backend) Recover(ctx context.Context, h *backend.Handle, spec *backend.Spec) error {
	var hs handleState
	if err := json.Unmarshal(h.State, &hs); err != nil {
		return fmt.Errorf("recover %s: bad handle: %w", h.ID, err)
	}
	if hs.Runtime != b.runtime {
		return errdefs.FailedPrecondition("recover %s: created with %s, this edge runs %s", h.ID, hs.Runtime, b.runtime)
	}
	b.mu.Lock()
	b.boxes[h.ID] = &box{dir: hs.Dir}
	b.mu.Unlock()
	st, err := b.Status(ctx, h.ID)
	if err != nil {
		return err
	}
	if st.State != backend.StateRunning && st.State != backend.StatePaused {
		return errdefs.FailedPrecondition("recover %s: container is %s", h.ID, st.State)
	}
	return nil
}

// Pause freezes every process (cgroup freezer).
func (b *Backend) Pause(ctx context.Context, id sandboxid.ID) error {
	_, err := b.cli().Run(ctx, "pause", string(id))
	return err
}

// Resume thaws them.
func (b *Backend) Resume(ctx context.Context, id sandboxid.ID) error {
	_, err := b.cli().Run(ctx, "resume", string(id))
	return err
}

// Diagnose says why a container died: the OOM killer, or its processes
// being killed from outside (its first process, the agent, ends them all).
func (b *Backend) Diagnose(ctx context.Context, id sandboxid.ID) string {
	return b.cg.Group(string(id)).DiagnoseOOM()
}

// Continue sends the container's first process SIGCONT (which nothing in
// the container can stop: Linux keeps SIGSTOP from a namespace's init).
func (b *Backend) Continue(ctx context.Context, id sandboxid.ID) error {
	_, err := b.cli().Run(ctx, "kill", string(id), "CONT")
	return err
}
