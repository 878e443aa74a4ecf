package aether

import (
	"errors"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/filemeta"
)

// A write's metadata is stored with the file and shows in its stat, in a
// listing and after a move; an overwrite that replaces it with none
// clears it; an append leaves it; bad metadata is refused before anything
// is written; metadata set inside the sandbox shows too.
func TestFileMetadata(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	dir, err := os.MkdirTemp("", "meta")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o777)
	if err := unix.Setxattr(dir, "user.probe", []byte("x"), 0); err != nil {
		t.Skipf("%s keeps no user attributes: %v", dir, err)
	}
	md := map[string]string{"author": "mish", "purpose": "upload"}
	p := filepath.Join(dir, "f.txt")
	w, err := c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: p, Data: []byte("x"), Metadata: md, ReplaceMetadata: true}))
	if err != nil || !maps.Equal(w.Msg.Entry.Metadata, md) {
		t.Fatalf("write with metadata: %v %v", w, err)
	}
	if _, err := c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: p, Data: []byte("y"), Mode: agentv1.WriteMode_WRITE_MODE_APPEND})); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "g.txt")
	mv, err := c.fs.Move(ctx, connect.NewRequest(&agentv1.MoveRequest{Source: p, Destination: dst}))
	if err != nil || !maps.Equal(mv.Msg.Entry.Metadata, md) {
		t.Fatalf("after an append and a move: %v %v, want %v", mv, err, md)
	}
	ls, err := c.fs.ListDir(ctx, connect.NewRequest(&agentv1.ListDirRequest{Path: dir}))
	if err != nil || len(ls.Msg.Entries) != 1 || !maps.Equal(ls.Msg.Entries[0].Metadata, md) {
		t.Fatalf("listing: %v %v", ls, err)
	}
	for _, mode := range []agentv1.WriteMode{agentv1.WriteMode_WRITE_MODE_UNSPECIFIED, agentv1.WriteMode_WRITE_MODE_REPLACE} {
		if _, err := c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: dst, Data: []byte("z"), Mode: mode, Metadata: md, ReplaceMetadata: true})); err != nil {
			t.Fatal(err)
		}
		w, err = c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: dst, Data: []byte("z"), Mode: mode, ReplaceMetadata: true}))
		if err != nil || w.Msg.Entry.Metadata != nil {
			t.Fatalf("an overwrite (mode %v) replacing it with none: %v %v", mode, w, err)
		}
	}
	// Set from inside, as setfattr would.
	if err := unix.Setxattr(dst, filemeta.Prefix+"author", []byte("mish"), 0); err != nil {
		t.Fatal(err)
	}
	st, err := c.fs.Stat(ctx, connect.NewRequest(&agentv1.StatRequest{Path: dst}))
	if err != nil || !maps.Equal(st.Msg.Entry.Metadata, map[string]string{"author": "mish"}) {
		t.Fatalf("metadata set inside: %v %v", st, err)
	}
	bad := filepath.Join(dir, "bad.txt")
	for _, m := range []*agentv1.WriteFileRequest{
		{Path: bad, Data: []byte("x"), Metadata: map[string]string{"good": "bad\nvalue"}, ReplaceMetadata: true},
		{Path: bad, Data: []byte("x"), Metadata: map[string]string{"": "v"}, ReplaceMetadata: true},
		{Path: bad, Data: []byte("x"), Metadata: map[string]string{"k": "v"}},
	} {
		if _, err := c.fs.WriteFile(ctx, connect.NewRequest(m)); !errors.Is(errdefs.FromConnect(err), errdefs.ErrInvalidArgument) {
			t.Fatalf("metadata %q (replace %v): %v, want invalid argument", m.Metadata, m.ReplaceMetadata, err)
		}
		if _, err := os.Stat(bad); !os.IsNotExist(err) {
			t.Fatalf("a refused write left %s: %v", bad, err)
		}
	}
	// A user's write sets it with the user's rights.
	mine := filepath.Join(dir, "nobody.txt")
	w, err = c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: mine, Data: []byte("x"), User: "nobody", Metadata: md, ReplaceMetadata: true}))
	if err != nil || !maps.Equal(w.Msg.Entry.Metadata, md) || w.Msg.Entry.Owner != "nobody" {
		t.Fatalf("nobody's write with metadata: %v %v", w, err)
	}
}
