package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// QEMU as the backend's vmm: one daemonized QEMU per guest, driven through
// its monitor (QMP) socket.

func (q *QEMU) title() string { return "QEMU" }

// id is "": handles from before Firecracker name no VMM.
func (q *QEMU) id() string { return "" }

func (q *QEMU) modules(net bool) []string {
	if net {
		return append(append([]string{}, q.moduleOrder()...), NetModules...)
	}
	return q.moduleOrder()
}

func (q *QEMU) sharesMemory() bool { return true }

// launch starts QEMU for g, daemonized, with the box's QMP socket and
// pid file.
func (q *QEMU) launch(ctx context.Context, bx *box, g Guest) error {
	if err := os.WriteFile(bx.started(), nil, 0o600); err != nil {
		return err
	}
	argv := append([]string{q.Binary}, q.Args(g)...)
	argv = append(argv, "-qmp", "unix:"+bx.qmpSock()+",server=on,wait=off", "-pidfile", bx.pidFile(), "-daemonize")
	if g.NetNS != "" {
		if err := plugTap(ctx, g.NetNS); err != nil {
			return err
		}
		argv = inNetNS(g.NetNS, argv...)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("microvm: start QEMU: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// pause stops the guest's vCPUs (QMP stop).
func (q *QEMU) pause(ctx context.Context, bx *box) error {
	_, err := qmp(ctx, bx.qmpSock(), "stop", nil)
	return err
}

func (q *QEMU) resume(ctx context.Context, bx *box) error {
	_, err := qmp(ctx, bx.qmpSock(), "cont", nil)
	return err
}

func (q *QEMU) paused(ctx context.Context, bx *box) bool {
	out, err := qmp(ctx, bx.qmpSock(), "query-status", nil)
	if err != nil {
		return false
	}
	var s struct {
		Running bool   `json:"running"`
		Status  string `json:"status"`
	}
	return json.Unmarshal(out, &s) == nil && stoppedByMonitor(s.Running, s.Status)
}

// snapshot stops the guest, has QEMU write only its device state
// (x-ignore-shared: the RAM stays in its shared file), keeps the RAM file
// and the writable disk beside it, and lets the guest run on. A guest
// whose RAM is not a shared file of its own (a copy, mapping its
// snapshot's file privately, or one booted again since) has QEMU write
// its RAM into the stream too: the snapshot then has no RAM file, and
// its copies read their RAM from the stream into files of their own.
func (q *QEMU) snapshot(ctx context.Context, bx *box, g Guest, ref backend.SnapshotRef) (*backend.SnapshotInfo, error) {
	shared := g.MemShared && g.MemFile != ""
	if !shared {
		g.MemFile = ""
	}
	m, err := dialQMP(ctx, bx.qmpSock())
	if err != nil {
		return nil, err
	}
	// Whatever happens (ctx ended too), the source runs again, on this
	// session: QEMU's monitor serves one client at a time.
	defer func() {
		m.c.SetDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck // a failed call says it
		m.call("cont", nil)                               //nolint:errcheck // reported by Status if it fails
		m.Close()
	}()
	if _, err := m.call("migrate-set-capabilities", ignoringShared(shared)); err != nil {
		return nil, err
	}
	agentLeft(ctx, m, agentLeftWait)
	if _, err := m.call("stop", nil); err != nil {
		return nil, err
	}
	state := filepath.Join(ref.Dir, "state")
	if _, err := m.call("migrate", map[string]any{"uri": "exec:cat > " + state}); err != nil {
		return nil, err
	}
	if err := waitMigration(ctx, m); err != nil {
		return nil, err
	}
	return keepGuestFiles(ctx, g, ref)
}

// restore starts a QEMU that maps the snapshot's RAM file privately
// (copy-on-write), takes the device state in and runs on. From a snapshot
// without a RAM file (its RAM is in the stream) the copy's RAM is a shared
// file of its own, as a booted guest's.
//
// A guest whose RAM is already a shared file of its own holding the
// snapshot's (a template copy: the caller copied it) keeps that file.
func (q *QEMU) restore(ctx context.Context, bx *box, g Guest, ref backend.SnapshotRef, started func() error) error {
	if err := g.hostFilesPresent(); err != nil {
		return err
	}
	// RAM is in the snapshot's stream unless the snapshot has a RAM file;
	// a guest without a RAM file of its own maps that one privately.
	ownRAM, ramFile := g.MemShared && g.MemFile != "", filepath.Join(ref.Dir, "mem")
	_, err := os.Stat(ramFile)
	inStream := errors.Is(err, os.ErrNotExist)
	if !ownRAM {
		if inStream {
			g.MemFile, g.MemShared = memFile(sandboxid.ID(filepath.Base(filepath.Dir(bx.Dir)))), true
		} else {
			g.MemFile, g.MemShared = ramFile, false
		}
	}
	g.Incoming = true
	if err := bx.saveGuest(g); err != nil {
		return err
	}
	if err := q.launch(ctx, bx, g); err != nil {
		return err
	}
	fail := func(err error) error {
		bx.kill(0) //nolint:errcheck // reporting err
		return err
	}
	if err := started(); err != nil {
		return fail(err)
	}
	m, err := dialQMP(ctx, bx.qmpSock())
	if err != nil {
		return fail(err)
	}
	defer m.Close()
	if _, err := m.call("migrate-set-capabilities", ignoringShared(!inStream)); err != nil {
		return fail(err)
	}
	if _, err := m.call("migrate-incoming", map[string]any{"uri": "exec:cat " + filepath.Join(ref.Dir, "state")}); err != nil {
		return fail(&loadError{err})
	}
	if err := waitMigration(ctx, m); err != nil {
		if ctx.Err() == nil {
			err = &loadError{err}
		}
		return fail(err)
	}
	if _, err := m.call("cont", nil); err != nil {
		return fail(err)
	}
	// Started again later (after a stop), it boots: the description it
	// keeps is of a fresh guest on its own disk (with its own RAM file,
	// if it has one).
	g.Incoming = false
	if !inStream && !ownRAM {
		g.MemFile, g.MemShared = "", false
	}
	if err := bx.saveGuest(g); err != nil {
		return fail(err)
	}
	return nil
}

// hostFilesPresent says which of the node's files the guest's devices
// need is missing here (an image's kernel this node has not taken, a
// modules disk it lacks): QEMU would fail a restore on it with less to go
// on.
func (g Guest) hostFilesPresent() error {
	for _, f := range [][2]string{{"the image's own kernel", g.Kernel}, {"the kernel modules disk", g.ModulesDisk}} {
		if f[1] == "" {
			continue
		}
		if _, err := os.Stat(f[1]); err != nil {
			return errdefs.FailedPrecondition("microvm: the snapshot's guest runs with %s %s, which this node lacks (%v): restore it on a node that ran its image's guests", f[0], f[1], err)
		}
	}
	return nil
}

// consoleTail is the end of the guest's console, which QEMU keeps in a
// ring in its memory (or, for a guest whose console was a file, that
// file's end).
func (q *QEMU) consoleTail(ctx context.Context, bx *box, g Guest) string {
	if g.Console != "" {
		return strings.TrimPrefix(tail(g.Console), "; console: ")
	}
	out, err := qmp(ctx, bx.qmpSock(), "ringbuf-read", map[string]any{"device": consoleChardev, "size": consoleRingBytes, "format": "utf8"})
	if err != nil {
		return ""
	}
	var text string
	json.Unmarshal(out, &text) //nolint:errcheck // nothing to quote
	if len(text) > 1024 {
		text = text[len(text)-1024:]
	}
	return strings.TrimSpace(text)
}

// reattach has nothing to do: QEMU dials the edge's new socket itself.
func (q *QEMU) reattach(*box, *slog.Logger) {}
