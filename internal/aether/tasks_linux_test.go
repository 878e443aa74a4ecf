package aether

import (
	"os"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// The bounding set is per thread: a drop on one thread leaves the others
// (and the children forked from them) with the capability, and the check
// the agent makes after its drop says which thread kept it.
func TestBoundingDropOnOneThreadIsNotEnough(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: only root has CAP_SYS_ADMIN in its bounding set to lose")
	}
	if err := checkBoundingDropped(unix.CAP_SYS_ADMIN); err == nil {
		t.Fatal("no thread has CAP_SYS_ADMIN before any drop, yet root's bounding set holds it")
	}
	done := make(chan error)
	go func() {
		// The thread is never unlocked, so it ends with the goroutine
		// and the test process keeps no thread without the capability.
		runtime.LockOSThread()
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, unix.CAP_SYS_ADMIN, 0, 0, 0); err != nil {
			done <- err
			return
		}
		err := checkBoundingDropped(unix.CAP_SYS_ADMIN)
		if err == nil || !strings.Contains(err.Error(), "still has capability 21") {
			t.Errorf("a drop on one thread passed the check: %v", err)
		}
		done <- nil
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
