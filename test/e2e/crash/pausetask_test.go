package crash

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestPauseTaskOffloadsAndResumesTransparently: a task of gvisor,
// microvm, vm and container sandboxes is paused at the offload depth in one
// call. The gvisor, microvm and vm ones give their memory back (measured by
// their node) and are offloaded; the container ones are frozen, and the
// answer says why.
// Another task is not touched. Across a restart of every component,
// resume_task brings all back, each with its shell session's in-memory
// variable and its file; paused again, a plain call brings each back.
func TestPauseTaskOffloadsAndResumesTransparently(t *testing.T) {
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "busybox")
	vm := e2e.MicrovmOptions(t)
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.Backends["microvm"], cfg.Backends["vm"] = vm, vm }, "gvisor", "container", "microvm", "vm")
	ctx := e2e.Ctx(t)
	type member struct {
		sb      *client.Sandbox
		backend string
		session string
		secret  string
	}
	var members []*member
	for i, backend := range []string{"gvisor", "container", "microvm", "vm", "gvisor", "container"} {
		sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: "root/busybox:latest", Task: "rollout-7"})
		if err != nil {
			t.Fatal(err)
		}
		sess, err := sb.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		m := &member{sb: sb, backend: backend, session: sess.Msg.Session.Id}
		m.secret = strings.TrimSpace(string(e2e.RunIn(t, sb, m.session, fmt.Sprintf("SECRET=%d-$RANDOM$RANDOM; echo $SECRET", i))))
		e2e.Shell(t, sb, "echo "+m.secret+" > /root/secret")
		members = append(members, m)
	}
	other, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Task: "rollout-8"})
	if err != nil {
		t.Fatal(err)
	}
	// A project's key pauses its own subtree only: the same task label
	// in root (outside it) is not touched.
	team := c.Project(t, "root", "pausers", nil)
	if out, err := team.PauseTask(ctx, "rollout-7", sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE); err != nil || len(out.Results) != 0 {
		t.Fatalf("another project's pause_task of the same label: %v %v", out, err)
	}

	out, err := c.Client.PauseTask(ctx, "rollout-7", sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Results) != len(members) {
		t.Fatalf("pause_task answered for %d sandboxes, want %d: %v", len(out.Results), len(members), out.Results)
	}
	byID := map[string]*sandboxv1.TaskSandboxResult{}
	for _, r := range out.Results {
		byID[r.SandboxId] = r
	}
	var released int64
	for _, m := range members {
		r := byID[m.sb.ID]
		if r == nil || r.ErrorCode != "" || r.Sandbox.GetState() != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
			t.Fatalf("%s (%s): %v", m.sb.ID, m.backend, r)
		}
		switch m.backend {
		case "gvisor", "microvm", "vm":
			if r.Sandbox.PauseDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD || r.MemoryReleasedBytes < 1<<20 || r.Note != "" {
				t.Fatalf("%s %s: depth %v, released %d, note %q", m.backend, m.sb.ID, r.Sandbox.PauseDepth, r.MemoryReleasedBytes, r.Note)
			}
		case "container":
			if r.Sandbox.PauseDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE || r.MemoryReleasedBytes != 0 || !strings.Contains(r.Note, "memory stays allocated") {
				t.Fatalf("container %s: depth %v, released %d, note %q", m.sb.ID, r.Sandbox.PauseDepth, r.MemoryReleasedBytes, r.Note)
			}
		}
		released += r.MemoryReleasedBytes
	}
	if out.MemoryReleasedBytes != released {
		t.Fatalf("total released %d, the results add up to %d", out.MemoryReleasedBytes, released)
	}
	t.Logf("pause_task(offload) of 2 gvisor, 1 microvm, 1 vm and 2 container sandboxes gave back %d MiB", released>>20)
	got, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: other.ID}))
	if err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("the other task's sandbox: %v %v", got, err)
	}
	// Pausing again does nothing more.
	again, err := c.Client.PauseTask(ctx, "rollout-7", sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE)
	if err != nil || len(again.Results) != 0 {
		t.Fatalf("a second pause_task: %v %v", again, err)
	}

	c.Restart(t)
	ctx = e2e.Ctx(t)
	for _, m := range members {
		got, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: m.sb.ID}))
		if err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
			t.Fatalf("%s after the restart: %v %v", m.sb.ID, got, err)
		}
	}
	res, err := c.Client.ResumeTask(ctx, "rollout-7")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res.Results {
		if r.ErrorCode != "" || r.Sandbox.GetState() != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
			t.Fatalf("resume_task: %v", r)
		}
	}
	if len(res.Results) != len(members) {
		t.Fatalf("resume_task answered for %d, want %d", len(res.Results), len(members))
	}
	for _, m := range members {
		sb := c.Client.Sandbox(m.sb.ID)
		if v := strings.TrimSpace(string(e2e.RunIn(t, sb, m.session, "echo $SECRET"))); v != m.secret {
			t.Fatalf("%s (%s): the session's variable reads %q, want %q", m.sb.ID, m.backend, v, m.secret)
		}
		if v := strings.TrimSpace(string(e2e.Shell(t, sb, "cat /root/secret").Stdout)); v != m.secret {
			t.Fatalf("%s (%s): the file reads %q", m.sb.ID, m.backend, v)
		}
	}
	// A plain call resumes an offloaded sandbox by itself.
	again, err = c.Client.PauseTask(ctx, "rollout-7", sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
	if err != nil {
		t.Fatal(err)
	}
	if len(again.Results) != len(members) {
		t.Fatalf("the second offload answered for %d sandboxes, want %d", len(again.Results), len(members))
	}
	for _, r := range again.Results {
		want := sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE
		if b := r.Sandbox.GetSpec().GetBackend(); b == "gvisor" || b == "microvm" || b == "vm" {
			want = sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD
		}
		if r.ErrorCode != "" || r.Sandbox.GetState() != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED || r.Sandbox.PauseDepth != want {
			t.Fatalf("the second offload: %v", r)
		}
	}
	for _, m := range members {
		sb := c.Client.Sandbox(m.sb.ID)
		if v := strings.TrimSpace(string(e2e.RunIn(t, sb, m.session, "echo $SECRET"))); v != m.secret {
			t.Fatalf("%s (%s) after a call resumed it: %q, want %q", m.sb.ID, m.backend, v, m.secret)
		}
	}
	for _, m := range append(members, &member{sb: other}) {
		if err := c.Client.Sandbox(m.sb.ID).Stop(context.Background()); err != nil {
			t.Errorf("stop %s: %v", m.sb.ID, err)
		}
	}
}

// heldBy is the memory the processes of the given sandboxes hold on the
// node: the sum of their proportional set sizes (Pss, so pages shared
// between a sandbox's processes count once), found through the sandboxes'
// cgroups. Unlike the node's MemAvailable it does not move with what other
// tests on the machine do.
func heldBy(t *testing.T, ids []string) int64 {
	pids := map[string]bool{}
	for _, id := range ids {
		files, _ := filepath.Glob("/sys/fs/cgroup/*/opendsec/" + id + "*/cgroup.procs")
		more, _ := filepath.Glob("/sys/fs/cgroup/opendsec/" + id + "*/cgroup.procs") // cgroup v2
		for _, f := range append(files, more...) {
			data, _ := os.ReadFile(f)
			for _, pid := range strings.Fields(string(data)) {
				pids[pid] = true
			}
		}
	}
	var total int64
	for pid := range pids {
		data, err := os.ReadFile("/proc/" + pid + "/smaps_rollup")
		if err != nil {
			continue // the process ended
		}
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "Pss:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
				total += kb << 10
			}
		}
	}
	return total
}

// TestPreemptionDrill is issue 10's drill: 30 gvisor and 30 container
// sandboxes of one task, each with a process that holds a secret in its
// memory and serves it on a port, and a file. pause_task offloads them
// (the gvisor ones give their memory back, and their processes' memory
// shows it); dsec up is killed with SIGKILL and started again; then
// resume_task brings half back and a plain call each of the others. All
// 60 secrets and files are intact.
func TestPreemptionDrill(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "crun")
	node := e2e.NewUpNode(t)
	up := node.Start(t)
	defer func() {
		if t.Failed() { // the sandboxes outlive dsec up: stop what is left
			stopAll(t, up)
		}
		up.Cmd.Process.Signal(syscall.SIGTERM)
		up.Cmd.Wait()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	const perBackend = 30
	start := time.Now()
	type member struct {
		id, backend, secret string
	}
	members := make([]*member, 0, 2*perBackend)
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, 2*perBackend)
	sem := make(chan struct{}, 4)
	for i := range 2 * perBackend {
		backend := []string{"gvisor", "container"}[i%2]
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			sb, err := up.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: "root/busybox:latest", Task: "preempted",
				Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 128, DiskMb: 64}})
			if err != nil {
				errs <- err
				return
			}
			secret := fmt.Sprintf("s%d-%d", i, time.Now().UnixNano())
			// The secret lives only in the shell's memory until asked for
			// on port 7000; the file is on the writable layer.
			r, err := sb.Shell(ctx, "echo "+secret+" > /root/file; (S="+secret+"; while true; do echo $S | nc -l -p 7000; done) >/dev/null 2>&1 &")
			if err != nil || r.ExitCode != 0 {
				errs <- fmt.Errorf("prepare %s: %v %v", sb.ID, r, err)
				return
			}
			mu.Lock()
			members = append(members, &member{id: sb.ID, backend: backend, secret: secret})
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("60 sandboxes made and prepared in %v", time.Since(start).Round(time.Millisecond))
	ask := func(id string) (string, string) {
		sb := up.Client.Sandbox(id)
		var served string
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			r, err := sb.Shell(ctx, "nc 127.0.0.1 7000 </dev/null")
			if err != nil {
				t.Fatalf("%s: %v", id, err)
			}
			if served = strings.TrimSpace(string(r.Stdout)); served != "" {
				break
			}
		}
		r, err := sb.Shell(ctx, "cat /root/file")
		if err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		return served, strings.TrimSpace(string(r.Stdout))
	}
	for _, m := range members[:4] { // the servers answer before the pause
		if served, file := ask(m.id); served != m.secret || file != m.secret {
			t.Fatalf("%s before the pause: served %q, file %q, want %q", m.id, served, file, m.secret)
		}
	}

	var offloadable []string
	for _, m := range members {
		if m.backend == "gvisor" {
			offloadable = append(offloadable, m.id)
		}
	}
	before := heldBy(t, offloadable)
	began := time.Now()
	out, err := up.Client.PauseTask(ctx, "preempted", sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(began)
	after := heldBy(t, offloadable)
	if len(out.Results) != len(members) {
		t.Fatalf("pause_task answered for %d sandboxes, want %d", len(out.Results), len(members))
	}
	offloaded := 0
	for _, r := range out.Results {
		if r.ErrorCode != "" || r.Sandbox.GetState() != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
			t.Fatalf("pause_task: %v", r)
		}
		if r.Sandbox.PauseDepth == sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD {
			offloaded++
		}
	}
	if offloaded != perBackend {
		t.Fatalf("%d sandboxes offloaded, want the %d gvisor ones", offloaded, perBackend)
	}
	gained := before - after
	t.Logf("pause_task(offload) of %d sandboxes took %v: %d MiB given back as measured by their nodes; their processes held %d MiB before and %d MiB after",
		len(members), took.Round(time.Millisecond), out.MemoryReleasedBytes>>20, before>>20, after>>20)
	if out.MemoryReleasedBytes < perBackend*(4<<20) {
		t.Fatalf("only %d bytes given back for %d offloaded sandboxes", out.MemoryReleasedBytes, perBackend)
	}
	if gained < out.MemoryReleasedBytes/3 {
		t.Fatalf("the offloaded sandboxes' processes gave back %d MiB, less than a third of the %d MiB reported", gained>>20, out.MemoryReleasedBytes>>20)
	}

	up.Cmd.Process.Signal(syscall.SIGKILL)
	up.Cmd.Wait()
	restarted := time.Now()
	up = node.Start(t)
	t.Logf("dsec up killed with SIGKILL and started again in %v", time.Since(restarted).Round(time.Millisecond))
	for _, m := range members {
		got, err := up.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: m.id}))
		if err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
			t.Fatalf("%s (%s) after kill -9 and restart: %v %v", m.id, m.backend, got, err)
		}
	}
	// Half come back with resume_task (a second task label is not needed:
	// resume_task resumes all; so the plain-call half is asked first).
	for _, m := range members[:len(members)/2] {
		if served, file := ask(m.id); served != m.secret || file != m.secret {
			t.Fatalf("%s (%s) resumed by a call: served %q, file %q, want %q", m.id, m.backend, served, file, m.secret)
		}
	}
	t.Logf("%d sandboxes resumed by a call and checked in %v", len(members)/2, time.Since(restarted).Round(time.Millisecond))
	began = time.Now()
	res, err := up.Client.ResumeTask(ctx, "preempted")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("resume_task of %d sandboxes took %v", len(res.Results), time.Since(began).Round(time.Millisecond))
	if len(res.Results) != len(members)-len(members)/2 {
		t.Fatalf("resume_task resumed %d, want the %d still paused", len(res.Results), len(members)-len(members)/2)
	}
	for _, r := range res.Results {
		if r.ErrorCode != "" {
			t.Fatalf("resume_task: %v", r)
		}
	}
	for _, m := range members[len(members)/2:] {
		if served, file := ask(m.id); served != m.secret || file != m.secret {
			t.Fatalf("%s (%s) resumed by resume_task: served %q, file %q, want %q", m.id, m.backend, served, file, m.secret)
		}
	}
	stopped := time.Now()
	for _, m := range members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if err := up.Client.Sandbox(m.id).Stop(ctx); err != nil {
				t.Errorf("stop %s: %v", m.id, err)
			}
		}()
	}
	wg.Wait()
	t.Logf("60 sandboxes stopped in %v", time.Since(stopped).Round(time.Millisecond))
	checkNodeClean(t, node.State, up)
}
