package aether

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/sysuser"
	"github.com/opendsec/opendsec/internal/testutil"
)

// A write as nobody, through whatever links nobody planted in its own
// directory (chains of them, to root's files and directories, relative
// and absolute, by any name and write mode), never changes or creates a
// file that nobody could not write itself.
func FuzzWriteAsUserThroughLinks(f *testing.F) {
	testutil.RequireRoot(f)
	f.Add("evil", "../secret", uint8(0), uint8(0))
	f.Add("chain", "secret", uint8(2), uint8(1))
	f.Add("d/x", "../rootdir", uint8(1), uint8(3))
	f.Add("new", "rootdir/new", uint8(0), uint8(2))
	f.Fuzz(func(t *testing.T, name, target string, depth, mode uint8) {
		if strings.ContainsRune(name+target, 0) || len(name) > 200 || len(target) > 200 {
			return
		}
		base := t.TempDir()
		for d := base; d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
			os.Chmod(d, 0o755) //nolint:errcheck // nobody must reach the tree
		}
		secret := filepath.Join(base, "secret")
		os.WriteFile(secret, []byte("root's"), 0o644)
		os.Mkdir(filepath.Join(base, "rootdir"), 0o755)
		nb := filepath.Join(base, "nb")
		os.Mkdir(nb, 0o755)
		os.Chown(nb, 65534, 65534)
		// The link chain: l0 → target (relative to nb, or absolute within
		// base), l1 → l0, ...; name is a link to the chain's end.
		t0 := target
		if strings.HasPrefix(target, "/") {
			t0 = filepath.Join(base, target)
		} else {
			t0 = filepath.Join("..", target)
		}
		prev := t0
		for i := 0; i <= int(depth%4); i++ {
			l := filepath.Join(nb, "l"+strconv.Itoa(i))
			os.Symlink(prev, l)
			prev = l
		}
		p := filepath.Join(nb, name)
		if filepath.Dir(p) != nb {
			os.MkdirAll(filepath.Dir(p), 0o755)
			os.Chown(filepath.Dir(p), 65534, 65534)
		}
		os.Symlink(prev, p)
		s := &fileService{users: sysuser.NewDB("/"), watches: &watchSet{}}
		modes := []agentv1.WriteMode{agentv1.WriteMode_WRITE_MODE_UNSPECIFIED, agentv1.WriteMode_WRITE_MODE_APPEND, agentv1.WriteMode_WRITE_MODE_AT_OFFSET, agentv1.WriteMode_WRITE_MODE_REPLACE}
		s.WriteFile(context.Background(), connect.NewRequest(&agentv1.WriteFileRequest{ //nolint:errcheck // refused or not, only its effect matters
			Path: p, Data: []byte("pwned"), User: "nobody", Mode: modes[mode%4],
		}))
		if got, _ := os.ReadFile(secret); string(got) != "root's" {
			t.Fatalf("root's file now reads %q (write as nobody to %q, links to %q)", got, p, target)
		}
		for _, dir := range []string{base, filepath.Join(base, "rootdir")} {
			ents, _ := os.ReadDir(dir)
			for _, e := range ents {
				if n := e.Name(); n != "secret" && n != "rootdir" && n != "nb" {
					t.Fatalf("a write as nobody created %s in root's %s", n, dir)
				}
			}
		}
	})
}
