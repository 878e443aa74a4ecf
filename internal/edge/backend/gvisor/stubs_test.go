package gvisor

import (
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
)

// A stopped stub of the platform (no command line, as systrap's are while
// it sets them up) is not taken for a sentry stopped from the node; a
// stopped process named runsc-sandbox is.
func TestOnlyRunscsOwnProcessesCountAsStoppedFromTheNode(t *testing.T) {
	sentry := exec.Command("sleep", "30")
	sentry.Args[0] = "runsc-sandbox"
	stub := exec.Command("sleep", "30")
	for _, c := range []*exec.Cmd{sentry, stub} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		if err := c.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for !backend.ProcessStopped(sentry.Process.Pid) || !backend.ProcessStopped(stub.Process.Pid) {
		if time.Now().After(deadline) {
			t.Fatal("SIGSTOP did not stop the processes")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !runscProcess(sentry.Process.Pid) {
		t.Fatal("a process named runsc-sandbox is not taken for runsc's")
	}
	if runscProcess(stub.Process.Pid) {
		t.Fatal("a process of another name is taken for runsc's")
	}
	if runscProcess(1 << 22) {
		t.Fatal("a pid that does not exist is taken for runsc's")
	}
}
