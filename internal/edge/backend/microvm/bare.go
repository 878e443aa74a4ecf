package microvm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// BareGuest is a QEMU guest run with nothing of the platform around it:
// the raw steps the backend's snapshot and fork are made of, for the
// benchmarks that compare the backend with what it wraps (bench/microvm).
type BareGuest struct {
	dir string
	pid int
}

// StartBare starts g daemonized, its QMP socket and pid file in dir.
func (q *QEMU) StartBare(ctx context.Context, dir string, g Guest) (*BareGuest, error) {
	bg := &BareGuest{dir: dir}
	args := append(q.Args(g), "-qmp", "unix:"+bg.sock()+",server=on,wait=off", "-pidfile", filepath.Join(dir, "qemu.pid"), "-daemonize")
	if out, err := exec.CommandContext(ctx, q.Binary, args...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("bare QEMU: %v: %s", err, strings.TrimSpace(string(out)))
	}
	data, err := os.ReadFile(filepath.Join(dir, "qemu.pid"))
	if err != nil {
		return nil, err
	}
	bg.pid, _ = strconv.Atoi(strings.TrimSpace(string(data)))
	return bg, nil
}

func (bg *BareGuest) sock() string { return filepath.Join(bg.dir, "qmp.sock") }

// Pid is the guest's QEMU process.
func (bg *BareGuest) Pid() int { return bg.pid }

// SnapshotShared stops the guest and writes its device state to state
// (x-ignore-shared: its RAM stays in its shared file), as the backend's
// snapshot does; it returns how long the guest was stopped for, which is
// all of the call. The guest stays stopped.
func (bg *BareGuest) SnapshotShared(ctx context.Context, state string) (time.Duration, error) {
	q, err := dialQMP(ctx, bg.sock())
	if err != nil {
		return 0, err
	}
	defer q.Close()
	if _, err := q.call("migrate-set-capabilities", ignoreShared); err != nil {
		return 0, err
	}
	began := time.Now()
	if _, err := q.call("stop", nil); err != nil {
		return 0, err
	}
	if _, err := q.call("migrate", map[string]any{"uri": "exec:cat > " + state}); err != nil {
		return 0, err
	}
	err = waitMigration(ctx, q)
	return time.Since(began), err
}

// Incoming takes the device state in (a guest started with Incoming and
// the snapshot's RAM file mapped privately) and runs it.
func (bg *BareGuest) Incoming(ctx context.Context, state string) error {
	q, err := dialQMP(ctx, bg.sock())
	if err != nil {
		return err
	}
	defer q.Close()
	if _, err := q.call("migrate-set-capabilities", ignoreShared); err != nil {
		return err
	}
	if _, err := q.call("migrate-incoming", map[string]any{"uri": "exec:cat " + state}); err != nil {
		return err
	}
	if err := waitMigration(ctx, q); err != nil {
		return err
	}
	_, err = q.call("cont", nil)
	return err
}

// Monitor runs one QMP command without arguments ("stop", "cont") and
// returns how long QEMU took to answer it.
func (bg *BareGuest) Monitor(ctx context.Context, command string) (time.Duration, error) {
	q, err := dialQMP(ctx, bg.sock())
	if err != nil {
		return 0, err
	}
	defer q.Close()
	began := time.Now()
	_, err = q.call(command, nil)
	return time.Since(began), err
}

// Kill ends the guest.
func (bg *BareGuest) Kill() {
	if bg.pid > 0 {
		syscall.Kill(bg.pid, syscall.SIGKILL) //nolint:errcheck // may be gone
	}
}
