package sandboxid

import (
	"errors"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

func TestNewParseRoundTrip(t *testing.T) {
	t.Parallel()
	node := NewNodeID()
	if _, err := ValidateNode(string(node)); err != nil {
		t.Fatalf("fresh node id %q rejected: %v", node, err)
	}
	id := New(node)
	got, gotNode, err := Parse(string(id))
	if err != nil || got != id || gotNode != node || id.Node() != node {
		t.Fatalf("Parse(%q) = %q, %q, %v; want node %q", id, got, gotNode, err, node)
	}
	snap := NewSnapshot(node)
	sid, snode, err := ParseSnapshot(string(snap))
	if err != nil || sid != snap || snode != node {
		t.Fatalf("ParseSnapshot(%q) = %q, %q, %v", snap, sid, snode, err)
	}
	if New(node) == id {
		t.Fatal("two fresh ids are equal")
	}
}

func TestParseRejects(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"", "abc", "ABCDEFGH-abcdefghijklmnop", "abcdefgh_abcdefghijklmnop",
		"abcdefgh-abcdefghijklmno1", "abcdefgh-abcdefghijklmnopq", "../../../etc/passwd"} {
		if _, _, err := Parse(s); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Parse(%q) err = %v, want invalid argument", s, err)
		}
	}
	if _, _, err := ParseSnapshot("abcdefgh-abcdefghijklmnop"); err == nil {
		t.Error("ParseSnapshot accepted a sandbox id")
	}
}

func FuzzParse(f *testing.F) {
	f.Add("abcdefgh-abcdefghijklmnop")
	f.Add("snap-abcdefgh-abcdefghijklmnop")
	f.Fuzz(func(t *testing.T, s string) {
		if id, node, err := Parse(s); err == nil {
			if string(id) != s || id.Node() != node || len(s) != idLen {
				t.Fatalf("Parse(%q) accepted inconsistent id", s)
			}
		}
		if id, _, err := ParseSnapshot(s); err == nil && string(id) != s {
			t.Fatalf("ParseSnapshot(%q) changed the id", s)
		}
	})
}
