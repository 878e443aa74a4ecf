package spawn

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/sysuser"
	"github.com/opendsec/opendsec/internal/testutil"
)

// cgroup2Root is a cgroup v2 hierarchy of the host's (the unified one of a
// hybrid host, or the only one), or the test skips.
func cgroup2Root(t *testing.T) string {
	testutil.RequireRoot(t)
	for _, p := range []string{"/sys/fs/cgroup/unified", "/sys/fs/cgroup"} {
		var st unix.Statfs_t
		if unix.Statfs(p, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
			return p
		}
	}
	t.Skip("no cgroup v2 hierarchy on this host")
	return ""
}

// With a cgroup, a process is born in it (no moment outside), and the
// agent that started it stays where it was.
func TestProcessesStartInTheSpawnersCgroup(t *testing.T) {
	root := cgroup2Root(t)
	dir, err := os.MkdirTemp(root, "spawn-test-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(dir)
	cg, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	before, _ := os.ReadFile("/proc/self/cgroup")
	s := &Spawner{Users: sysuser.NewDB("/"), Cgroup: cg}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	req := Request{Args: []string{"cat", "/proc/self/cgroup"}, Files: []*os.File{nil, w, w}}
	res, err := s.Resolve(req)
	if err != nil {
		t.Fatal(err)
	}
	p, err := s.Start(res, req)
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(r)
	p.Wait()
	s.Forget(p.Pid)
	if want := "0::/" + filepath.Base(dir) + "\n"; !strings.Contains(string(out), want) {
		t.Fatalf("the child's cgroups: %q, want %q among them", out, want)
	}
	if after, _ := os.ReadFile("/proc/self/cgroup"); string(after) != string(before) {
		t.Fatalf("the spawner moved: %q, was %q", after, before)
	}
}

// TestProcessesStartInTheImagesWorkDir: a request without a directory
// starts in the spawner's WorkDir (the image's WORKDIR), else in the
// user's home; a relative one is under the home either way.
func TestProcessesStartInTheImagesWorkDir(t *testing.T) {
	wd := t.TempDir()
	for _, c := range []struct {
		workDir, cwd, want string
	}{
		{wd, "", wd},
		{"", "", "/root"},
		{wd, "/", "/"},
	} {
		s := &Spawner{Users: sysuser.NewDB("/"), WorkDir: c.workDir}
		r, err := s.Resolve(Request{Args: []string{"/bin/sh"}, Cwd: c.cwd})
		if c.want == "/root" && err != nil {
			t.Skipf("this host's root has no home directory: %v", err)
		}
		if err != nil || r.Dir != c.want {
			t.Errorf("WorkDir %q, Cwd %q: dir %q (%v); want %q", c.workDir, c.cwd, r.Dir, err, c.want)
		}
	}
}

// TestProcessesRunAsTheImagesUser: a request naming no user runs as the
// spawner's DefaultUser (the image's USER); one naming a user, as that one.
func TestProcessesRunAsTheImagesUser(t *testing.T) {
	root, home := t.TempDir(), t.TempDir()
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	passwd := "root:x:0:0:root:/:/bin/sh\nbuilder:x:1234:1234::" + home + ":/bin/sh\n"
	if err := os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte(passwd), 0o644); err != nil {
		t.Fatal(err)
	}
	s := &Spawner{Users: sysuser.NewDB(root), DefaultUser: "builder"}
	r, err := s.Resolve(Request{Args: []string{"/bin/sh"}})
	if err != nil || r.User.Name != "builder" || r.Dir != home {
		t.Fatalf("no user named: %+v %v; want builder in %s", r, err, home)
	}
	if r, err := s.Resolve(Request{Args: []string{"/bin/sh"}, User: "root"}); err != nil || r.User.Name != "root" {
		t.Fatalf("root named: %+v %v", r, err)
	}
}

// TestStartWaitsUntilReady: no process starts before Ready is closed (the
// agent's spare threads are still being made), and each starts after.
func TestStartWaitsUntilReady(t *testing.T) {
	ready := make(chan struct{})
	s := &Spawner{Users: sysuser.NewDB("/"), Ready: ready}
	r, err := s.Resolve(Request{Args: []string{"/bin/true"}, Cwd: "/"})
	if err != nil {
		t.Skipf("no /bin/true to start: %v", err)
	}
	started := make(chan *os.Process, 1)
	go func() {
		p, err := s.Start(r, Request{Args: []string{"/bin/true"}})
		if err != nil {
			t.Error(err)
		}
		started <- p
	}()
	select {
	case <-started:
		t.Fatal("a process started before the spawner was ready")
	case <-time.After(50 * time.Millisecond):
	}
	close(ready)
	select {
	case p := <-started:
		if p != nil {
			p.Wait() //nolint:errcheck // reaped
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the start did not go on once the spawner was ready")
	}
}
