package atomicfile

import (
	"bytes"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// A reader polling the file while it is replaced again and again sees only
// whole versions of it, never an empty or cut one.
func TestReadersSeeWholeFilesOnly(t *testing.T) {
	p := filepath.Join(t.TempDir(), "client.env")
	versions := [][]byte{bytes.Repeat([]byte("a"), 64<<10), bytes.Repeat([]byte("b"), 96<<10)}
	if err := Write(p, versions[0], 0o600); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := Write(p, versions[i%2], 0o600); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for range 2000 {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(data, versions[0]) && !bytes.Equal(data, versions[1]) {
			t.Fatalf("read %d bytes that are neither version", len(data))
		}
	}
	close(stop)
	wg.Wait()
	if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v %v", fi.Mode(), err)
	}
	if _, err := os.Stat(p + ".tmp"); !os.IsNotExist(err) {
		t.Fatalf("the temporary file is left: %v", err)
	}
}
