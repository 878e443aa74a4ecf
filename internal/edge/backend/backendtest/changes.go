package backendtest

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// testChanges: a backend that reads a sandbox's changes (ChangeReader)
// shows, while the sandbox is paused (or running, for a backend that stops
// its tasks itself), a file it wrote, a file of the image
// it removed as an overlayfs whiteout, and a directory it replaced as
// opaque; the sandbox resumes after the release.
func testChanges(t *testing.T, newBackend Factory, env Env) {
	b := newBackend(t, t.TempDir())
	cr, ok := b.(backend.ChangeReader)
	if !ok {
		t.Skip("backend cannot read a sandbox's changes")
	}
	p, ok := b.(backend.Pauser)
	if !ok || !b.Capabilities().Pause {
		t.Fatal("a ChangeReader must pause: the edge pauses a sandbox before reading its changes")
	}
	ctx := ctxFor(t, 60*time.Second)
	sb := Start(t, b, env)
	sb.Sh(t, "echo written > /written && rm /bin/vi && rm -rf /sbin && mkdir /sbin && echo only > /sbin/only && sync")
	paused := !b.Capabilities().ChangesWhileRunning
	if paused {
		if err := p.Pause(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	upper, release, err := cr.OpenChanges(ctx, sb.Spec)
	if errors.Is(err, errdefs.ErrUnsupported) {
		t.Skipf("this backend's sandboxes cannot be read here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if data, err := os.ReadFile(filepath.Join(upper, "written")); err != nil || string(data) != "written\n" {
		t.Errorf("written file in the changes: %q %v", data, err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(upper, "bin", "vi"), &st); err != nil || st.Mode&unix.S_IFMT != syscall.S_IFCHR || st.Rdev != 0 {
		t.Errorf("removed /bin/vi: want a 0/0 character device (whiteout), got mode %o rdev %d (%v)", st.Mode, st.Rdev, err)
	}
	buf := make([]byte, 8)
	if n, err := unix.Lgetxattr(filepath.Join(upper, "sbin"), "trusted.overlay.opaque", buf); err != nil || string(buf[:n]) != "y" {
		t.Errorf("replaced /sbin: want trusted.overlay.opaque=y, got %q (%v)", buf[:n], err)
	}
	if err := release(); err != nil {
		t.Fatal(err)
	}
	if paused {
		if err := p.Resume(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	if got := sb.Sh(t, "cat /written"); got != "written\n" {
		t.Fatalf("after the release: %q", got)
	}
}
