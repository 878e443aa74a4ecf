package testutil

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

func TestProcessDirRemovesOnlyDeadProcessesDirs(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	base := filepath.Join(os.TempDir(), "opendsec-test", "thing")
	dead := filepath.Join(base, "99999999") // above any pid_max
	alive := filepath.Join(base, "1")       // init never exits
	other := filepath.Join(base, "notapid")
	for _, d := range []string{dead, alive, other} {
		if err := os.MkdirAll(filepath.Join(d, "sub"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	dir, err := ProcessDir("thing")
	if err != nil {
		t.Fatal(err)
	}
	if dir != filepath.Join(base, strconv.Itoa(os.Getpid())) {
		t.Fatalf("dir = %s", dir)
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		t.Fatalf("own dir: %v", err)
	}
	if _, err := os.Stat(dead); !os.IsNotExist(err) {
		t.Fatalf("a dead process's dir is still there: %v", err)
	}
	for _, d := range []string{alive, other} {
		if _, err := os.Stat(d); err != nil {
			t.Fatalf("%s was removed: %v", d, err)
		}
	}
}
