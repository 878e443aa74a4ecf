package apiserver

import (
	"testing"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	"github.com/opendsec/opendsec/internal/edgeclient/edgefake"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/watcher"
)

// A project's CPU-seconds and GB-seconds are what its subtree used on
// every node the watcher sees: a child's count in its parent's, a
// sibling's not.
func TestProjectsSayWhatTheirSubtreeUsed(t *testing.T) {
	a, b := edgefake.New("a:1", usage(4)), edgefake.New("b:1", usage(4))
	f := newFixture(t, a, b)
	ctx := ctxFor(t)
	for _, name := range []string{"team", "other"} {
		if _, err := f.iam.CreateProject(ctx, "root", name, fsm.Quota{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.iam.CreateProject(ctx, "root/team", "sub", fsm.Quota{}); err != nil {
		t.Fatal(err)
	}
	na, nb := a.NodeView(true), b.NodeView(true)
	na.Status.Groups = []*edgev1.GroupUsage{{Project: "root/team", Backend: "fake", CpuSeconds: 10, MemoryGbSeconds: 100},
		{Project: "root/team/sub", Task: "t", Backend: "fake", CpuSeconds: 1, MemoryGbSeconds: 2}}
	nb.Status.Groups = []*edgev1.GroupUsage{{Project: "root/team", Backend: "fake", CpuSeconds: 5, MemoryGbSeconds: 50},
		{Project: "root/other", Backend: "fake", CpuSeconds: 7, MemoryGbSeconds: 7}}
	f.view.v.Store(watcher.NewView([]*watcher.NodeView{na, nb}))
	resp, err := (&iamService{f.s}).ListProjects(asRoot(ctx), connect.NewRequest(&iamv1.ListProjectsRequest{Path: "root"}))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][2]float64{"root": {23, 159}, "root/team": {16, 152}, "root/team/sub": {1, 2}, "root/other": {7, 7}}
	for _, p := range resp.Msg.Projects {
		got := [2]float64{p.Usage.GetCpuSeconds(), p.Usage.GetMemoryGbSeconds()}
		if got != want[p.Path] {
			t.Errorf("%s used %v CPU-s and GB-s, want %v", p.Path, got, want[p.Path])
		}
		delete(want, p.Path)
	}
	if len(want) > 0 {
		t.Fatalf("projects not listed: %v", want)
	}
	one, err := (&iamService{f.s}).GetProject(asRoot(ctx), connect.NewRequest(&iamv1.GetProjectRequest{Path: "root/team"}))
	if err != nil || one.Msg.Project.Usage.GetCpuSeconds() != 16 {
		t.Fatalf("GetProject root/team: %v, %v; want 16 CPU-s", one, err)
	}
}
