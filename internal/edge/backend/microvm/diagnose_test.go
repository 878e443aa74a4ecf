package microvm

import (
	"context"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// TestGuestReportSaysWhetherQEMUReconnectedTheAgent: for a guest whose
// agent went silent, the report names QEMU's run state and whether QEMU's
// end of the agent's channel is connected to the edge's socket, read from
// a real QEMU (not started: no guest runs, so its port stays closed).
func TestGuestReportSaysWhetherQEMUReconnectedTheAgent(t *testing.T) {
	qemu := testutil.RequireBinary(t, "qemu-system-x86_64")
	dir := t.TempDir()
	edgeSock := filepath.Join(dir, "edge.sock")
	bx := &box{Dir: dir}
	g := Guest{AgentChardev: "socket,id=agent,path=" + edgeSock + ",server=off,reconnect=1"}
	if err := bx.saveGuest(g); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(qemu, "-M", "microvm", "-nodefaults", "-no-user-config", "-display", "none", "-S",
		"-chardev", "ringbuf,id="+consoleChardev, "-chardev", g.AgentChardev,
		"-device", "virtio-serial-device", "-device", "virtserialport,chardev=agent,name="+AgentPort,
		"-qmp", "unix:"+bx.qmpSock()+",server=on,wait=off", "-pidfile", bx.pidFile(), "-daemonize").CombinedOutput()
	if err != nil {
		t.Fatalf("QEMU: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if data, err := os.ReadFile(bx.pidFile()); err == nil {
			pid, _ := strconv.Atoi(strings.TrimSpace(string(data)))
			syscall.Kill(pid, syscall.SIGKILL) //nolint:errcheck // may be gone
		}
	})
	id := sandboxid.ID("sandbox-1")
	b := &Backend{log: slog.New(slog.DiscardHandler), qemu: &QEMU{Binary: qemu}, boxes: map[sandboxid.ID]*box{id: bx}}
	ctx := context.Background()

	got := b.GuestReport(ctx, id)
	want := "QEMU reports the guest prelaunch; the agent's channel is not connected to the edge, the guest's port closed"
	if got != want {
		t.Fatalf("with nothing listening:\n got %q\nwant %q", got, want)
	}
	// The edge listens again: QEMU reconnects within its second.
	l, err := net.Listen("unix", edgeSock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	deadline := time.Now().Add(10 * time.Second)
	for got = b.GuestReport(ctx, id); got != "QEMU reports the guest prelaunch; the agent's channel is connected to the edge, the guest's port closed"; got = b.GuestReport(ctx, id) {
		if time.Now().After(deadline) {
			t.Fatalf("QEMU did not reconnect the agent's channel: %q", got)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if b.GuestReport(ctx, "sandbox-2") != "" {
		t.Fatal("a report of a guest the backend does not have")
	}
	// A QEMU that is gone reports nothing: the caller's reason stands.
	b.boxes[id] = &box{Dir: t.TempDir()}
	if got := b.GuestReport(ctx, id); got != "" {
		t.Fatalf("a guest without a QEMU: %q", got)
	}
}

func TestLastLineOfTheConsole(t *testing.T) {
	for in, want := range map[string]string{
		"":                                     "",
		"one line":                             "one line",
		"boot\nKernel panic - not syncing\n\n": "Kernel panic - not syncing",
		"  \n  ":                               "",
	} {
		if got := lastLine(in); got != want {
			t.Errorf("lastLine(%q) = %q, want %q", in, got, want)
		}
	}
}
