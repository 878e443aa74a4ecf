package gvisor

import (
	"context"
	"fmt"
	"os/exec"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/backend/oci"
)

// Two runsc releases [ours]. Debian's (2022-12) runs sandboxes without a
// network by default: the suite's workarounds (statx, sudo, the freezer,
// compaction) are measured against it. The newer one (option
// "runsc-network", built by scripts/build-runsc.sh from the Go module
// proxy) runs what Debian's cannot:
//   - a sandbox with a network: Debian's cannot checkpoint once a TCP
//     connection existed and restores without the NIC, while the newer one
//     keeps the namespace's NIC across checkpoint and restore (a restored
//     copy takes the NIC and address of the namespace it is restored into);
//   - with option "runsc-newer-for" = "all", every new sandbox, with its
//     writable layer bounded by disk_mb on the node's disk: the overlay's
//     upper layer is a size-bounded file system backed by an unlinked file
//     in the sandbox's directory (--overlay2=root:dir=DIR,size=N), so a
//     fill gets ENOSPC inside and costs the node disk the edge admitted,
//     not memory. Not the default: under a fork bomb the newer runsc's
//     sentry grows on the node about twice as fast as Debian's (measured:
//     614 against 289 MiB in a 5 s bomb at 256 tasks), past the reserve
//     that keeps Debian's sandbox alive through it; left running, its
//     host processes grow without bound (6,423 in 30 s for 256 tasks:
//     systrap stubs that are not reaped, google/gvisor#12209).
// Without the option every sandbox runs on Debian's: networked ones cannot
// be snapshotted. A sandbox keeps the release it started on (its handle
// says which), and a snapshot names the release that took it.

// runtime is one runsc binary and the flags every call of it gets.
type runtime struct {
	bin, root, platform string
	// modern: the newer runsc, for sandboxes with a network.
	modern bool
}

// args are the flags a call about bx gets; restore must see the same
// configuration as run. A sandbox with a network uses the interface in the
// namespace the edge made.
func (rt runtime) args(logFile string, bx box) []string {
	network := "--network=none"
	if bx.net {
		network = "--network=sandbox"
	}
	args := []string{"--root", rt.root, "--platform=" + rt.platform, network, "--overlay2=" + rt.overlay(bx), "--host-uds=open"}
	if rt.modern {
		// The default shares one empty namespace among gofers, bind-mounted
		// under --root, which outlives every sandbox.
		args = append(args, "--gofer-network-namespace=new")
	}
	if logFile != "" {
		args = append(args, "--log", logFile)
	}
	return args
}

// overlay is where bx's writable layer lives: in its memory (so it is in
// a checkpoint image and each restored copy gets its own), or, on the
// newer runsc when every sandbox runs there, in a file system of disk_mb
// backed by a file in its directory, which a checkpoint saves with the
// memory.
func (rt runtime) overlay(bx box) string {
	if rt.modern && bx.diskMB > 0 && bx.dir != "" {
		return fmt.Sprintf("root:dir=%s,size=%dm", bx.dir, bx.diskMB)
	}
	return "root:memory"
}

// cli is rt's command line for calls about a sandbox that exists (state,
// kill, checkpoint, delete); logFile (if set) gets runsc's own log, whose
// last error is a failed call's reason.
func (rt runtime) cli(logFile string) oci.Runtime {
	r := oci.Runtime{Binary: rt.bin, Flags: rt.args(logFile, box{})}
	if logFile != "" {
		r.Detail = func() string { return lastLogError(logFile) }
	}
	return r
}

// legacy is Debian's runsc.
func (b *Backend) legacy() runtime {
	return runtime{bin: b.runsc, root: b.root, platform: b.platform}
}

// Option "runsc-newer-for": which new sandboxes run on the newer runsc.
const (
	NewerForOption  = "runsc-newer-for"
	NewerForNetwork = "network"
	NewerForAll     = "all"
)

// newer is the newer runsc, if configured and probed.
func (b *Backend) newer() (runtime, bool) {
	if b.netRunsc == "" {
		return runtime{}, false
	}
	return runtime{bin: b.netRunsc, root: b.root + "-net", platform: "systrap", modern: true}, true
}

// rtOf is the runsc of a sandbox.
func (b *Backend) rtOf(bx box) runtime {
	if rt, ok := b.newer(); ok && bx.modern {
		return rt
	}
	return b.legacy()
}

// runtimes are every runsc in use, for finding what a sandbox whose
// handle is lost left.
func (b *Backend) runtimes() []runtime {
	out := []runtime{b.legacy()}
	if rt, ok := b.newer(); ok {
		out = append(out, rt)
	}
	return out
}

// probeNetworked checks that the newer runsc runs and has the flags of a
// release that keeps NICs across restore.
func probeNetworked(ctx context.Context, bin string) error {
	out, err := exec.CommandContext(ctx, bin, "flags").CombinedOutput()
	if err != nil {
		return err
	}
	for _, flag := range []string{"allow-live-tcp-migration", "gofer-network-namespace"} {
		if !strings.Contains(string(out), flag) {
			return fmt.Errorf("%s has no --%s: it is not a release that keeps a sandbox's network across checkpoint and restore (build one with scripts/build-runsc.sh)", bin, flag)
		}
	}
	return nil
}
