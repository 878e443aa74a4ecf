package snapxfer

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// holder writes a snapshot directory with a large file, a small one in a
// subdirectory and an empty one, and returns it with its manifest.
func holder(t *testing.T) (string, *Manifest) {
	t.Helper()
	dir := t.TempDir()
	big := make([]byte, 3<<20+17)
	rand.Read(big) //nolint:errcheck // crypto/rand does not fail on Linux
	files := map[string][]byte{"memory/pages.img": big, "config.json": []byte(`{"x":1}`), "memory/empty": nil, "snapshot.json": []byte("{}")}
	for p, data := range files {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o700)
		if err := os.WriteFile(filepath.Join(dir, p), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	m, err := Build(dir, []byte(`{"id":"snap-x"}`), "snapshot.json")
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Files) != 3 {
		t.Fatalf("manifest lists %+v; want 3 files without snapshot.json", m.Files)
	}
	return dir, m
}

// serve runs Handler for one snapshot with token "t0k", with wrap around
// it (nil: as is).
func serve(t *testing.T, dir string, m *Manifest, wrap func(http.Handler) http.Handler) *httptest.Server {
	t.Helper()
	var h http.Handler = Handler(func(id, token string) (string, *Manifest, error) {
		if id != "snap-x" {
			return "", nil, errdefs.NotFound("no snapshot %s", id)
		}
		if token != "t0k" {
			return "", nil, errdefs.PermissionDenied("wrong token")
		}
		return dir, m, nil
	})
	if wrap != nil {
		h = wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func sameTree(t *testing.T, m *Manifest, a, b string) {
	t.Helper()
	for _, f := range m.Files {
		x, err1 := os.ReadFile(filepath.Join(a, f.Path))
		y, err2 := os.ReadFile(filepath.Join(b, f.Path))
		if err1 != nil || err2 != nil || !bytes.Equal(x, y) {
			t.Fatalf("%s differs after the pull (%v, %v; %d vs %d bytes)", f.Path, err1, err2, len(x), len(y))
		}
	}
	left, _ := filepath.Glob(filepath.Join(b, "*", "*"+partSuffix))
	if len(left) > 0 {
		t.Fatalf("partial files left: %v", left)
	}
}

func TestPullCopiesEveryFileAndReportsProgress(t *testing.T) {
	dir, m := holder(t)
	srv := serve(t, dir, m, nil)
	dst := filepath.Join(t.TempDir(), "pulled")
	var last, total int64
	got, err := Pull(context.Background(), Source{Client: srv.Client(), BaseURL: srv.URL, ID: "snap-x", Token: "t0k"}, dst, func(d, tot int64) { last, total = d, tot })
	if err != nil {
		t.Fatal(err)
	}
	if string(got.Snapshot) != `{"id":"snap-x"}` || last != m.Total() || total != m.Total() {
		t.Fatalf("manifest %s, progress %d of %d, want %d", got.Snapshot, last, total, m.Total())
	}
	sameTree(t, m, dir, dst)
	if _, err := os.Stat(filepath.Join(dst, "snapshot.json")); err == nil {
		t.Fatal("a file the manifest skips was pulled")
	}
}

// cutter ends every file response after limit bytes, as a dropped
// connection would, and counts the requests with a Range header.
type cutter struct {
	limit  int
	ranged atomic.Int32
	next   http.Handler
}

type cutWriter struct {
	http.ResponseWriter
	left int
}

func (w *cutWriter) Write(p []byte) (int, error) {
	if len(p) > w.left {
		p = p[:w.left]
	}
	w.left -= len(p)
	n, err := w.ResponseWriter.Write(p)
	if err == nil && w.left == 0 {
		panic(http.ErrAbortHandler) // the connection is cut mid-body
	}
	return n, err
}

func (c *cutter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Range") != "" {
		c.ranged.Add(1)
	}
	if strings.Contains(r.URL.Path, "/files/memory/pages.img") {
		w = &cutWriter{ResponseWriter: w, left: c.limit}
	}
	c.next.ServeHTTP(w, r)
}

func TestPullResumesACutTransfer(t *testing.T) {
	dir, m := holder(t)
	c := &cutter{limit: 1 << 20}
	srv := serve(t, dir, m, func(h http.Handler) http.Handler { c.next = h; return c })
	dst := t.TempDir()
	if _, err := Pull(context.Background(), Source{Client: srv.Client(), BaseURL: srv.URL, ID: "snap-x", Token: "t0k"}, dst, nil); err != nil {
		t.Fatal(err)
	}
	sameTree(t, m, dir, dst)
	// 3 MiB in cuts of 1 MiB: the 2nd, 3rd and 4th requests ask for the rest.
	if n := c.ranged.Load(); n != 3 {
		t.Fatalf("%d range requests, want 3", n)
	}
}

func TestPullResumesAfterTheProcessStopped(t *testing.T) {
	dir, m := holder(t)
	srv := serve(t, dir, m, nil)
	dst := t.TempDir()
	// What a pull killed mid-file leaves: the first MiB of the big file.
	data, _ := os.ReadFile(filepath.Join(dir, "memory/pages.img"))
	os.MkdirAll(filepath.Join(dst, "memory"), 0o700)
	os.WriteFile(filepath.Join(dst, "memory/pages.img"+partSuffix), data[:1<<20], 0o600)
	c := &cutter{limit: 1 << 30}
	srv = serve(t, dir, m, func(h http.Handler) http.Handler { c.next = h; return c })
	var received atomic.Int64
	if _, err := Pull(context.Background(), Source{Client: srv.Client(), BaseURL: srv.URL, ID: "snap-x", Token: "t0k", Received: &received}, dst, nil); err != nil {
		t.Fatal(err)
	}
	sameTree(t, m, dir, dst)
	// Only what came over the network counts (the edge's pulled bytes).
	if want := m.Total() - 1<<20; received.Load() != want {
		t.Fatalf("received %d bytes, want %d (all but the MiB the pull had)", received.Load(), want)
	}
	if c.ranged.Load() != 1 {
		t.Fatalf("%d range requests, want 1 (the rest of the partial file)", c.ranged.Load())
	}
}

// corrupter flips a byte of the big file in its first `times` answers.
type corrupter struct {
	times atomic.Int32
	next  http.Handler
}

type flipWriter struct {
	http.ResponseWriter
	done bool
}

func (w *flipWriter) Write(p []byte) (int, error) {
	if !w.done && len(p) > 10 {
		q := append([]byte(nil), p...)
		q[10] ^= 0xff
		w.done = true
		return w.ResponseWriter.Write(q)
	}
	return w.ResponseWriter.Write(p)
}

func (c *corrupter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.Contains(r.URL.Path, "pages.img") && c.times.Add(-1) >= 0 {
		w = &flipWriter{ResponseWriter: w}
	}
	c.next.ServeHTTP(w, r)
}

func TestPullChecksEveryFile(t *testing.T) {
	dir, m := holder(t)
	// One corrupt transfer: the file is fetched again and matches.
	c := &corrupter{}
	c.times.Store(1)
	srv := serve(t, dir, m, func(h http.Handler) http.Handler { c.next = h; return c })
	dst := t.TempDir()
	if _, err := Pull(context.Background(), Source{Client: srv.Client(), BaseURL: srv.URL, ID: "snap-x", Token: "t0k"}, dst, nil); err != nil {
		t.Fatal(err)
	}
	sameTree(t, m, dir, dst)
	// Always corrupt: the pull fails, and no file of that name is there.
	c.times.Store(100)
	dst = t.TempDir()
	_, err := Pull(context.Background(), Source{Client: srv.Client(), BaseURL: srv.URL, ID: "snap-x", Token: "t0k"}, dst, nil)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "SHA-256") {
		t.Fatalf("pull of corrupt bytes: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dst, "memory/pages.img")); err == nil {
		t.Fatal("a file that failed its checksum is in place")
	}
}

func TestPullRefusals(t *testing.T) {
	dir, m := holder(t)
	srv := serve(t, dir, m, nil)
	src := Source{Client: srv.Client(), BaseURL: srv.URL, ID: "snap-x", Token: "wrong"}
	if _, err := Pull(context.Background(), src, t.TempDir(), nil); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("wrong token: %v", err)
	}
	src.Token, src.ID = "t0k", "snap-y"
	if _, err := Pull(context.Background(), src, t.TempDir(), nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown snapshot: %v", err)
	}
	// Only files the manifest lists are served.
	for _, p := range []string{"files/snapshot.json", "files/../../etc/passwd", "files/memory", "other"} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+Prefix+"snap-x/"+p, nil)
		req.Header.Set(TokenHeader, "t0k")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Fatalf("%s: HTTP %d, want 404", p, resp.StatusCode)
		}
	}
	// A holder whose manifest names a path outside the directory is refused
	// before anything is written.
	bad := &Manifest{Files: []File{{Path: "../escape", Size: 1, SHA256: strings.Repeat("0", 64)}}}
	srv = serve(t, dir, bad, nil)
	dst := t.TempDir()
	_, err := Pull(context.Background(), Source{Client: srv.Client(), BaseURL: srv.URL, ID: "snap-x", Token: "t0k"}, filepath.Join(dst, "in"), nil)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("manifest with ../escape: %v", err)
	}
	if ents, _ := os.ReadDir(dst); len(ents) != 0 {
		t.Fatalf("written before the manifest was checked: %v", ents)
	}
}

func TestValidate(t *testing.T) {
	sum := strings.Repeat("ab", 32)
	for _, tc := range []struct {
		files []File
		ok    bool
	}{
		{[]File{{Path: "memory/checkpoint.img", Size: 5, SHA256: sum}, {Path: "config.json", SHA256: sum}}, true},
		{[]File{{Path: "/etc/passwd", SHA256: sum}}, false},
		{[]File{{Path: "a/../../b", SHA256: sum}}, false},
		{[]File{{Path: "a//b", SHA256: sum}}, false},
		{[]File{{Path: "a/./b", SHA256: sum}}, false},
		{[]File{{Path: "a b", SHA256: sum}}, false},
		{[]File{{Path: "x.part", SHA256: sum}}, false},
		{[]File{{Path: "a", SHA256: sum}, {Path: "a", SHA256: sum}}, false},
		{[]File{{Path: "a", SHA256: sum}, {Path: "a/b", SHA256: sum}}, false},
		{[]File{{Path: "a", Size: -1, SHA256: sum}}, false},
		{[]File{{Path: "a", SHA256: "xyz"}}, false},
	} {
		err := (&Manifest{Files: tc.files}).Validate()
		if (err == nil) != tc.ok {
			t.Errorf("%+v: %v", tc.files, err)
		}
	}
}
