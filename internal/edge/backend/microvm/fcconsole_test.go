package microvm

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestMain lets the test binary stand in for a VMM that prints without
// end (see consoleWriter).
func TestMain(m *testing.M) {
	if beat := os.Getenv("DSEC_TEST_CONSOLE_WRITER"); beat != "" {
		consoleWriter(beat)
		return
	}
	os.Exit(m.Run())
}

// consoleWriter writes numbered 100-byte lines to its standard output as
// Firecracker writes a guest's serial port: one write(2) each, a refused
// write dropped. Every 256 lines it records in beat how many lines it
// tried and how many were refused. It ends after five minutes, whatever
// became of its test.
func consoleWriter(beat string) {
	end := time.Now().Add(5 * time.Minute)
	for i, dropped := 0, 0; time.Now().Before(end); i++ {
		line := fmt.Appendf(nil, "line %09d %s\n", i, strings.Repeat("x", 84))
		if _, err := syscall.Write(1, line); err == syscall.EAGAIN {
			dropped++
		} else if err != nil {
			os.Exit(3)
		}
		if i%256 == 0 {
			os.WriteFile(beat+".tmp", fmt.Appendf(nil, "%d %d", i, dropped), 0o600) //nolint:errcheck // the test waits for the next
			os.Rename(beat+".tmp", beat)                                            //nolint:errcheck // as above
			time.Sleep(time.Millisecond)
		}
	}
}

// TestRingFileKeepsTheLastBytes: whatever the sizes of the writes, the
// ring holds the last bytes written, in order, at a fixed size; it keeps
// them across a reopen, and a file that is not a ring of that size is
// remade.
func TestRingFileKeepsTheLastBytes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ring")
	const size = 100
	r, err := openRing(path, size, 0)
	if err != nil {
		t.Fatal(err)
	}
	var all []byte
	check := func(when string) {
		t.Helper()
		got, err := readRing(path)
		if err != nil {
			t.Fatal(err)
		}
		want := all[max(0, len(all)-size):]
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: ring %q, want %q", when, got, want)
		}
		if st, _ := os.Stat(path); st.Size() != ringHeader+size {
			t.Fatalf("%s: the ring's file is %d bytes, want %d", when, st.Size(), ringHeader+size)
		}
	}
	check("empty")
	for i, n := range []int{1, 7, 0, 60, 33, 99, 100, 101, 250, 3} {
		p := bytes.Repeat([]byte{byte('a' + i)}, n)
		for j := range p {
			p[j] += byte(j % 3)
		}
		if k, err := r.Write(p); err != nil || k != n {
			t.Fatalf("write %d: %d, %v", n, k, err)
		}
		all = append(all, p...)
		check(fmt.Sprintf("after %d bytes", len(all)))
	}
	// One writer at a time: a second waits for the first to let go.
	if _, err := openRing(path, size, 0); !errors.Is(err, errRingBusy) {
		t.Fatalf("a second writer while the first holds the ring: %v, want errRingBusy", err)
	}
	first := r
	go func() { time.Sleep(50 * time.Millisecond); first.Close() }()
	if r, err = openRing(path, size, 10*time.Second); err != nil {
		t.Fatalf("a second writer once the first let go: %v", err)
	}
	r.Write([]byte("after a reopen"))
	all = append(all, "after a reopen"...)
	check("reopened")
	// A writer killed in a write leaves the sequence odd: a reader still
	// answers, and the next writer takes the ring on.
	// (The kill lets its lock go.)
	r.header(r.seq + 1)
	r.Close()
	check("cut mid-write")
	if r, err = openRing(path, size, 0); err != nil || r.seq&1 != 0 {
		t.Fatalf("the ring after a cut write: sequence %d, %v", r.seq, err)
	}
	r.Write([]byte("!"))
	all = append(all, '!')
	check("after a cut write")
	r.Close()
	if r, err = openRing(path, 2*size, 0); err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if got, _ := readRing(path); len(got) != 0 {
		t.Fatalf("a ring opened at another size kept %q", got)
	}
	if got, err := readRing(filepath.Join(t.TempDir(), "missing")); err != nil || got != nil {
		t.Fatalf("a missing ring: %q, %v", got, err)
	}
}

// TestRingReadersNeverSeeAWriteHalfDone: while one writer adds numbered
// lines, every read holds whole lines in order.
func TestRingReadersNeverSeeAWriteHalfDone(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ring")
	r, err := openRing(path, 1050, 0) // not a whole number of lines
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 20000; i++ {
			r.Write([]byte(line(i)))
		}
	}()
	for reads := 0; ; reads++ {
		select {
		case <-done:
			r.Close()
			if reads < 10 {
				t.Fatalf("only %d reads while the writer wrote", reads)
			}
			return
		default:
		}
		data, err := readRing(path)
		if err != nil {
			t.Fatal(err)
		}
		// Whole lines in a row, the first line's end before them and the
		// last one's start after them: a write half seen breaks the row.
		lines := strings.Split(string(data), "\n")
		if len(lines) < 3 {
			continue
		}
		prev := -1
		for _, l := range lines[1 : len(lines)-1] {
			var n int
			if _, err := fmt.Sscanf(l, "%d ", &n); err != nil || len(l) != 99 || n != prev+1 && prev != -1 {
				t.Fatalf("read %d: line %q after %d", reads, l, prev)
			}
			if prev == -1 && !strings.HasSuffix(line(n-1), lines[0]+"\n") {
				t.Fatalf("read %d: %q before line %d", reads, lines[0], n)
			}
			prev = n
		}
		if last := lines[len(lines)-1]; !strings.HasPrefix(line(prev+1), last) {
			t.Fatalf("read %d: %q after line %d", reads, last, prev)
		}
	}
}

// line is the ring test's line i, 100 bytes.
func line(i int) string { return fmt.Sprintf("%09d %s\n", i, strings.Repeat("y", 89)) }

// TestConsoleIsBoundedAndNeverStopsItsVMM: a stand-in VMM prints 100-byte
// lines without end through the console FIFO. The ring stays at its size
// and holds whole lines, newest last; while no edge drains (the edge is
// restarting) the VMM's writes are refused, not blocked, and it goes on;
// a new drain (Recover's) brings its newer lines, and a second drain of
// the same directory does nothing.
func TestConsoleIsBoundedAndNeverStopsItsVMM(t *testing.T) {
	dir := t.TempDir()
	beat := filepath.Join(dir, "beat")
	log := slog.New(slog.DiscardHandler)
	out, err := openConsoleFIFO(dir)
	if err != nil {
		t.Fatal(err)
	}
	stop, err := drainConsole(dir, log, drainWait)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "DSEC_TEST_CONSOLE_WRITER="+beat)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if err := handOver(out); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })

	progress := func() (tried, dropped int) {
		data, _ := os.ReadFile(beat)
		fmt.Sscan(string(data), &tried, &dropped)
		return
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
			select {
			case err := <-exited:
				t.Fatalf("the stand-in VMM ended (%v) while waiting for %s", err, what)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("no %s within 30s", what)
			}
		}
	}
	lastLine := func() int {
		data, err := readRing(filepath.Join(dir, fcConsoleRing))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(data), "\n")
		prev := -1
		if len(lines) < 3 {
			return prev
		}
		for i, l := range lines[1 : len(lines)-1] { // the first may be cut
			var n int
			if _, err := fmt.Sscanf(l, "line %d ", &n); err != nil || len(l) != 99 || n <= prev {
				t.Fatalf("line %d of the ring is %q after %d", i+1, l, prev)
			}
			prev = n
		}
		return prev
	}

	// 20,000 lines are 2 MB, 30 times the ring.
	waitFor("20,000 lines written", func() bool { tried, _ := progress(); return tried > 20000 })
	if st, err := os.Stat(filepath.Join(dir, fcConsoleRing)); err != nil || st.Size() != ringHeader+consoleRingBytes {
		t.Fatalf("the ring's file: %v, %v; want %d bytes", st, err, ringHeader+consoleRingBytes)
	}
	if n := lastLine(); n < 10000 {
		t.Fatalf("the ring's newest line is %d, want the stand-in's recent output", n)
	}
	// A second drain (Recover's, while the first runs) opens no reader.
	again, err := drainConsole(dir, log, 0)
	if err != nil {
		t.Fatalf("a second drain: %v", err)
	}
	if n := fifoReaders(t, dir); n != 1 {
		t.Fatalf("%d readers of the console FIFO after a second drain, want 1", n)
	}
	again()

	stop() // the edge is away
	tried, dropped := progress()
	waitFor("writes refused while nobody drains", func() bool { _, d := progress(); return d > dropped+1000 })
	waitFor("writes going on while nobody drains", func() bool { t2, _ := progress(); return t2 > tried+5000 })
	before := lastLine()

	stop, err = drainConsole(dir, log, 0) // Recover's
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	waitFor("newer lines after a new drain", func() bool { return lastLine() > before+5000 })
}

// fifoReaders counts this process's open files on dir's console FIFO.
func fifoReaders(t *testing.T, dir string) int {
	fds, err := filepath.Glob("/proc/self/fd/*")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, fd := range fds {
		if p, _ := os.Readlink(fd); p == filepath.Join(dir, fcConsoleFIFO) {
			n++
		}
	}
	return n
}
