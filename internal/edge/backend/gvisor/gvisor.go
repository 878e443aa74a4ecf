// Package gvisor is the "gvisor" backend: a user-space kernel (runsc) per
// sandbox [ours]. It is the backend that snapshots memory, and so forks.
//
// Sandboxes run on Debian's runsc, or on a newer one (runtime.go).
// Choices forced by Debian's runsc (2022-12), measured on this kernel:
//   - --network=none: a sandbox without a network has its own netstack
//     with loopback only. One with a network (Spec.NetNS) runs with
//     --network=sandbox, and can be checkpointed only on the newer runsc:
//     with this one it could not be after any TCP connection and restored
//     copies lost the NIC.
//   - --overlay2=root:memory: writes live in the sandbox's memory, so they
//     are in the checkpoint image and each restored copy gets its own; the
//     host rootfs stays read-only and shared. (With every sandbox on the
//     newer runsc they live in a file of disk_mb, which its checkpoint
//     saves.)
//   - --host-uds=open: the agent may connect to the edge's socket; it may
//     create none, and a checkpoint never meets a host socket because the
//     edge detaches the link first.
//   - pause uses the cgroup freezer: runsc pause is a no-op on a restored
//     sandbox in this release, the freezer stops every one.
//   - stdio is /dev/null: runsc writes regular files at its own offset, and a
//     pipe would break when the edge restarts. runsc's own errors go to a
//     log file in the sandbox directory.
//   - checkpoint stops the sandbox, so Snapshot reports Stopped and the edge
//     restores the source from the image it just wrote.
//   - statx with AT_NO_AUTOMOUNT fails with EINVAL, which breaks coreutils
//     (ls -l, stat, cp -a) in Debian images: the agent installs a seccomp
//     filter that answers those calls ENOSYS, and glibc then emulates statx
//     with fstatat (AT_NO_AUTOMOUNT means nothing here: there are no
//     automounts). runsc's --oci-seccomp cannot do it: it ignores errnoRet
//     and answers EPERM, which glibc does not fall back from.
//   - setuid bits are ignored, so sudo cannot work: the agent binary is
//     mounted over /usr/bin/sudo and brokers it (internal/sudo).
package gvisor

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
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
const Name = "gvisor"

// Backend runs sandboxes with runsc.
type Backend struct {
	runsc    string
	netRunsc string // the newer runsc (runtime.go); "" if none
	// newerForAll: every new sandbox runs on the newer runsc, not only
	// those with a network (option "runsc-newer-for" = "all").
	newerForAll bool
	root        string // runsc's state directory
	platform    string
	log         *slog.Logger
	cg          *cgroups.Host // the node's cgroups

	mu    sync.Mutex
	boxes map[sandboxid.ID]*box // guarded by mu
}

// box is one sandbox. runsc knows it by runscID, which changes when the
// sandbox is restored in place: deleting a checkpointed container takes
// runsc seconds, so the old one is deleted in the background under its own
// id instead of in the way of the restore.
type box struct {
	dir     string
	runscID string
	// net: the sandbox runs with --network=sandbox in the edge's network
	// namespace (Spec.NetNS); otherwise --network=none.
	net bool
	// modern: it runs on the newer runsc (runtime.go).
	modern bool
	// diskMB bounds its writable layer on the newer runsc (0: in memory).
	diskMB int64
}

type handleState struct {
	Dir     string `json:"dir"`
	RunscID string `json:"runsc_id"`
	Net     bool   `json:"net,omitempty"`
	Modern  bool   `json:"modern,omitempty"`
	DiskMB  int64  `json:"disk_mb,omitempty"`
}

// newRunscID appends a generation to the sandbox id. Every runsc id of this
// backend has the same length, so none is a prefix of another (runsc
// matches ids by prefix).
func newRunscID(id sandboxid.ID) string {
	b := make([]byte, 3)
	rand.Read(b) //nolint:errcheck // crypto/rand does not fail on Linux
	return string(id) + "-" + hex.EncodeToString(b)[:4]
}

func (b *Backend) handle(id sandboxid.ID, bx *box) *backend.Handle {
	state, _ := json.Marshal(handleState{Dir: bx.dir, RunscID: bx.runscID, Net: bx.net, Modern: bx.modern, DiskMB: bx.diskMB})
	return &backend.Handle{ID: id, Backend: Name, Version: 2, State: state}
}

var (
	_ backend.Backend     = (*Backend)(nil)
	_ backend.Pauser      = (*Backend)(nil)
	_ backend.Snapshotter = (*Backend)(nil)
	_ backend.Releaser    = (*Backend)(nil)
	_ backend.Diagnoser   = (*Backend)(nil)
	_ backend.HostThreads = (*Backend)(nil)
	_ backend.Continuer   = (*Backend)(nil)
)

// Options are the gvisor backend's options.
type Options struct {
	// Runsc is Debian's runsc (default: runsc on PATH).
	Runsc string `option:"runsc"`
	// Platform is its platform: ptrace, or systrap or kvm where the
	// release and host have them.
	Platform string `option:"platform"`
	// RunscNetwork is the newer runsc.
	RunscNetwork string `option:"runsc-network"`
	// NewerFor is which new sandboxes run on the newer runsc: "network"
	// (the default: those with a network) or "all" (every one, with its
	// writable layer bounded by disk_mb on the node's disk).
	NewerFor string `option:"runsc-newer-for"`
	// CgroupParent is the sandboxes' parent cgroup (oci.Cgroups).
	CgroupParent string `option:"cgroup-parent"`
}

// New returns a gvisor backend.
func New(ctx context.Context, cfg backend.Config) (backend.Backend, error) {
	var o Options
	if err := backend.DecodeOptions(Name, cfg.Options, &o); err != nil {
		return nil, err
	}
	cg, err := oci.Cgroups(o.CgroupParent)
	if err != nil {
		return nil, err
	}
	b := &Backend{
		cg:       cg,
		runsc:    o.Runsc,
		netRunsc: o.RunscNetwork,
		platform: o.Platform,
		root:     filepath.Join(cfg.StateDir, "runsc"),
		log:      logging.OrDiscard(cfg.Log).With(logging.Backend, Name),
		boxes:    map[sandboxid.ID]*box{},
	}
	switch o.NewerFor {
	case "", NewerForNetwork:
	case NewerForAll:
		b.newerForAll = true
	default:
		return nil, errdefs.InvalidArgument("gvisor backend: option %s is %q; want %q or %q", NewerForOption, errdefs.Clip(o.NewerFor, 40), NewerForNetwork, NewerForAll)
	}
	if b.runsc == "" {
		b.runsc = "runsc"
	}
	if b.platform == "" {
		b.platform = "ptrace"
	}
	return b, nil
}

// Name returns "gvisor".
func (b *Backend) Name() string { return Name }

// concurrentCalls bounds a gVisor sandbox's unary agent calls at once.
const concurrentCalls = 32

// Capabilities: pause and memory snapshots; with the newer runsc, of
// networked sandboxes too, and, where every sandbox runs on it, the
// writable layer on the node's disk.
func (b *Backend) Capabilities() backend.Capabilities {
	_, newer := b.newer()
	// Each exec is new tasks in the sentry (host threads on ptrace): past a
	// few dozen at once, every call slows and a flood runs into deadlines.
	return backend.Capabilities{Isolation: "gvisor", Pause: true, Snapshot: true, SnapshotNetwork: newer, DiskFile: newer && b.newerForAll, ConcurrentCalls: concurrentCalls, ChangesWhileRunning: true}
}

// Probe checks runsc and the platform.
func (b *Backend) Probe(ctx context.Context) error {
	path, err := exec.LookPath(b.runsc)
	if err != nil {
		return errdefs.FailedPrecondition("gvisor backend: runsc not found; install Debian's runsc package")
	}
	b.runsc = path
	if os.Geteuid() != 0 {
		return errdefs.FailedPrecondition("gvisor backend: needs root")
	}
	if b.platform == "kvm" {
		if _, err := os.Stat("/dev/kvm"); err != nil {
			return errdefs.FailedPrecondition("gvisor backend: platform kvm needs /dev/kvm, which this host lacks")
		}
	}
	raisePidMax(b.log)
	if err := b.cg.Prepare(b.log, false); err != nil {
		return err
	}
	if err := oci.BoundSandboxes(b.log, b.cg); err != nil {
		return errdefs.FailedPrecondition("gvisor backend: %v", err)
	}
	out, err := exec.CommandContext(ctx, b.runsc, "--platform="+b.platform, "help").CombinedOutput()
	if err != nil && bytes.Contains(out, []byte("unknown platform")) {
		return errdefs.FailedPrecondition("gvisor backend: this runsc has no platform %q (ptrace is always there)", b.platform)
	}
	if b.netRunsc != "" {
		if err := probeNetworked(ctx, b.netRunsc); err != nil {
			b.log.Warn("the newer runsc is unusable: sandboxes with a network run on the other and cannot be snapshotted", logging.Error, err)
			b.netRunsc = ""
		} else if err := os.MkdirAll(b.root+"-net", 0o700); err != nil {
			return err
		}
	}
	return os.MkdirAll(b.root, 0o700)
}

// run runs runsc rt and returns its output; log is where runsc writes its
// own errors (empty: none), whose last error is a failure's reason.
func (b *Backend) run(ctx context.Context, rt runtime, logFile string, args ...string) ([]byte, error) {
	return rt.cli(logFile).Run(ctx, args...)
}

// launch starts a runsc command that leaves a sandbox running (run or
// restore): its stdio is /dev/null and it gets its own session, so the
// sandbox outlives the edge and never writes into a broken pipe.
func (b *Backend) launch(ctx context.Context, rt runtime, logFile string, bx box, args ...string) error {
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer null.Close()
	argv := append([]string{rt.bin}, append(rt.args(logFile, bx), args...)...)
	if bx.net && !rt.modern {
		// This runsc takes a namespace in which /proc/sys/net/core/rmem_default
		// exists for the host's own and refuses it; on kernels since 6.x
		// every namespace has that file. Hiding /proc/sys/net in a private
		// mount namespace of runsc's alone gets past the check (found with
		// Debian's runsc on kernel 6.18); "$0" "$@" passes runsc's
		// arguments through unquoted.
		argv = append([]string{"unshare", "-m", "--propagation", "private", "--", "sh", "-c",
			`mount -t tmpfs -o ro,size=4k dsec-hide /proc/sys/net && exec "$0" "$@"`}, argv...)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	dbg, _ := os.OpenFile(logFile+".console", os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	var consoleAt int64
	if dbg != nil {
		defer dbg.Close()
		if fi, err := dbg.Stat(); err == nil {
			consoleAt = fi.Size()
		}
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, dbg, dbg
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Run(); err != nil {
		why := lastLogError(logFile)
		if why == "" {
			// Not every failure reaches runsc's log (a wrapper's, or one
			// before runsc opened it): then what the call printed says.
			why = lastConsoleLine(logFile+".console", consoleAt)
		}
		return fmt.Errorf("runsc %s: %w: %s", args[0], err, why)
	}
	return nil
}

// lastConsoleLine is the last non-empty line written to a console file
// from offset on, cut to 2 KiB.
func lastConsoleLine(path string, offset int64) string {
	data, err := os.ReadFile(path)
	if err != nil || int64(len(data)) <= offset {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(string(data[offset:])), "\n")
	return errdefs.Clip(strings.TrimSpace(lines[len(lines)-1]), 2048)
}

// lastLogError returns the message of runsc's last error log line.
func lastLogError(path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	var last string
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for sc.Scan() {
		var rec struct{ Msg, Level string }
		if json.Unmarshal(sc.Bytes(), &rec) == nil && (rec.Level == "error" || rec.Level == "warning") {
			last = rec.Msg
		}
	}
	return errdefs.Clip(last, 2048)
}

func (b *Backend) logFile(dir string) string { return filepath.Join(dir, "runsc.log") }

// Create mounts the rootfs (read-only in effect: writes stay in the
// sandbox's memory) and writes the bundle.
func (b *Backend) Create(ctx context.Context, spec *backend.Spec) (*backend.Handle, error) {
	if err := rootfs.Mount(spec.Layers, rootfs.LayoutIn(spec.Dir)); err != nil {
		return nil, err
	}
	bx := b.newBox(spec)
	if err := writeSpec(spec.Dir, runtimeSpec(spec, b.cg, bx.runscID)); err != nil {
		rootfs.Unmount(filepath.Join(spec.Dir, "rootfs")) //nolint:errcheck // reporting the first error
		return nil, err
	}
	b.track(spec.ID, bx)
	return b.handle(spec.ID, bx), nil
}

// newBox is a new sandbox (or restored copy) of spec: on the newer runsc
// if it has a network, or if every sandbox runs there (then with its
// writable layer on the node's disk).
func (b *Backend) newBox(spec *backend.Spec) *box {
	_, newer := b.newer()
	bx := &box{dir: spec.Dir, runscID: newRunscID(spec.ID), net: spec.NetNS != ""}
	bx.modern = newer && (bx.net || b.newerForAll)
	if newer && b.newerForAll {
		bx.diskMB = spec.DiskMB
	}
	return bx
}

func (b *Backend) track(id sandboxid.ID, bx *box) {
	b.mu.Lock()
	b.boxes[id] = bx
	b.mu.Unlock()
}

func (b *Backend) get(id sandboxid.ID) (box, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	bx, ok := b.boxes[id]
	if !ok {
		return box{}, errdefs.NotFound("sandbox %s: unknown to the gvisor backend", id)
	}
	return *bx, nil
}

// Start boots the sandbox.
func (b *Backend) Start(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	return b.launch(ctx, b.rtOf(bx), b.logFile(bx.dir), bx, "run", "--detach", "--bundle", bx.dir, bx.runscID)
}

// Stop kills the sandbox (SIGTERM to its processes first).
func (b *Backend) Stop(ctx context.Context, id sandboxid.ID, grace time.Duration) error {
	bx, err := b.get(id)
	if err != nil {
		return nil
	}
	st, err := b.Status(ctx, id)
	if err != nil {
		return err
	}
	if st.State == backend.StateStopped {
		return b.waitSandboxGone(ctx, id, bx)
	}
	if st.State == backend.StatePaused {
		b.Resume(ctx, id) //nolint:errcheck // best effort before killing
	}
	b.run(ctx, b.rtOf(bx), "", "kill", "--all", bx.runscID, "TERM") //nolint:errcheck // it may be gone
	if done, err := backend.WaitStopped(ctx, b, id, grace); err != nil || done {
		if err != nil {
			return err
		}
		return b.waitSandboxGone(ctx, id, bx)
	}
	if err := b.rtOf(bx).cli("").Kill(ctx, bx.runscID, "KILL", true); err != nil {
		return err
	}
	// runsc reports the container running until the sentry has reaped
	// what the KILL ended.
	if done, err := backend.WaitStopped(ctx, b, id, backend.StopAfterKill); err != nil || done {
		if err != nil {
			return err
		}
		return b.waitSandboxGone(ctx, id, bx)
	}
	return errdefs.Unavailable("gvisor: sandbox %s still runs %v after SIGKILL", id, backend.StopAfterKill)
}

// waitSandboxGone waits, once runsc reports bx's container stopped, for
// its sandbox (the sentry and gofer) to leave its cgroup, and kills what
// is left after StopAfterKill. Until then runsc may report it running
// again: while the sentry shuts down it answers no state query, and runsc
// then keeps the status its state file last saved (Container.CheckStopped)
// for as long as the sandbox process exists. A process leaves its cgroup
// when it exits, before its parent reaps it, and runsc takes the zombie
// for a live sandbox: so the wait ends only when runsc, too, reports it
// stopped (a conformance run saw it running right after Stop returned).
func (b *Backend) waitSandboxGone(ctx context.Context, id sandboxid.ID, bx box) error {
	g := b.cg.Group(bx.runscID)
	if !g.WaitEmpty(backend.StopAfterKill) {
		g.KillAll() //nolint:errcheck // what survives is reported below
		if !g.WaitEmpty(backend.StopAfterKill) {
			if procs := g.Procs(); len(procs) > 0 {
				return errdefs.Unavailable("gvisor: sandbox %s: its container stopped, but its sandbox's processes %v outlive a kill by %v", bx.runscID, procs, backend.StopAfterKill)
			}
		}
	}
	done, err := backend.WaitStopped(ctx, b, id, backend.StopAfterKill)
	if err != nil || done {
		return err
	}
	return errdefs.Unavailable("gvisor: sandbox %s: its processes are gone, but runsc still reports it running %v later (its sandbox process not yet reaped)", bx.runscID, backend.StopAfterKill)
}

// Destroy removes the sandbox, its cgroups and its rootfs mount. A sandbox
// this backend does not know (a crash came before its handle was saved,
// or it failed to recover) is found by its id: every runsc generation and
// cgroup named after it is removed; the edge unmounts what is left in the
// sandbox's directory.
func (b *Backend) Destroy(ctx context.Context, id sandboxid.ID) error {
	b.mu.Lock()
	bx := b.boxes[id]
	delete(b.boxes, id)
	b.mu.Unlock()
	var errs []error
	if bx != nil {
		errs = append(errs, b.remove(ctx, *bx, b.rtOf(*bx)))
	}
	for _, rid := range b.generations(ctx, id) {
		if bx == nil || rid != bx.runscID {
			errs = append(errs, b.remove(ctx, box{runscID: rid}, b.runtimes()...))
		}
	}
	return errors.Join(errs...)
}

// generations lists the runsc ids of a sandbox that runsc or the cgroup
// tree still has (several after restores in place).
func (b *Backend) generations(ctx context.Context, id sandboxid.ID) []string {
	seen := map[string]bool{}
	var out []string
	add := func(rid string) {
		if strings.HasPrefix(rid, string(id)+"-") && !seen[rid] {
			seen[rid] = true
			out = append(out, rid)
		}
	}
	for _, rt := range b.runtimes() {
		if list, err := b.run(ctx, rt, "", "list", "-quiet"); err == nil {
			for _, rid := range strings.Fields(string(list)) {
				add(rid)
			}
		}
	}
	for _, rid := range b.cg.Children(string(id) + "-") {
		add(rid)
	}
	return out
}

// remove deletes one runsc container generation (through each of rts that
// may know it) and its cgroups, and unmounts its rootfs.
func (b *Backend) remove(ctx context.Context, bx box, rts ...runtime) error {
	var errs []error
	b.cg.Group(bx.runscID).Thaw() //nolint:errcheck // a frozen sandbox cannot be killed; it may not be frozen
	// Its processes go first: runsc's delete asks the sandbox to stop,
	// and one stopped from the node (SIGSTOP) would never answer.
	if err := b.cg.Group(bx.runscID).KillAll(); err != nil {
		errs = append(errs, err)
	}
	for _, rt := range rts {
		if err := rt.cli("").Delete(ctx, bx.runscID); err != nil {
			errs = append(errs, err)
		}
	}
	if err := b.cg.Group(bx.runscID).Remove(); err != nil {
		errs = append(errs, err)
	}
	if bx.dir != "" {
		if err := rootfs.Unmount(filepath.Join(bx.dir, "rootfs")); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Status asks the freezer, then runsc (which cannot answer for a frozen
// sandbox: its control server is frozen too).
func (b *Backend) Status(ctx context.Context, id sandboxid.ID) (backend.Status, error) {
	bx, err := b.get(id)
	if err != nil {
		return backend.Status{ID: id, State: backend.StateStopped}, nil
	}
	if b.cg.Group(bx.runscID).Frozen() {
		return backend.Status{ID: id, State: backend.StatePaused}, nil
	}
	// A sentry or gofer stopped from the node: runsc state would wait on
	// it, and nothing in the sandbox answers. Not the platform's stub
	// processes, which systrap keeps stopped while it sets them up.
	for _, pid := range b.cg.Group(bx.runscID).Procs() {
		if runscProcess(pid) && backend.ProcessStopped(pid) {
			return backend.Status{ID: id, State: backend.StateRunning, Pid: pid, HostStopped: true}, nil
		}
	}
	rs, err := b.rtOf(bx).cli("").State(ctx, bx.runscID)
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
	case "running", "paused":
		st.State = backend.StateRunning
	case "stopped":
		st.State = backend.StateStopped
	default:
		st.State = backend.StateUnknown
	}
	return st, nil
}

// Recover re-attaches after an edge restart: the sandbox kept running.
func (b *Backend) Recover(ctx context.Context, h *backend.Handle, spec *backend.Spec) error {
	var hs handleState
	if err := json.Unmarshal(h.State, &hs); err != nil {
		return fmt.Errorf("recover %s: bad handle: %w", h.ID, err)
	}
	if hs.RunscID == "" {
		hs.RunscID = string(h.ID) // handles written before generations
	}
	if hs.Modern && b.netRunsc == "" {
		return errdefs.FailedPrecondition("recover %s: it runs on the newer runsc (option runsc-network), which this edge is not given", h.ID)
	}
	b.track(h.ID, &box{dir: hs.Dir, runscID: hs.RunscID, net: hs.Net, modern: hs.Modern, diskMB: hs.DiskMB})
	waitCheckpoint(ctx, hs.RunscID)
	st, err := b.Status(ctx, h.ID)
	if err != nil {
		return err
	}
	if st.State != backend.StateRunning && st.State != backend.StatePaused {
		// The edge before this one may have restored it in place (after a
		// checkpoint stopped it) and gone down before it recorded the new
		// generation: that one runs, and is the sandbox now.
		if rid, ok := b.liveGeneration(ctx, h.ID, hs); ok {
			stopped := hs.RunscID
			hs.RunscID = rid
			b.track(h.ID, &box{dir: hs.Dir, runscID: rid, net: hs.Net, modern: hs.Modern, diskMB: hs.DiskMB})
			h.State, _ = json.Marshal(hs)
			b.remove(ctx, box{runscID: stopped}, b.runtimes()...) //nolint:errcheck // a stopped generation; Destroy retries
			b.log.Info("recovered the generation a restore in place had started", logging.SandboxID, h.ID, "runsc_id", rid)
			return nil
		}
		// What is left of it may still be ending (Debian's runsc's sandbox
		// ends itself once its checkpoint is written): a restore in place
		// must not meet it, nor its agent the restored one.
		if !b.cg.Group(hs.RunscID).WaitEmpty(checkpointWait / 4) {
			b.cg.Group(hs.RunscID).KillAll() //nolint:errcheck // reported by the restore, if it matters
		}
		return errdefs.FailedPrecondition("recover %s: sandbox is %s", h.ID, st.State)
	}
	return nil
}

// liveGeneration finds a running runsc generation of id other than the
// handle's.
func (b *Backend) liveGeneration(ctx context.Context, id sandboxid.ID, hs handleState) (string, bool) {
	rt := b.rtOf(box{net: hs.Net, modern: hs.Modern})
	for _, rid := range b.generations(ctx, id) {
		if rid == hs.RunscID {
			continue
		}
		rs, err := rt.cli("").State(ctx, rid)
		if err == nil && (rs.Status == "running" || rs.Status == "paused") {
			return rid, true
		}
	}
	return "", false
}

// Release implements backend.Releaser: after a checkpoint, the sandbox is
// killed if the checkpoint left it running (the newer runsc's
// --leave-running), and its cgroup's memory is emptied (what the
// checkpoint wrote stays charged to it as page cache); its stopped
// container stays known for a restore in place.
func (b *Backend) Release(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	// Debian's runsc ends the sandbox itself (it may still be going); the
	// newer one leaves it running, and it is killed.
	var killErr error
	for i := 0; ; i++ {
		st, err := b.Status(ctx, id)
		if err != nil {
			return err
		}
		if st.State == backend.StateStopped {
			break
		}
		switch {
		case i == 20 || i == 200: // 0.2 s, then 2 s after the checkpoint
			killErr = b.Stop(ctx, id, 0)
		case i == 500:
			return errdefs.Unavailable("sandbox %s did not stop after its checkpoint (kill: %v)", id, killErr)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return releaseMemory(ctx, b.cg.Group(bx.runscID))
}

// releaseMemory waits for what a stopped sandbox held to be given back.
// runsc reports it stopped before its processes are all gone; the sentry's
// memory file is shared memory, which no reclaim can drop while a process
// still maps it, and an offload measured then reported nothing given back.
// So: wait for the cgroup to empty, then reclaim until what is held is
// small, for a few seconds at most. A cgroup that does not empty is
// reported: its memory cannot be given back.
func releaseMemory(ctx context.Context, g cgroups.Group) error {
	if !g.WaitEmpty(5 * time.Second) {
		return errdefs.Unavailable("processes of the stopped sandbox still run after 5 s: %v", g.Procs())
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		if err := g.Reclaim(); err != nil {
			return err
		}
		u, err := oci.ReadUsage(g)
		if err != nil || u.HeldBytes() < 4<<20 || time.Now().After(deadline) || ctx.Err() != nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Pause freezes the sandbox's cgroup: the sentry, its gofer and every task.
func (b *Backend) Pause(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	return b.cg.Group(bx.runscID).Freeze()
}

// Resume thaws it.
func (b *Backend) Resume(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	return b.cg.Group(bx.runscID).Thaw()
}

// Diagnose says why a gVisor sandbox died: the host's OOM killer ended its
// sentry (the sandbox used more than its memory limit), or its host thread
// bound was reached, or runsc logged an error.
func (b *Backend) Diagnose(ctx context.Context, id sandboxid.ID) string {
	bx, err := b.get(id)
	if err != nil {
		return ""
	}
	if why := b.cg.Group(bx.runscID).DiagnoseOOM(); why != "" {
		return why
	}
	if n := b.cg.Group(bx.runscID).PidsRefused(); n > 0 {
		return fmt.Sprintf("its runtime reached the sandbox's host thread bound (%d refusals)", n)
	}
	if last := lastLogError(b.logFile(bx.dir)); last != "" {
		return "runsc: " + last
	}
	return ""
}

// nodePidMax is the kernel.pid_max a node running gVisor sandboxes needs:
// each sandbox may hold HostThreadBound host threads, and the kernel's
// default of 32768 is a few sandboxes' worth.
const nodePidMax = 4194304

// raisePidMax raises kernel.pid_max to nodePidMax if it is lower, and says
// so: it changes the host until reboot.
func raisePidMax(log *slog.Logger) {
	const p = "/proc/sys/kernel/pid_max"
	data, err := os.ReadFile(p)
	if err != nil {
		return
	}
	cur, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || cur >= nodePidMax {
		return
	}
	if err := os.WriteFile(p, []byte(strconv.Itoa(nodePidMax)), 0o644); err != nil {
		log.Warn("could not raise kernel.pid_max; gVisor sandboxes' host threads may exhaust the node's process ids", "pid_max", cur, logging.Error, err)
		return
	}
	log.Info("raised kernel.pid_max so gVisor sandboxes' host threads cannot exhaust the node's process ids", "from", cur, "to", nodePidMax)
}

// HostThreads is how many host tasks (sentry, gofer and stub threads) the
// sandbox holds: its host pids cgroup's count. The edge compacts a sandbox
// that holds many by a checkpoint and a restore in place, which only
// Debian's runsc (ptrace) needs and does: the newer one checkpoints
// leaving the sandbox running, and its systrap platform kept about two
// host threads a task (two waves of 200 tasks: 35 -> 440), which the host
// bound covers. So a sandbox on it reports none.
func (b *Backend) HostThreads(id sandboxid.ID) int {
	bx, err := b.get(id)
	if err != nil || bx.modern {
		return 0
	}
	return b.cg.Group(bx.runscID).PidsCurrent()
}

// Usage reads the sandbox's cgroups: the sentry's and gofer's CPU time and
// memory, which hold everything the sandbox runs.
func (b *Backend) Usage(id sandboxid.ID) (backend.Usage, error) {
	bx, err := b.get(id)
	if err != nil {
		return backend.Usage{}, err
	}
	return oci.ReadUsage(b.cg.Group(bx.runscID))
}

// Continue sends the sandbox's first process, the agent, SIGCONT: gVisor
// lets root inside stop its PID 1, which Linux does not.
func (b *Backend) Continue(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	// A sentry stopped from the node would never answer runsc's kill.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = b.run(ctx, b.rtOf(bx), "", "kill", bx.runscID, "CONT")
	return err
}

// runscProcess tells whether pid is one of runsc's own processes (the
// sentry "runsc-sandbox", the gofer "runsc-gofer"), not one of the
// platform's stubs, which share its cgroup and have no command line.
func runscProcess(pid int) bool {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	return err == nil && bytes.HasPrefix(data, []byte("runsc"))
}
