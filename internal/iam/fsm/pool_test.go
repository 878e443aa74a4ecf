package fsm

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

func TestPoolsAreSetReplacedRemovedAndForgottenLater(t *testing.T) {
	f := New()
	at := time.Unix(1_000_000, 0)
	spec := json.RawMessage(`{"image":"root/py:3.11","backend":"container"}`)
	set := func(key string, size int32, at time.Time) error {
		return apply(t, f, CmdSetPool, SetPool{Pool: PoolSetting{Key: key, Project: "root", Spec: spec, Size: size, At: at}})
	}
	if err := set("a", 2, at); err != nil {
		t.Fatal(err)
	}
	if err := set("b", 1, at); err != nil {
		t.Fatal(err)
	}
	if err := set("a", 5, at.Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	got := f.Pools()
	if len(got) != 2 || got[0].Key != "a" || got[0].Size != 5 || got[1].Key != "b" || string(got[0].Spec) != string(spec) {
		t.Fatalf("after setting a twice and b: %+v", got)
	}
	// A removal is kept, with the spec that names the pool to a node, for
	// nodes that missed it.
	if err := set("a", 0, at.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if got := f.Pools(); len(got) != 2 || got[0].Size != 0 || string(got[0].Spec) != string(spec) {
		t.Fatalf("after removing a: %+v", got)
	}
	// Until a later command comes more than tombstoneKept after it.
	if err := set("b", 3, at.Add(time.Hour+tombstoneKept-time.Second)); err != nil {
		t.Fatal(err)
	}
	if got := f.Pools(); len(got) != 2 {
		t.Fatalf("a removal went before its time: %+v", got)
	}
	if err := set("b", 4, at.Add(time.Hour+tombstoneKept+time.Second)); err != nil {
		t.Fatal(err)
	}
	if got := f.Pools(); len(got) != 1 || got[0].Key != "b" || got[0].Size != 4 {
		t.Fatalf("the old removal is still kept: %+v", got)
	}
}

func TestBadPoolSettingsAreRefusedAndChangeNothing(t *testing.T) {
	f := New()
	long := string(bytes.Repeat([]byte("k"), MaxPoolKey+1))
	for _, p := range []PoolSetting{
		{Key: "", Size: 1, Spec: json.RawMessage(`{}`)},
		{Key: long, Size: 1, Spec: json.RawMessage(`{}`)},
		{Key: "k", Size: -1, Spec: json.RawMessage(`{}`)},
		{Key: "k", Size: 0},
		{Key: "k", Size: 1, Spec: json.RawMessage(`{not json`)},
	} {
		if err := f.setPool(SetPool{Pool: p}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Fatalf("%+v: %v, want invalid argument", p, err)
		}
	}
	if len(f.Pools()) != 0 {
		t.Fatalf("a refused setting was kept: %+v", f.Pools())
	}
	if err := Check([]byte{byte(CmdSetPool), '{'}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Check of a cut body: %v", err)
	}
}

func TestPoolsSurviveASnapshot(t *testing.T) {
	f := New()
	at := time.Unix(1_000_000, 0).UTC()
	for _, p := range []PoolSetting{
		{Key: "a", Project: "root", Spec: json.RawMessage(`{"image":"root/a:1"}`), Size: 2, At: at},
		{Key: "b", Project: "root/team", Spec: json.RawMessage(`{"image":"root/team/b:1"}`), Size: 0, At: at},
	} {
		if err := apply(t, f, CmdSetPool, SetPool{Pool: p}); err != nil {
			t.Fatal(err)
		}
	}
	snap, _ := f.Snapshot()
	var buf bytes.Buffer
	if err := snap.Persist(&sink{Buffer: &buf}); err != nil {
		t.Fatal(err)
	}
	g := New()
	if err := g.Restore(io.NopCloser(&buf)); err != nil {
		t.Fatal(err)
	}
	want, _ := json.Marshal(f.Pools())
	got, _ := json.Marshal(g.Pools())
	if !bytes.Equal(want, got) {
		t.Fatalf("restored pools %s, want %s", got, want)
	}
	// A snapshot from before pools restores with none.
	h := New()
	if err := h.Restore(io.NopCloser(bytes.NewBufferString(`{"projects":[],"keys":[]}`))); err != nil || len(h.Pools()) != 0 {
		t.Fatalf("an old snapshot: %v, %+v", err, h.Pools())
	}
}
