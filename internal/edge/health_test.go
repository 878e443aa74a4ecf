package edge

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
)

// A sandbox whose agent dies is reported failed within about a second,
// with a reason; calls to it fail at once with that reason; it holds no
// capacity; stopping it removes it.
func TestDeadSandboxIsReportedFailedAndFailsFast(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	crashed := time.Now()
	f.fake.Crash(sandboxIDOf(sb))
	var got *sandboxv1.Sandbox
	for time.Since(crashed) < 10*time.Second {
		got, _ = f.edge.Get(sb.Id, "root")
		if got.State == sandboxv1.SandboxState_SANDBOX_STATE_FAILED {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got.State != sandboxv1.SandboxState_SANDBOX_STATE_FAILED || !strings.Contains(got.Message, "ended") {
		t.Fatalf("%v after the agent died: %v %q", time.Since(crashed), got.State, got.Message)
	}
	t.Logf("reported failed %v after the crash", time.Since(crashed).Round(time.Millisecond))
	start := time.Now()
	_, err = echo(t, agentClient(t, f.edge, sb.Id, "root"))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "failed") || time.Since(start) > 2*time.Second {
		t.Fatalf("call to a failed sandbox: %v after %v", err, time.Since(start))
	}
	if st := f.edge.Status(); st.Allocated.Sandboxes != 0 || len(st.Groups) != 0 {
		t.Fatalf("a failed sandbox holds capacity: %+v", st.Allocated)
	}
	if _, err := f.edge.Destroy(ctx, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.edge.Get(sb.Id, "root"); !errdefs.IsNotFound(err) {
		t.Fatalf("after stop: %v", err)
	}
}

// A failed sandbox stays failed across an edge restart, holding nothing.
func TestFailedSandboxSurvivesRestartAsARecord(t *testing.T) {
	f := newFixture(t, smallCapacity())
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.Crash(sandboxIDOf(sb))
	waitFailed(f.edge, sb.Id)
	f.edge.Close()
	e2 := f.open(t, smallCapacity())
	got, err := e2.Get(sb.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_FAILED || got.Message == "" {
		t.Fatalf("after restart: %v %v", got, err)
	}
	if e2.Status().Allocated.Sandboxes != 0 {
		t.Fatal("a failed sandbox holds capacity after a restart")
	}
}

// The edge applies a call's own deadline (Connect-Timeout-Ms), even when
// the agent never answers.
func TestEdgeAppliesTheCallDeadline(t *testing.T) {
	f := newFixture(t, smallCapacity())
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.Hang(sandboxIDOf(sb))
	srv := httptest.NewServer(f.edge.Handler())
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest("POST", srv.URL+"/opendsec.agent.v1.AgentService/Health", strings.NewReader("{}"))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Connect-Timeout-Ms", "300")
	req.Header.Set(headers.SandboxID, sb.Id)
	req.Header.Set(headers.Scope, "root")
	start := time.Now()
	resp, err := http.DefaultClient.Do(req) // no deadline of its own
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if took := time.Since(start); took > 5*time.Second || !strings.Contains(string(body), "deadline_exceeded") {
		t.Fatalf("after %v: %d %s", took, resp.StatusCode, body)
	}
}

func fastHeartbeats(t *testing.T) {
	t.Cleanup(sandbox.SetHeartbeatForTest(200*time.Millisecond, 200*time.Millisecond))
}

// An agent that stops answering while connected (gVisor lets the
// sandbox's root SIGSTOP its PID 1) gets SIGCONT from outside and carries
// on.
func TestStoppedAgentIsContinued(t *testing.T) {
	fastHeartbeats(t)
	f := newFixture(t, smallCapacity())
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.Hang(sandboxIDOf(sb))
	time.Sleep(3 * time.Second)
	if _, err := echo(t, agentClient(t, f.edge, sb.Id, "root")); err != nil {
		t.Fatalf("after SIGCONT: %v", err)
	}
	if got, _ := f.edge.Get(sb.Id, "root"); got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("state %v: %s", got.State, got.Message)
	}
}

// One that SIGCONT does not wake is failed, with the reason and what a
// VM's hypervisor reports of its guest.
func TestAgentThatNeverAnswersIsFailed(t *testing.T) {
	fastHeartbeats(t)
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.StuckForGood = true
	f.fake.Knobs.GuestReport = "QEMU reports the guest running"
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.Hang(sandboxIDOf(sb))
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		got, _ := f.edge.Get(sb.Id, "root")
		if got.State == sandboxv1.SandboxState_SANDBOX_STATE_FAILED {
			if !strings.Contains(got.Message, "stopped answering") || !strings.HasSuffix(got.Message, "; QEMU reports the guest running") {
				t.Fatalf("reason %q", got.Message)
			}
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatal("an agent that never answers was not failed")
}

// A failed sandbox whose remains could not be removed keeps its capacity
// counted (something of it may still run) and says so; a stop that
// removes it gives the capacity back.
func TestFailedSandboxKeepsCapacityUntilRemoved(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.SetFailures(errors.New("device busy"), nil)
	f.fake.Crash(sandboxIDOf(sb))
	got := waitFailed(f.edge, sb.Id)
	if got.State != sandboxv1.SandboxState_SANDBOX_STATE_FAILED || !strings.Contains(got.Message, "device busy") {
		t.Fatalf("after a crash and a failed removal: %v %q", got.State, got.Message)
	}
	if st := f.edge.Status(); st.Allocated.Sandboxes != 1 {
		t.Fatalf("capacity given back while the sandbox's remains are there: %+v", st.Allocated)
	}
	if _, err := f.edge.Destroy(ctx, sb.Id, "root"); err == nil {
		t.Fatal("stop reported success while removal fails")
	}
	// An edge restart retries the removal and, while it still fails,
	// keeps the capacity counted.
	f.edge.Close()
	e2 := f.open(t, smallCapacity())
	if st := e2.Status(); st.Allocated.Sandboxes != 1 {
		t.Fatalf("after a restart, capacity given back while the remains are there: %+v", st.Allocated)
	}
	f.fake.SetFailures(nil, nil)
	if _, err := e2.Destroy(ctx, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if st := e2.Status(); st.Allocated.Sandboxes != 0 {
		t.Fatalf("capacity not given back after the stop: %+v", st.Allocated)
	}
}

// waitFailed waits up to 10 s for sandbox id to be failed and returns what
// it last saw.
func waitFailed(e *Edge, id string) *sandboxv1.Sandbox {
	var got *sandboxv1.Sandbox
	for i := 0; i < 500; i++ {
		if got, _ = e.Get(id, "root"); got.State == sandboxv1.SandboxState_SANDBOX_STATE_FAILED {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return got
}

// A backend whose guests may be starved rather than hung (AgentWait, a
// microVM under TCG) has its sandbox failed only once its agent has also
// been silent that long, not at the third unanswered check.
func TestSilenceAllowedBeforeAHungAgentIsFailed(t *testing.T) {
	fastHeartbeats(t)
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.StuckForGood = true
	f.fake.Knobs.AgentWait = 3 * time.Second
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	hung := time.Now()
	f.fake.Hang(sandboxIDOf(sb))
	for time.Since(hung) < 20*time.Second {
		got, _ := f.edge.Get(sb.Id, "root")
		if got.State == sandboxv1.SandboxState_SANDBOX_STATE_FAILED {
			// Its last answer came at most a heartbeat before the hang.
			if took := time.Since(hung); took < 3*time.Second-400*time.Millisecond || !strings.Contains(got.Message, "stopped answering") {
				t.Fatalf("failed %v after the hang (allowed 3s of silence): %q", took, got.Message)
			}
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("an agent that never answers was not failed")
}
