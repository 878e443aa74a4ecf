package microvm

import (
	"os/exec"
	"syscall"
	"testing"
	"time"
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
	start := processStart(pid)
	if start == "" || processState(pid) == 'Z' {
		t.Fatalf("a running sleep: start %q, state %c", start, processState(pid))
	}
	done := make(chan error, 1)
	go func() { done <- waitExited(pid, start) }()
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
	if got := processState(pid); got != 'Z' {
		t.Fatalf("the killed, unreaped sleep's state is %c, want Z", got)
	}
	cmd.Wait() //nolint:errcheck // killed
	if processStart(pid) != "" && processStart(pid) == start {
		t.Fatal("a reaped process still has its start time")
	}
	if err := waitExited(pid, start); err != nil {
		t.Fatal(err)
	}
}
