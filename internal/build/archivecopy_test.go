package build

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/opendsec/opendsec/internal/testutil"
)

// tarOf writes a tar of entries (name → content; "->target" makes a
// symlink, a name ending in "/" a directory), gzipped if asked.
func tarOf(t *testing.T, gz bool, entries ...[2]string) string {
	t.Helper()
	var buf bytes.Buffer
	var w io.Writer = &buf
	var z *gzip.Writer
	if gz {
		z = gzip.NewWriter(&buf)
		w = z
	}
	tw := tar.NewWriter(w)
	for _, e := range entries {
		h := &tar.Header{Name: e[0], Mode: 0o644, Size: int64(len(e[1])), Typeflag: tar.TypeReg, Uid: 4242, Gid: 4242}
		switch {
		case strings.HasSuffix(e[0], "/"):
			h.Typeflag, h.Mode, h.Size = tar.TypeDir, 0o755, 0
		case strings.HasPrefix(e[1], "->"):
			h.Typeflag, h.Linkname, h.Size = tar.TypeSymlink, e[1][2:], 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write([]byte(e[1]))
		}
	}
	tw.Close()
	if z != nil {
		z.Close()
	}
	p := filepath.Join(t.TempDir(), "files.tar")
	os.WriteFile(p, buf.Bytes(), 0o600)
	return p
}

func statUID(t *testing.T, p string) uint32 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Uid
}

// hostBox runs a step's commands on this host (the copy script with the
// host's sh and tar) and keeps written files under its own names.
type hostBox struct {
	fakeBox
	dir string
}

func (b *hostBox) Run(ctx context.Context, args, env []string, cwd, _ string, out io.Writer) (int, error) {
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	cmd.Env, cmd.Dir, cmd.Stdout, cmd.Stderr = append(os.Environ(), env...), cwd, out, out
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), nil
	}
	return 0, err
}

func (b *hostBox) WriteFile(_ context.Context, p string, r io.Reader, perm uint32, _ string) error {
	data, _ := io.ReadAll(r)
	return os.WriteFile(p, data, os.FileMode(perm))
}

// TestCopyFromAnArchiveKeepsLinksAndMergesDirectories runs the copy script
// with this host's sh and tar: a directory's content merges into an
// existing one, symlinks (dangling, absolute, relative) stay links, a file
// goes into a directory named with "/", the owner and mode are set, and
// a source the archive lacks is named in the error.
func TestCopyFromAnArchiveKeepsLinksAndMergesDirectories(t *testing.T) {
	testutil.RequireRoot(t) // the script chowns to root
	testutil.RequireBinary(t, "tar")
	dest := t.TempDir()
	os.MkdirAll(filepath.Join(dest, "app", "keep"), 0o700)
	os.WriteFile(filepath.Join(dest, "app", "old.txt"), []byte("old"), 0o644)
	os.WriteFile(filepath.Join(dest, "app", "test.txt"), []byte("to be overwritten"), 0o644)
	archive := tarOf(t, true,
		[2]string{"folder/test.txt", "hello"},
		[2]string{"folder/sub/", ""},
		[2]string{"folder/sub/deep.txt", "deep"},
		[2]string{"folder/symlink.txt", "->test.txt"},
		[2]string{"folder/dangling", "->nowhere"},
		[2]string{"folder/absolute", "->/etc/hostname"},
		[2]string{"single.txt", "one"},
	)
	st := &state{cfg: nil}
	st.cfg = newFake().images["root/base:1"].im.Config
	box := &hostBox{dir: dest}
	var log bytes.Buffer
	run := func(src, to, mode string) error {
		in := Instruction{Line: 1, Cmd: "COPY", Archive: archive, JSON: []string{src, to}, Flags: map[string]string{"chmod": mode}}
		return st.copyArchive(context.Background(), box, in, &log)
	}
	if err := run("folder", filepath.Join(dest, "app"), ""); err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	for name, want := range map[string]string{"test.txt": "hello", "old.txt": "old", "sub/deep.txt": "deep", "symlink.txt": "hello"} {
		if got, err := os.ReadFile(filepath.Join(dest, "app", name)); err != nil || string(got) != want {
			t.Errorf("app/%s = %q, %v; want %q", name, got, err, want)
		}
	}
	for name, want := range map[string]string{"symlink.txt": "test.txt", "dangling": "nowhere", "absolute": "/etc/hostname"} {
		if got, err := os.Readlink(filepath.Join(dest, "app", name)); err != nil || got != want {
			t.Errorf("app/%s links to %q, %v; want %q", name, got, err, want)
		}
	}
	if fi, err := os.Stat(filepath.Join(dest, "app", "keep")); err != nil || !fi.IsDir() {
		t.Errorf("a directory that was there is gone: %v", err)
	}
	if uid := statUID(t, filepath.Join(dest, "app", "test.txt")); uid != 0 {
		t.Errorf("owner uid %d; want root's (the current user), not the archive's 4242", uid)
	}

	if err := run("single.txt", filepath.Join(dest, "new", "dir")+"/", "0751"); err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	fi, err := os.Stat(filepath.Join(dest, "new", "dir", "single.txt"))
	if err != nil || fi.Mode().Perm() != 0o751 {
		t.Fatalf("single.txt into new/dir/: %v %v", fi, err)
	}
	if err := run("single.txt", filepath.Join(dest, "renamed.txt"), ""); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(dest, "renamed.txt")); string(got) != "one" {
		t.Fatalf("renamed.txt = %q", got)
	}

	err = run("missing", dest, "")
	if err == nil || !strings.Contains(err.Error(), "missing: not in the uploaded files") {
		t.Fatalf("a source the archive lacks: %v", err)
	}
	for _, bad := range [][2]string{{"../x", dest}, {"/etc", dest}} {
		if err := run(bad[0], bad[1], ""); err == nil || !strings.Contains(err.Error(), "relative path inside the uploaded files") {
			t.Errorf("source %q: %v", bad[0], err)
		}
	}
	if err := run("single.txt", dest, "u+x"); err == nil || !strings.Contains(err.Error(), "octal") {
		t.Errorf("a symbolic mode: %v", err)
	}
	leftovers, _ := filepath.Glob("/tmp/.dsec-copy*")
	if len(leftovers) != 0 {
		t.Errorf("left in /tmp: %v", leftovers)
	}
}

// TestBuildCachesArchiveCopiesByContentAndRunsAsTheStepsUser: a COPY from
// an archive is cached by the archive's bytes; a RUN's own user is used
// for it alone and is part of its cache key.
func TestBuildCachesArchiveCopiesByContentAndRunsAsTheStepsUser(t *testing.T) {
	ft := newFake()
	a1 := tarOf(t, false, [2]string{"a.txt", "1"})
	ins := func(archive string) []Instruction {
		return []Instruction{
			{Line: 0, Cmd: "FROM", Text: "root/base:1"},
			{Line: 1, Cmd: "USER", Text: "user"},
			{Line: 2, Cmd: "COPY", Archive: archive, JSON: []string{"a.txt", "a.txt"}},
			{Line: 3, Cmd: "RUN", JSON: []string{"sh", "-c", "write /x y"}, User: "root"},
			{Line: 4, Cmd: "RUN", JSON: []string{"sh", "-c", "write /z y"}},
		}
	}
	o := Options{Tag: "root/t:1", CacheProject: "root"}
	if _, err := Build(context.Background(), ft, ins(a1), o); err != nil {
		t.Fatal(err)
	}
	var users []string
	for _, r := range ft.runs {
		f := strings.Split(r, "|")
		users = append(users, f[0][:min(5, len(f[0]))]+"@"+f[len(f)-1])
	}
	// The fake runs the copy script too (as root), then the two RUNs.
	if got := strings.Join(users, " "); !strings.HasSuffix(got, "write@root write@user") || !strings.HasPrefix(got, "set -@root") {
		t.Fatalf("runs as: %s", got)
	}
	runs := len(ft.runs)
	res, err := Build(context.Background(), ft, ins(a1), o)
	if err != nil || res.Cached != 3 || len(ft.runs) != runs {
		t.Fatalf("rebuild: %+v %v", res, err)
	}
	a2 := tarOf(t, false, [2]string{"a.txt", "2"})
	if res, err = Build(context.Background(), ft, ins(a2), o); err != nil || res.Cached != 0 {
		t.Fatalf("other content: %+v %v", res, err)
	}
	bad := ins(a1)
	bad[3].JSON = []string{"sh", "-c", "fail"}
	bad[3].Line = 7
	_, err = Build(context.Background(), ft, bad, o)
	se, ok := err.(*StepError)
	if !ok || se.Step != 3 {
		t.Fatalf("a failing step: %T %v; want a StepError of step 3", err, err)
	}
}
