// Package crash kills dsec up with SIGKILL during creates, forks, snapshots
// and task pauses, and preempts whole tasks: afterwards nothing is lost or
// stuck. It was part of test/e2e/hostile, split off so that neither
// package comes near its timeout on a busy machine.
package crash

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// Twenty times, dsec up is killed with SIGKILL at a random moment of
// creates, stops and forks on both backends. Afterwards every sandbox it
// lists is usable or reported failed, none is stuck, and once they are
// stopped nothing is left on the node: no process, mount, cgroup,
// directory, runtime state or writable layer.
func TestKillDsecUpAnywhereLeavesNothingStuck(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "crun")
	node := e2e.NewUpNode(t)
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	t.Logf("seed %d", seed)
	spec := func(backend string) *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: backend, Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.2, MemoryMb: 128, DiskMb: 64}}
	}
	var up *e2e.UpProcess
	for round := 0; round < 20; round++ {
		up = node.Start(t)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		list, _ := up.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
		var existing []*sandboxv1.Sandbox
		if list != nil {
			existing = list.Msg.Sandboxes
		}
		var wg sync.WaitGroup
		for i := 0; i < 3; i++ {
			for _, b := range []string{"gvisor", "container"} {
				wg.Add(1)
				go func() { defer wg.Done(); up.Client.Create(ctx, spec(b)) }() //nolint:errcheck // killed mid-way on purpose
			}
		}
		for i, sb := range existing {
			switch {
			case i%3 == 0:
				wg.Add(1)
				go func() { defer wg.Done(); up.Client.Sandbox(sb.Id).Stop(ctx) }() //nolint:errcheck // likewise
			case i%3 == 1 && sb.Spec.Backend == "gvisor" && sb.State == sandboxv1.SandboxState_SANDBOX_STATE_RUNNING:
				wg.Add(1)
				go func() {
					defer wg.Done()
					up.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: sb.Id, Count: 1})) //nolint:errcheck // likewise
				}()
			}
		}
		time.Sleep(time.Duration(100+rng.IntN(1400)) * time.Millisecond)
		up.Cmd.Process.Signal(syscall.SIGKILL)
		up.Cmd.Wait()
		cancel()
		wg.Wait()
	}

	// The last start: everything it lists is usable or failed.
	settleAfterKills(t, node, "after 20 kills", "")
}

// kill -9 of dsec up while microVMs are being created and forked: QEMU
// daemonizes, so a VM whose create or copy was cut outlives the edge; the
// next start finishes or undoes every one, and once all are stopped no
// QEMU and no guest RAM of the node is left.
func TestKillDsecUpDuringMicrovmCreatesLeavesNoVM(t *testing.T) {
	flags := e2e.MicrovmUpFlags(t)
	node := e2e.NewUpNode(t)
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	t.Logf("seed %d", seed)
	spec := &sandboxv1.SandboxSpec{Backend: "microvm", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 128, DiskMb: 64}}
	for round := 0; round < 6; round++ {
		up := node.Start(t, flags...)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		list, _ := up.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
		var wg sync.WaitGroup
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if _, err := up.Client.Create(ctx, spec); err != nil && connect.CodeOf(err) != connect.CodeUnavailable && connect.CodeOf(err) != connect.CodeCanceled && !strings.Contains(err.Error(), "EOF") && !strings.Contains(err.Error(), "connection reset") {
					t.Logf("create in round %d: %v", round, err) // other than the kill's
				}
			}()
		}
		if list != nil {
			for i, sb := range list.Msg.Sandboxes {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if i%2 == 0 || sb.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
						up.Client.Sandbox(sb.Id).Stop(ctx) //nolint:errcheck // likewise
						return
					}
					up.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: sb.Id, Count: 1})) //nolint:errcheck // likewise
				}()
			}
		}
		// A TCG boot takes seconds: the kill lands before QEMU starts,
		// while it boots, or once the create is done.
		time.Sleep(time.Duration(200+rng.IntN(4000)) * time.Millisecond)
		up.Cmd.Process.Signal(syscall.SIGKILL)
		up.Cmd.Wait()
		cancel()
		wg.Wait()
	}
	settleAfterKills(t, node, "after 6 kills", "no record left running", flags...)
}

// settleAfterKills starts node's dsec up once more (with extra flags)
// after a test's kill -9 rounds: everything it lists must answer or be
// failed, never stuck; then it stops them all and checks that nothing of
// the node is left. what names the rounds in the log, with the dsec log's
// lines that contain logged (if any).
func settleAfterKills(t *testing.T, node e2e.UpNode, what, logged string, extra ...string) {
	t.Helper()
	up := node.Start(t, extra...)
	defer func() {
		up.Cmd.Process.Signal(syscall.SIGTERM)
		up.Cmd.Wait()
	}()
	ctx := e2e.Ctx(t)
	list, err := up.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]int{}
	for _, sb := range list.Msg.Sandboxes {
		counts[sb.State.String()]++
		switch sb.State {
		case sandboxv1.SandboxState_SANDBOX_STATE_RUNNING:
			if _, err := up.Client.Sandbox(sb.Id).Shell(ctx, "true"); err != nil {
				t.Errorf("%s is listed running but does not answer: %v", sb.Id, err)
			}
		case sandboxv1.SandboxState_SANDBOX_STATE_FAILED:
		default:
			t.Errorf("%s is stuck %v: %s", sb.Id, sb.State, sb.Message)
		}
	}
	if logged != "" {
		t.Logf("%s: %v; log: %s", what, counts, linesWith(filepath.Join(node.State, "dsec.log"), logged))
	} else {
		t.Logf("%s: %v", what, counts)
	}
	for _, sb := range list.Msg.Sandboxes {
		if err := up.Client.Sandbox(sb.Id).Stop(ctx); err != nil {
			t.Errorf("stop %s: %v", sb.Id, err)
		}
	}
	checkNodeClean(t, node.State, up)
}

// checkNodeClean stops up cleanly and asserts that nothing of its node's
// sandboxes is left. The stop comes first: it removes the layers the node
// keeps warm, and none is being made while the node is looked at (a layer
// made and not yet marked warm would read as left; under a CPU hog one
// was).
func checkNodeClean(t *testing.T, state string, up *e2e.UpProcess) {
	t.Helper()
	node := up.Node
	up.Cmd.Process.Signal(syscall.SIGTERM) //nolint:errcheck // it may have ended
	up.Cmd.Wait()                          //nolint:errcheck // a second Wait of a deferred stop fails harmlessly
	out, _ := exec.Command("ps", "-eo", "pid=,args=").Output()
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if strings.Contains(sc.Text(), node+"-") {
			t.Errorf("process left: %s", sc.Text())
		}
	}
	if ram, _ := filepath.Glob("/dev/shm/opendsec-" + node + "-*"); len(ram) > 0 {
		t.Errorf("guest RAM files left: %v", ram)
	}
	if cg, _ := filepath.Glob("/sys/fs/cgroup/*/opendsec/" + node + "-*"); len(cg) > 0 {
		t.Errorf("cgroups left: %v", cg)
	}
	mounts, _ := rootfs.MountsUnder(state)
	for _, m := range mounts {
		if _, err := os.Stat(m + ".warm"); err != nil {
			t.Errorf("mount left: %s", m)
		}
	}
	for _, d := range []string{filepath.Join(state, "edge", "sandboxes"), filepath.Join("/run/opendsec", node)} {
		if ents, _ := os.ReadDir(d); len(ents) > 0 {
			t.Errorf("%d entries left in %s", len(ents), d)
		}
	}
	if ents, _ := os.ReadDir(filepath.Join(state, "edge", "snapshots")); len(ents) > 0 {
		t.Errorf("%d snapshots left", len(ents))
	}
	layers, _ := filepath.Glob(filepath.Join(state, "edge", "layers", "*.img"))
	for _, l := range layers {
		if _, err := os.Stat(strings.TrimSuffix(l, ".img") + ".warm"); err != nil {
			t.Errorf("writable layer left: %s", l)
		}
	}
	backends := filepath.Join(state, "edge", "backends")
	// A template build a kill cut: its QEMU died with dsec up (PDEATHSIG)
	// and the next start removed its directory and guest RAM.
	templates := filepath.Join(backends, "microvm", "templates")
	if builds, _ := filepath.Glob(filepath.Join(templates, ".build-*")); len(builds) > 0 {
		t.Errorf("template builds left: %v", builds)
	}
	if strings.Contains(string(out), templates+"/") {
		t.Errorf("a template guest's QEMU is left:\n%s", out)
	}
	for _, rt := range []struct{ bin, root, quiet string }{
		{"crun", filepath.Join(backends, "container", "crun"), "-q"},
		{"runsc", filepath.Join(backends, "gvisor", "runsc"), "-quiet"},
		{testutil.NewerRunsc(t), filepath.Join(backends, "gvisor", "runsc-net"), "-quiet"},
	} {
		if out, err := exec.Command(rt.bin, "--root", rt.root, "list", rt.quiet).Output(); err == nil && strings.TrimSpace(string(out)) != "" {
			t.Errorf("%s still lists: %s", rt.root, strings.TrimSpace(string(out)))
		}
	}
}

// kill -9 of dsec up while a sandbox's memory is being written out: a
// snapshot, a fork or a task pause with offload in flight, on every
// backend that snapshots (gVisor on either runsc release: Debian's
// checkpoint stops the source, which the edge then restores, the newer
// one leaves it running and keeps the writable layer in a file; and
// microvm). At the restart the source is back
// (running, or paused, and then woken by the next call) with the process
// it ran, or, if it cannot be, listed failed with the reason; never gone.
// Then nothing of the node is left once everything is stopped.
func TestKillDsecUpDuringASnapshotKeepsTheSource(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	all := []string{"snapshot", "fork", "pause-task"}
	for _, k := range []struct {
		name, backend string
		flags         []string
		ops           []string
		rounds        int
	}{
		{"gvisor", "gvisor", nil, all, 6},
		{"gvisor-newer-runsc", "gvisor", []string{"--gvisor-runsc-network", testutil.NewerRunsc(t), "--gvisor-newer-runsc-for", "all"}, all, 6},
		{"microvm", "microvm", e2e.MicrovmUpFlags(t), all, 6},
	} {
		t.Run(k.name, func(t *testing.T) { killDuringSnapshots(t, k.backend, k.ops, k.rounds, k.flags...) })
	}
}

func killDuringSnapshots(t *testing.T, backend string, ops []string, rounds int, flags ...string) {
	node := e2e.NewUpNode(t)
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	t.Logf("seed %d", seed)
	outcomes := map[string]int{}
	var up *e2e.UpProcess
	for round := 0; round < rounds; round++ {
		up = node.Start(t, flags...)
		// Two minutes: a TCG boot on a CI machine that runs two other
		// test packages beside this one has taken more than one.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		task := fmt.Sprintf("crash-%d", round)
		began := time.Now()
		src, err := up.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: "root/busybox:latest", Task: task, Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 128, DiskMb: 64}})
		if err != nil {
			t.Fatalf("round %d: create after %v: %v\nthe node's log, last lines:\n%s", round, time.Since(began).Round(time.Millisecond), err, lastLines(filepath.Join(node.State, "dsec.log"), 60))
		}
		t.Logf("round %d: created %s in %v", round, src.ID, time.Since(began).Round(time.Millisecond))
		if _, err := src.Shell(ctx, "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $! > /tmp/held.pid"); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			switch ops[round%len(ops)] {
			case "snapshot":
				up.Client.Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: src.ID})) //nolint:errcheck // killed mid-way on purpose
			case "fork":
				up.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 1})) //nolint:errcheck // likewise
			default:
				up.Client.Sandboxes.PauseTask(ctx, connect.NewRequest(&sandboxv1.PauseTaskRequest{Task: task, Depth: sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD})) //nolint:errcheck // likewise
			}
		}()
		time.Sleep(time.Duration(50+rng.IntN(700)) * time.Millisecond)
		up.Cmd.Process.Signal(syscall.SIGKILL)
		up.Cmd.Wait()
		<-done
		cancel()

		up = node.Start(t, flags...)
		ctx, cancel = context.WithTimeout(context.Background(), 60*time.Second)
		got, err := up.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: src.ID}))
		switch {
		case err != nil:
			t.Errorf("round %d: the source is gone after the restart: %v", round, err)
			outcomes["gone"]++
		case got.Msg.Sandbox.State == sandboxv1.SandboxState_SANDBOX_STATE_FAILED:
			if got.Msg.Sandbox.Message == "" {
				t.Errorf("round %d: the source is failed with no reason", round)
			}
			t.Logf("round %d: the source failed: %s", round, got.Msg.Sandbox.Message)
			outcomes["failed"]++
		case got.Msg.Sandbox.State == sandboxv1.SandboxState_SANDBOX_STATE_RUNNING || got.Msg.Sandbox.State == sandboxv1.SandboxState_SANDBOX_STATE_PAUSED:
			// A call to a paused sandbox resumes it first.
			r, err := up.Client.Sandbox(src.ID).Shell(ctx, "kill -0 $(cat /tmp/held.pid) && echo alive")
			if err != nil || strings.TrimSpace(string(r.Stdout)) != "alive" {
				ps, _ := exec.Command("sh", "-c", "ps -eo pid,ppid,args | grep "+src.ID+" | grep -v grep; cat /sys/fs/cgroup/*/opendsec/"+src.ID+"*/cgroup.procs | sort -u").CombinedOutput()
				t.Errorf("round %d: the source is listed %v but its process does not answer: %v %v; ps: %s\nlog: %s", round, got.Msg.Sandbox.State, r, err, ps, linesWith(filepath.Join(node.State, "dsec.log"), src.ID))
			}
			outcomes[strings.ToLower(strings.TrimPrefix(got.Msg.Sandbox.State.String(), "SANDBOX_STATE_"))]++
		default:
			t.Errorf("round %d: the source is stuck %v", round, got.Msg.Sandbox.State)
		}
		cancel()
		up.Cmd.Process.Signal(syscall.SIGTERM)
		up.Cmd.Wait()
	}
	t.Logf("after %d kills during %v: %v", rounds, ops, outcomes)
	up = node.Start(t, flags...)
	defer func() {
		up.Cmd.Process.Signal(syscall.SIGTERM)
		up.Cmd.Wait()
	}()
	ctx := e2e.Ctx(t)
	stopAll(t, up)
	// Snapshots that were taken before a kill are the caller's; any other
	// directory left is not.
	snaps, err := up.Client.Sandboxes.ListSnapshots(ctx, connect.NewRequest(&sandboxv1.ListSnapshotsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range snaps.Msg.Snapshots {
		if _, err := up.Client.Sandboxes.DeleteSnapshot(ctx, connect.NewRequest(&sandboxv1.DeleteSnapshotRequest{SnapshotId: s.Id})); err != nil {
			t.Errorf("delete snapshot %s: %v", s.Id, err)
		}
	}
	checkNodeClean(t, node.State, up)
}

// linesWith returns the lines of a log that name s.
func linesWith(path, s string) string {
	data, _ := os.ReadFile(path)
	var out []string
	for _, l := range strings.Split(string(data), "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// lastLines returns the last n lines of the file at path.
func lastLines(path string, n int) string {
	data, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// stopAll stops every sandbox up lists.
func stopAll(t *testing.T, up *e2e.UpProcess) {
	t.Helper()
	ctx := e2e.Ctx(t)
	list, err := up.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range list.Msg.Sandboxes {
		if err := up.Client.Sandbox(sb.Id).Stop(ctx); err != nil {
			t.Errorf("stop %s: %v", sb.Id, err)
		}
	}
}
