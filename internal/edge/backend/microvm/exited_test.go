package microvm

import (
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/spawn"
)

// waitExited waits for a process to have exited, counting a zombie as
// exited (its files, and a pid file's lock, are closed by then), and
// tells a later process of the same pid apart by its start time.
func TestWaitExitedCountsAZombieAndNotARunningProcess(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	was, ok := spawn.ReadStat(pid)
	if !ok || was.StartTime == 0 || was.State == "Z" {
		t.Fatalf("a running sleep: %+v, %v", was, ok)
	}
	done := make(chan error, 1)
	go func() { done <- waitExited(pid, was) }()
	select {
	case err := <-done:
		t.Fatalf("waitExited returned while the process ran: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	syscall.Kill(pid, syscall.SIGKILL) //nolint:errcheck // checked by the wait
	// Not reaped yet: a zombie.
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if st, _ := spawn.ReadStat(pid); st.State != "Z" {
		t.Fatalf("the killed, unreaped sleep's state is %q, want Z", st.State)
	}
	cmd.Wait() //nolint:errcheck // killed
	if st, ok := spawn.ReadStat(pid); ok && st.StartTime == was.StartTime {
		t.Fatal("a reaped process is still there")
	}
	if err := waitExited(pid, was); err != nil {
		t.Fatal(err)
	}
}
