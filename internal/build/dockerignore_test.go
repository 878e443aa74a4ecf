package build

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Docker's .dockerignore rules, from its documentation's examples.
func TestDockerignoreMatchesAsDocker(t *testing.T) {
	ig, err := ParseIgnore(strings.NewReader(`# comment
*/temp*
*/*/temp*
temp?
/node_modules
**/*.pyc
*.md
!README.md
.git
build/**
!build/keep.txt
[a-c]x
`))
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]bool{
		"somedir/temporary.txt": true, "somedir/subdir/temporary.txt": true, "temp": false, "tempa": true,
		"node_modules/x/y.js": true, "src/node_modules": false, "a/b/c.pyc": true, "c.pyc": true,
		"notes.md": true, "README.md": false, "docs/x.md": false, ".git/HEAD": true, "build/out.o": true,
		"build/keep.txt": false, "bx": true, "dx": false, "main.go": false, "somedir/other.txt": false,
	} {
		if got := ig.Excluded(p); got != want {
			t.Errorf("Excluded(%q) = %v, want %v", p, got, want)
		}
	}
	if _, err := ParseIgnore(strings.NewReader("ok\n[abc\n")); err == nil || !strings.Contains(err.Error(), ".dockerignore:2") {
		t.Fatalf("an unclosed class: %v", err)
	}
	var none *Ignore
	if none.Excluded("x") {
		t.Fatal("no .dockerignore left something out")
	}
}

// A build leaves out what the context's .dockerignore names: such files
// are not copied, do not change the cache key, and a COPY of only them
// fails saying why.
func TestBuildHonoursDockerignore(t *testing.T) {
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "app", "node_modules", "dep"), 0o755)
	os.WriteFile(filepath.Join(dir, "app", "main.js"), []byte("main"), 0o644)
	os.WriteFile(filepath.Join(dir, "app", "node_modules", "dep", "index.js"), []byte("dep"), 0o644)
	os.WriteFile(filepath.Join(dir, "app", "debug.log"), []byte("log"), 0o644)
	os.WriteFile(filepath.Join(dir, ".dockerignore"), []byte("**/node_modules\n*.log\napp/*.log\n"), 0o644)
	ft := newFake()
	o := Options{Context: dir, Tag: "root/app:1", CacheProject: "root"}
	if _, err := Build(context.Background(), ft, mustParse(t, "FROM root/base:1\nCOPY app /app\n"), o); err != nil {
		t.Fatal(err)
	}
	files := ft.images["root/app:1"].files
	if files["/app/main.js"] == "" || files["/app/node_modules/dep/index.js"] != "" || files["/app/debug.log"] != "" {
		t.Fatalf("copied: %v", files)
	}
	os.WriteFile(filepath.Join(dir, "app", "node_modules", "dep", "index.js"), []byte("changed"), 0o644)
	if res, err := Build(context.Background(), ft, mustParse(t, "FROM root/base:1\nCOPY app /app\n"), o); err != nil || res.Cached != 1 {
		t.Fatalf("an ignored file's change ran the COPY again: %+v %v", res, err)
	}
	_, err := Build(context.Background(), ft, mustParse(t, "FROM root/base:1\nCOPY app/debug.log /x\n"), o)
	if err == nil || !strings.Contains(err.Error(), ".dockerignore") {
		t.Fatalf("a COPY of an ignored file: %v", err)
	}
}

func FuzzParseIgnore(f *testing.F) {
	f.Add("*/temp*\n!README.md\n**/*.pyc\n[a-c]x\n\\*\n", "a/temp1")
	f.Add("/a/../b\n!\n**\n", "b/c")
	f.Fuzz(func(t *testing.T, text, p string) {
		ig, err := ParseIgnore(strings.NewReader(text))
		if err != nil {
			if !strings.Contains(err.Error(), ".dockerignore") || errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
				t.Fatalf("refusal: %v", err)
			}
			return
		}
		ig.Excluded(p) // never panics
	})
}
