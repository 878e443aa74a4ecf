package diskledger

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func open(t *testing.T, root, fsDir, holder string) *Ledger {
	t.Helper()
	l, err := Open(root, fsDir, holder)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func others(t *testing.T, l *Ledger) int64 {
	t.Helper()
	n, err := l.Others()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A holder sees what the others promised, and a failed check leaves its
// own promise as it was.
func TestHoldersSeeEachOthersPromises(t *testing.T) {
	root, fs := t.TempDir(), t.TempDir()
	a, b := open(t, root, fs, "edge-a"), open(t, root, fs, "edge-b")
	if err := a.Raise(func(o int64) (int64, error) { return 300, nil }); err != nil {
		t.Fatal(err)
	}
	var seen int64
	refused := errors.New("no room")
	if err := b.Raise(func(o int64) (int64, error) { seen = o; return 0, refused }); err != refused {
		t.Fatalf("a failed check: %v, want its error", err)
	}
	if seen != 300 || others(t, a) != 0 {
		t.Fatalf("b saw %d, a sees %d; want 300 and 0 (b's failed raise promises nothing)", seen, others(t, a))
	}
	if err := b.Raise(func(o int64) (int64, error) { return 200, nil }); err != nil {
		t.Fatal(err)
	}
	if got := others(t, a); got != 200 {
		t.Fatalf("a sees %d, want b's 200", got)
	}
	if err := a.Set(50); err != nil {
		t.Fatal(err)
	}
	if got := others(t, b); got != 50 {
		t.Fatalf("b sees %d after a lowered its promise to 50", got)
	}
	b.Close()
	if got := others(t, a); got != 0 {
		t.Fatalf("a sees %d after b left", got)
	}
}

// Raises under the lock never promise more than there is, however many
// holders race.
func TestRacingRaisesNeverOverPromise(t *testing.T) {
	root, fs := t.TempDir(), t.TempDir()
	const budget, holders, tries = 100, 4, 60
	var wg sync.WaitGroup
	got := make([]int64, holders)
	for i := range holders {
		l := open(t, root, fs, fmt.Sprintf("h%d", i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range tries {
				l.Raise(func(o int64) (int64, error) { //nolint:errcheck // a refusal is the point
					if o+got[i]+1 > budget {
						return 0, errors.New("full")
					}
					got[i]++
					return got[i], nil
				})
			}
		}()
	}
	wg.Wait()
	var sum int64
	for _, n := range got {
		sum += n
	}
	if sum != budget {
		t.Fatalf("%d promised in all (%v), want exactly the budget of %d", sum, got, budget)
	}
}

// A name held by a live holder cannot be taken twice; names are file
// names.
func TestAHolderNameIsHeldOnce(t *testing.T) {
	root, fs := t.TempDir(), t.TempDir()
	open(t, root, fs, "edge-a")
	if _, err := Open(root, fs, "edge-a"); err == nil || !strings.Contains(err.Error(), "in use by a live process") {
		t.Fatalf("a second edge-a: %v", err)
	}
	for _, bad := range []string{"", ".lock", "a/b", "x\x00"} {
		if _, err := Open(root, fs, bad); err == nil || !strings.Contains(err.Error(), "holder name") {
			t.Fatalf("holder %q: %v, want refused naming the holder name", bad, err)
		}
	}
}

// Ledgers are per file system: holders on different devices do not count
// each other.
func TestLedgersArePerFileSystem(t *testing.T) {
	root, fs := t.TempDir(), t.TempDir()
	var a, b syscall.Stat_t
	if syscall.Stat(fs, &a) != nil || syscall.Stat("/dev/shm", &b) != nil || a.Dev == b.Dev {
		t.Skip("needs /dev/shm on a file system of its own")
	}
	x, y := open(t, root, fs, "x"), open(t, root, "/dev/shm", "y")
	if err := x.Set(100); err != nil {
		t.Fatal(err)
	}
	if got := others(t, y); got != 0 || x.Dir() == y.Dir() {
		t.Fatalf("a holder on another file system sees %d (dirs %s, %s)", got, x.Dir(), y.Dir())
	}
}

// A holder killed with kill -9 leaves an entry nobody holds: the next
// reader drops it.
func TestADeadHoldersPromiseIsDropped(t *testing.T) {
	if os.Getenv("DISKLEDGER_HOLD") != "" {
		root, fs, _ := strings.Cut(os.Getenv("DISKLEDGER_HOLD"), "|")
		l, err := Open(root, fs, "child")
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		l.Set(700) //nolint:errcheck // the parent reads it
		fmt.Println("holding")
		time.Sleep(time.Minute)
		os.Exit(0)
	}
	root, fs := t.TempDir(), t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestADeadHoldersPromiseIsDropped$")
	cmd.Env = append(os.Environ(), "DISKLEDGER_HOLD="+root+"|"+fs)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if n, _ := out.Read(buf); !strings.Contains(string(buf[:n]), "holding") {
		t.Fatalf("child: %q", buf[:n])
	}
	a := open(t, root, fs, "parent")
	if got := others(t, a); got != 700 {
		t.Fatalf("a live child's promise reads %d, want 700", got)
	}
	cmd.Process.Kill() //nolint:errcheck // SIGKILL
	cmd.Wait()         //nolint:errcheck // killed
	if got := others(t, a); got != 0 {
		t.Fatalf("a killed child's promise reads %d, want it dropped", got)
	}
	if _, err := os.Stat(filepath.Join(a.Dir(), "child"+entrySuffix)); !os.IsNotExist(err) {
		t.Fatalf("the dead child's entry: %v, want removed", err)
	}
	// Its name can be taken again (an edge coming back after kill -9).
	open(t, root, fs, "child")
}
