package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/oci"
	"github.com/opendsec/opendsec/internal/edge/layerfs"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// The bare bursts of -raw-spec, each adding one part of a create to bare
// crun: the config.json the container backend writes (cgroup limits of
// 0.1 core, 64 MiB and the API's default pids bound, the open-files
// limit, the seccomp filter compiled once, capabilities, masked paths,
// the agent's, run directory's and hosts file's binds) over the shared
// busybox tree, with `sleep` where the agent would run (rawOurSpec); then
// over a root made as a sandbox's, in its time: a writable layer
// (layerfs, a copy of a formatted ext4 image, loop-mounted) and the
// overlay over the busybox tree (rawOurRoot); then those two mounts in a
// mount namespace of the container's own, which crun joins
// (rawOurRootOwnNS); then the agent in place of sleep, a container
// counted once its crun returned and its agent dialled the socket it
// dials the edge on (rawOurAgent; nothing answers there: the agent
// waits). Beside crun's default spec and our full path, they split a
// create's cost into its parts.

// ourSpecCgroupParent is where those containers' cgroups go (each
// hierarchy's /opendsec-density-raw/ID); crun removes them on delete.
const ourSpecCgroupParent = "/opendsec-density-raw"

// writeOurSpecBundles writes n bundles of kind under dir, container i's
// in dir/i, over rootfs (or, from rawOurRoot on, over dir/i/rootfs, where
// the burst mounts each one's root; with rawOurRootOwnNS crun joins the
// mount namespace dir/i/mntns links to); agent is the file bound where
// the agent is, which runs with rawOurAgent, sleep otherwise. Agents dial
// dir/run/edge.sock.
func writeOurSpecBundles(dir, rootfs, agent string, n int, kind rawKind) error {
	cg, err := oci.Cgroups(ourSpecCgroupParent)
	if err != nil {
		return err
	}
	bpf, err := oci.SeccompBPF()
	if err != nil {
		return err
	}
	// As the container backend does without CAP_SYS_RESOURCE: the
	// process's own hard limit bounds the sandbox's.
	nofile := uint64(65536)
	var rl syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl) == nil {
		nofile = min(nofile, rl.Max)
	}
	run := filepath.Join(dir, "run")
	if err := os.MkdirAll(run, 0o755); err != nil {
		return err
	}
	for i := range n {
		id := sandboxid.ID("dsec-density-" + strconv.Itoa(i))
		bundle := filepath.Join(dir, strconv.Itoa(i))
		if err := os.MkdirAll(bundle, 0o755); err != nil {
			return err
		}
		spec := &backend.Spec{ID: id, Dir: bundle, Resources: backend.Resources{CPUCores: 0.1, MemoryMB: 64, Pids: 1024}, Hostname: string(id),
			AgentPath: agent, RunDir: run, HostsFile: "/etc/hosts", Env: []string{"PATH=/bin"}}
		s := oci.RuntimeSpec(spec, oci.Options{
			CgroupsPath: cg.Path(string(id)), CgroupV2: cg.Version == cgroups.V2, NoFile: nofile,
			Seccomp: oci.Seccomp(), SeccompBPF: bpf, NoNewPrivileges: true,
		})
		s.Root.Readonly = false
		if kind < rawOurRoot {
			s.Root.Path = rootfs
		}
		if kind != rawOurAgent {
			s.Process.Args = []string{"/bin/sleep", "3600"}
		}
		if kind == rawOurRootOwnNS {
			for j, ns := range s.Linux.Namespaces {
				if ns.Type == rspec.MountNamespace {
					s.Linux.Namespaces[j].Path = filepath.Join(bundle, "mntns")
				}
			}
		}
		data, err := json.Marshal(s)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o644); err != nil {
			return fmt.Errorf("bundle %d: %w", i, err)
		}
	}
	return nil
}

// ourRoot makes bare containers' roots as the edge makes a sandbox's.
type ourRoot struct {
	layers *layerfs.FS
	lower  string
	diskMB int64
}

func openOurRoot(ctx context.Context, dir, lower string, diskMB int64) (*ourRoot, error) {
	fs, err := layerfs.Open(layerfs.Config{Dir: dir}, nil)
	if err != nil {
		return nil, err
	}
	r := &ourRoot{layers: fs, lower: lower, diskMB: diskMB}
	// The first layer of a size formats its template, as the edge's
	// warm-up create did before its burst.
	layer, err := fs.Create(ctx, diskMB)
	if err != nil {
		return nil, err
	}
	return r, fs.Remove(layer)
}

// mount makes a writable layer and mounts the root over it at
// bundle/rootfs, returning what remove takes.
func (r *ourRoot) mount(ctx context.Context, bundle string) (string, error) {
	layer, err := r.layers.Create(ctx, r.diskMB)
	if err != nil {
		return "", err
	}
	l := rootfs.Layout{Upper: filepath.Join(layer, "upper"), Work: filepath.Join(layer, "work"), Target: filepath.Join(bundle, "rootfs")}
	if err := rootfs.Mount([]string{r.lower}, l); err != nil {
		r.layers.Remove(layer) //nolint:errcheck // reporting err
		return "", err
	}
	return layer, nil
}

// remove unmounts a container's root and removes its layer, once crun
// deleted the container.
func (r *ourRoot) remove(bundle, layer string) error {
	return errors.Join(rootfs.Unmount(filepath.Join(bundle, "rootfs")), r.layers.Remove(layer))
}

// agentDials accepts the bare agents' connections and notes when each
// came.
type agentDials struct {
	l     net.Listener
	mu    sync.Mutex
	at    []time.Time
	conns []net.Conn
}

func listenForAgents(sock string) (*agentDials, error) {
	l, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	d := &agentDials{l: l}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			d.mu.Lock()
			d.at, d.conns = append(d.at, time.Now()), append(d.conns, c)
			d.mu.Unlock()
		}
	}()
	return d, nil
}

// wait waits until n agents dialled, up to limit, and returns when each
// did, from start.
func (d *agentDials) wait(n int, start time.Time, limit time.Duration) ([]time.Duration, error) {
	for deadline := time.Now().Add(limit); ; time.Sleep(10 * time.Millisecond) {
		d.mu.Lock()
		got := len(d.at)
		var at []time.Duration
		if got >= n {
			for _, t := range d.at[:n] {
				at = append(at, t.Sub(start))
			}
		}
		d.mu.Unlock()
		if at != nil {
			return at, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%d of %d bare agents dialled within %s", got, n, limit)
		}
	}
}

func (d *agentDials) Close() {
	d.l.Close()
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		c.Close()
	}
}

// mountInOwnNS makes the root as mount does, but in a mount namespace of
// its own (a copy of this process's, its mounts made slaves so nothing
// reaches the host), which crun then joins (the spec's mount namespace
// path) instead of copying the host's: the host's mount table stays the
// size it was, however many containers run. It returns the path crun
// joins by, the descriptor that keeps the namespace (closing it, once
// the container is gone, takes the mounts and loop device with it) and
// the layer.
func (r *ourRoot) mountInOwnNS(ctx context.Context, bundle string) (string, *os.File, string, error) {
	type made struct {
		ns    *os.File
		layer string
		err   error
	}
	ch := make(chan made, 1)
	go func() {
		// Never unlocked: the thread, in another namespace now, ends with
		// the goroutine.
		runtime.LockOSThread()
		ns, layer, err := r.mountHere(ctx, bundle)
		ch <- made{ns, layer, err}
	}()
	m := <-ch
	if m.err != nil {
		return "", nil, "", m.err
	}
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), m.ns.Fd()), m.ns, m.layer, nil
}

// mountHere does mountInOwnNS's work on its locked thread: it unshares
// the thread's mount namespace, mounts the layer and root in it and opens
// the namespace.
func (r *ourRoot) mountHere(ctx context.Context, bundle string) (*os.File, string, error) {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return nil, "", os.NewSyscallError("unshare(CLONE_NEWNS)", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
		return nil, "", err
	}
	layer, err := r.layers.Create(ctx, r.diskMB)
	if err != nil {
		return nil, "", err
	}
	upper, work, target := filepath.Join(layer, "upper"), filepath.Join(layer, "work"), filepath.Join(bundle, "rootfs")
	for _, d := range []string{upper, work, target} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, "", err
		}
	}
	// rootfs.Mount mounts on a thread of its own, which would be the
	// host's: the overlay is mounted here, with absolute paths.
	if err := unix.Mount("overlay", target, "overlay", 0, "lowerdir="+r.lower+",upperdir="+upper+",workdir="+work); err != nil {
		return nil, "", fmt.Errorf("overlay: %w", err)
	}
	ns, err := os.Open("/proc/thread-self/ns/mnt")
	return ns, layer, err
}

// makeMountPoints makes, in a root tree that several containers run on,
// the directories and files their specs mount over.
func makeMountPoints(root string) error {
	for _, d := range []string{"proc", "dev", "sys", "etc", ".dsec/run"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return err
		}
	}
	for _, f := range []string{"etc/hosts", ".dsec/aether"} {
		if err := os.WriteFile(filepath.Join(root, f), nil, 0o644); err != nil {
			return err
		}
	}
	return nil
}
