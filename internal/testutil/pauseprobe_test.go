package testutil

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// The probe itself must tell a frozen loop from a running one, or every
// pause test built on it proves nothing: stop its shell with SIGSTOP for a
// second and the gap shows; leave it running and it does not.
func TestPauseProbeSeesAFreeze(t *testing.T) {
	sh := RequireBinary(t, "sh")
	file := filepath.Join(t.TempDir(), "probe")
	cmd := exec.Command(sh, "-c", PauseProbe(file)+" echo $! > "+file+".pid; wait")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); cmd.Wait() })
	read := func(minRounds int) ProbeReading {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			if data, err := os.ReadFile(file); err == nil {
				if r, err := ParseProbe(string(data)); err == nil && r.Rounds >= minRounds {
					return r
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatalf("the probe did not reach %d rounds", minRounds)
		return ProbeReading{}
	}
	first := read(3)
	if first.LongGap >= 900*time.Millisecond {
		t.Fatalf("a running probe reports a gap of %v", first.LongGap)
	}
	syscall.Kill(-cmd.Process.Pid, syscall.SIGSTOP)
	time.Sleep(1200 * time.Millisecond)
	syscall.Kill(-cmd.Process.Pid, syscall.SIGCONT)
	now := read(first.Rounds)
	after := read(now.Rounds + 1)
	if after.LongGap < time.Second {
		t.Fatalf("after a 1.2 s stop the longest gap is %v", after.LongGap)
	}
}
