package microvm

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A Firecracker guest's console is bounded [ours]. Firecracker writes the
// guest's serial port, and its own log, to its standard output: no size
// limit, no ring of its own (v1.12 has no serial API), so a guest that
// prints without end would fill the node's disk through a log file.
// Instead its standard output and error are a FIFO in the guest's
// directory, which Firecracker holds open read-write and non-blocking: it
// never waits on the FIFO and never gets EPIPE, and while nobody drains
// it a full pipe drops the guest's output (Firecracker counts each lost
// byte as a uart error and goes on). The edge drains the FIFO into
// console.ring, a file of fixed size that keeps the last consoleRingBytes,
// as QEMU's ring does in memory; after an edge restart, Recover drains it
// again. Verified with a stand-in writer and with the real binary's own
// output; a guest's serial output is not (no host here boots a
// Firecracker guest).
const (
	fcConsoleFIFO = "console.fifo"
	fcConsoleRing = "console.ring"
)

// openConsoleFIFO makes dir's console FIFO if it is missing and opens it
// for a VMM's output. The caller hands the file to the VMM, and once the
// VMM started calls handOver.
func openConsoleFIFO(dir string) (*os.File, error) {
	path := filepath.Join(dir, fcConsoleFIFO)
	if err := unix.Mkfifo(path, 0o600); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("console fifo: %w", err)
	}
	// Read-write: the VMM counts as a reader too, so it never gets EPIPE
	// while the edge is away, and opening never waits for one.
	return os.OpenFile(path, os.O_RDWR, 0)
}

// handOver makes the FIFO the VMM now holds non-blocking and closes the
// edge's copy. os/exec put the file in blocking mode to pass it on; the
// mode belongs to the open file, shared with the VMM, so setting it here
// sets it for the VMM.
func handOver(out *os.File) error {
	defer out.Close()
	return unix.SetNonblock(int(out.Fd()), true)
}

// drainConsole copies dir's console FIFO into its ring until every writer
// is gone (the VMM ended) or stop is called; stop waits for the copy to
// end. It returns once the reader is open, so output written after it
// returns is not lost. One drain holds a directory's ring at a time: a new
// VMM in the directory (a guest restored in place) waits up to wait for
// the drain of the one before to end; Recover, which passes 0, finds a
// guest whose drain runs drained already and does nothing.
func drainConsole(dir string, log *slog.Logger, wait time.Duration) (stop func(), err error) {
	ring, err := openRing(filepath.Join(dir, fcConsoleRing), consoleRingBytes, wait)
	if errors.Is(err, errRingBusy) {
		return func() {}, nil
	}
	if err != nil {
		return nil, err
	}
	// Non-blocking open: it returns at once; reads then wait in Go's
	// poller. With no writer left a read answers end of file.
	in, err := os.OpenFile(filepath.Join(dir, fcConsoleFIFO), os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		ring.Close()
		return nil, fmt.Errorf("console fifo: %w", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer ring.Close()
		defer in.Close()
		if _, err := io.Copy(ring, in); err != nil && !errors.Is(err, os.ErrClosed) {
			log.Warn("microvm: console drain ended", "dir", dir, "err", err)
		}
	}()
	return func() { in.Close(); <-done }, nil
}

// drainWait is how long a new VMM's drain waits for the one before it in
// the same directory, whose VMM has ended, to let the ring go.
const drainWait = 2 * time.Second

// reattachWait covers a read of the ring that probes its lock at the
// moment a restarted edge's drain takes it.
const reattachWait = 100 * time.Millisecond

// consoleTail is the end of dir's console ring, for errors (see
// quoteConsole).
func consoleTail(dir string) string {
	data, _ := readRing(filepath.Join(dir, fcConsoleRing))
	return quoteConsole(data)
}
