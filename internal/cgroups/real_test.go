package cgroups

import (
	"bufio"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/testutil"
)

func testLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// realV2 finds a cgroup2 mount on this machine: the root on a v2 host, the
// "unified" mount of a hybrid one (which has no controllers, but has the
// core files: procs, freeze, kill, events). The test's parent is its own.
func realV2(t *testing.T) *Host {
	t.Helper()
	testutil.RequireRoot(t)
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 2 && fields[2] == "cgroup2" {
			h := &Host{Root: fields[1], Version: V2, Parent: fmt.Sprintf("/dsec-cgroups-test-%d", os.Getpid())}
			t.Cleanup(func() { removeTree(filepath.Join(h.Root, h.Parent)) }) //nolint:errcheck // best effort
			return h
		}
	}
	testutil.Missing(t, "a cgroup2 mount")
	return nil
}

// TestFreezeKillAndRemoveOnARealV2Hierarchy runs a process tree in a v2
// cgroup of its own: frozen it stops counting, thawed it goes on, KillAll
// (cgroup.kill) ends all of it, Remove leaves no directory.
func TestFreezeKillAndRemoveOnARealV2Hierarchy(t *testing.T) {
	h := realV2(t)
	g := h.Group("sb")
	if err := g.Create(); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", "sleep 600 & sleep 600 & wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill() //nolint:errcheck // it should be gone already
	if err := g.AddProcess(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	// The shell's children are forked after it moved, or before: wait for
	// all three in the cgroup (children follow their parent's cgroup).
	deadline := time.Now().Add(5 * time.Second)
	for len(g.Procs()) < 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if err := g.Freeze(); err != nil {
		t.Fatal(err)
	}
	if !g.Frozen() {
		t.Error("Frozen() false after Freeze")
	}
	if state := procState(t, cmd.Process.Pid); state != "S" && state != "D" {
		t.Errorf("a frozen shell is in state %q", state)
	}
	if err := g.Thaw(); err != nil {
		t.Fatal(err)
	}
	if g.Frozen() {
		t.Error("Frozen() true after Thaw")
	}
	if err := g.Freeze(); err != nil { // KillAll must end a frozen cgroup too
		t.Fatal(err)
	}
	if err := g.KillAll(); err != nil {
		t.Fatal(err)
	}
	err := cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Errorf("the shell ended with %v; want SIGKILL", err)
	}
	if n := len(g.Procs()); n != 0 {
		t.Errorf("%d processes left after KillAll", n)
	}
	if err := g.Remove(); err != nil {
		t.Fatal(err)
	}
	if dirs := g.Dirs(); len(dirs) != 0 {
		t.Errorf("left: %v", dirs)
	}
}

func procState(t *testing.T, pid int) string {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	return strings.Fields(s[strings.LastIndexByte(s, ')')+1:])[0]
}

func TestDetectReadsThisMachine(t *testing.T) {
	h, err := Detect(DefaultRoot, "")
	if err != nil {
		testutil.Missing(t, "a cgroup file system at "+DefaultRoot)
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(DefaultRoot, &st); err != nil {
		t.Fatal(err)
	}
	want := V1
	if st.Type == 0x63677270 { // CGROUP2_SUPER_MAGIC
		want = V2
	}
	if h.Version != want || h.Parent != DefaultParent {
		t.Errorf("Detect = %+v, want version %d, parent %s", h, want, DefaultParent)
	}
}
