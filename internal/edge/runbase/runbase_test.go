package runbase

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/testutil"
)

// A full run base (every rebuild of the agent stages a new version) makes
// room for the running edge's agent instead of failing its start.
func TestStagingMakesRoomInAFullRunBase(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	if err := unix.Mount("dsec-test-run", base, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(base, unix.MNT_DETACH) }) //nolint:errcheck // test cleanup
	agentDir := t.TempDir()
	write := func(name string, b byte) string {
		p := filepath.Join(agentDir, name)
		if err := os.WriteFile(p, bytes.Repeat([]byte{b}, 400<<10), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// Two older versions fill most of the 1 MiB.
	var old []string
	for i, b := range []byte{1, 2} {
		staged, err := stageAgent(write("aether", b), base)
		if err != nil {
			t.Fatalf("version %d: %v", i, err)
		}
		dir := filepath.Dir(staged)
		past := time.Now().Add(-2 * time.Minute)
		os.Chtimes(dir, past, past) //nolint:errcheck // checked by the prune below
		old = append(old, dir)
	}
	if _, err := stageAgent(write("aether", 3), base); err == nil {
		t.Fatal("a third version fit: the test does not fill the run base")
	}
	staged, err := Stage(write("aether", 3), base)
	if err != nil {
		t.Fatalf("staging in a full run base: %v", err)
	}
	if !fileExists(staged) {
		t.Fatal("the agent is not staged")
	}
	for _, d := range old {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("older version %s kept: %v", d, err)
		}
	}
	// A version staged just now is kept when room is made.
	pruneStaged(base, "", time.Minute)
	if !fileExists(staged) {
		t.Fatal("a version staged less than a minute ago was pruned")
	}
}
