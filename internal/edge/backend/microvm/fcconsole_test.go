package microvm

import (
	"bytes"
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
// tried and how many were refused. It ends after two minutes, whatever
// became of its test.
func consoleWriter(beat string) {
	end := time.Now().Add(2 * time.Minute)
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
	r, err := openRing(path, size)
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
	r.f.Close()
	if r, err = openRing(path, size); err != nil {
		t.Fatal(err)
	}
	r.Write([]byte("after a reopen"))
	all = append(all, "after a reopen"...)
	check("reopened")
	r.f.Close()
	if r, err = openRing(path, 2*size); err != nil {
		t.Fatal(err)
	}
	defer r.f.Close()
	if got, _ := readRing(path); len(got) != 0 {
		t.Fatalf("a ring opened at another size kept %q", got)
	}
	if got, err := readRing(filepath.Join(t.TempDir(), "missing")); err != nil || got != nil {
		t.Fatalf("a missing ring: %q, %v", got, err)
	}
}

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
	stop, err := drainConsole(dir, log)
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
	if again, err := drainConsole(dir, log); err != nil {
		t.Fatalf("a second drain: %v", err)
	} else {
		again()
	}

	stop() // the edge is away
	tried, dropped := progress()
	waitFor("writes refused while nobody drains", func() bool { _, d := progress(); return d > dropped+1000 })
	waitFor("writes going on while nobody drains", func() bool { t2, _ := progress(); return t2 > tried+5000 })
	before := lastLine()

	stop, err = drainConsole(dir, log) // Recover's
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	waitFor("newer lines after a new drain", func() bool { return lastLine() > before+5000 })
	if _, err := os.Stat(filepath.Join(dir, "console.log")); err == nil {
		t.Fatal("a console.log was written")
	}
}
