package gvisor

import (
	"context"
	"fmt"
	"os/exec"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/backend/oci"
)

// Two runsc releases [ours]. Debian's (2022-12) runs every sandbox
// without a network: the suite's workarounds (statx, sudo, the freezer,
// compaction) are measured against it. A sandbox with a network needs a
// newer one (option "runsc-network", built by scripts/build-runsc.sh from
// the Go module proxy): Debian's cannot checkpoint once a TCP connection
// existed and restores without the NIC, while the newer one keeps the
// namespace's NIC across checkpoint and restore (a restored copy takes the
// NIC and address of the namespace it is restored into). Without the
// option, networked sandboxes run on Debian's and cannot be snapshotted.

// runtime is one runsc binary and the flags every call of it gets.
type runtime struct {
	bin, root, platform string
	// modern: the newer runsc, for sandboxes with a network.
	modern bool
}

// args are the flags every call gets; restore must see the same
// configuration as run and checkpoint. A sandbox with a network (netns)
// uses the interface in the namespace the edge made.
func (rt runtime) args(logFile string, netns bool) []string {
	network := "--network=none"
	if netns {
		network = "--network=sandbox"
	}
	args := []string{"--root", rt.root, "--platform=" + rt.platform, network, "--overlay2=root:memory", "--host-uds=open"}
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

// cli is rt's command line; logFile (if set) gets runsc's own log, whose
// last error is a failed call's reason.
func (rt runtime) cli(logFile string) oci.Runtime {
	r := oci.Runtime{Binary: rt.bin, Flags: rt.args(logFile, false)}
	if logFile != "" {
		r.Detail = func() string { return lastLogError(logFile) }
	}
	return r
}

// legacy is Debian's runsc.
func (b *Backend) legacy() runtime {
	return runtime{bin: b.runsc, root: b.root, platform: b.platform}
}

// networked is the newer runsc, if configured and probed.
func (b *Backend) networked() (runtime, bool) {
	if b.netRunsc == "" {
		return runtime{}, false
	}
	return runtime{bin: b.netRunsc, root: b.root + "-net", platform: "systrap", modern: true}, true
}

// rtOf is the runsc of a sandbox.
func (b *Backend) rtOf(bx box) runtime {
	if rt, ok := b.networked(); ok && bx.modern {
		return rt
	}
	return b.legacy()
}

// runtimes are every runsc in use, for finding what a sandbox whose
// handle is lost left.
func (b *Backend) runtimes() []runtime {
	out := []runtime{b.legacy()}
	if rt, ok := b.networked(); ok {
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
