package aether

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/headers"
)

// TestLimitEventsCount: the memory watch's kills and the guest cgroup's
// own counts add up, the cgroup is read at most once per ttl, and every
// answer carries the counts.
func TestLimitEventsCount(t *testing.T) {
	var nilEvents *LimitEvents
	nilEvents.memoryKill()
	if oom, forks := nilEvents.Counts(); oom != 0 || forks != 0 {
		t.Fatalf("nil counts %d %d", oom, forks)
	}
	reads := 0
	files := map[string]map[string]uint64{"memory.events": {"oom": 2, "oom_kill": 2}, "pids.events": {"max": 7}}
	ev := &LimitEvents{ttl: time.Hour}
	read := func(name string) (map[string]uint64, error) {
		reads++
		if m, ok := files[name]; ok {
			return m, nil
		}
		return nil, errors.New("no such file")
	}
	ev.memoryKill()
	if oom, forks := ev.Counts(); oom != 1 || forks != 0 {
		t.Fatalf("without a cgroup: %d %d", oom, forks)
	}
	ev.readCgroup = read
	if oom, forks := ev.Counts(); oom != 3 || forks != 7 {
		t.Fatalf("with the guest's cgroup: %d %d", oom, forks)
	}
	files["memory.events"]["oom_kill"] = 5
	ev.Counts()
	if reads != 2 {
		t.Fatalf("the cgroup was read %d times within its ttl, want once (2 files)", reads)
	}
	ev.ttl = 0
	if oom, _ := ev.Counts(); oom != 6 {
		t.Fatalf("after the ttl: %d", oom)
	}
	h := reportLimits(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) }), ev)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("POST", "/x", nil))
	if got := rec.Header().Get(headers.LimitEvents); got != "oom_kills=6 forks_refused=7" {
		t.Fatalf("header %q", got)
	}
}

// TestLimitEventsReadTheCgroupDirectory: the counts come from the files
// of the directory the agent holds open (a guest's spawn cgroup).
func TestLimitEventsReadTheCgroupDirectory(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "memory.events"), []byte("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "pids.events"), []byte("max 12\n"), 0o644)
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if oom, forks := NewLimitEvents(f).Counts(); oom != 1 || forks != 12 {
		t.Fatalf("counts %d %d, want 1 12", oom, forks)
	}
	if oom, forks := NewLimitEvents(nil).Counts(); oom != 0 || forks != 0 {
		t.Fatalf("without a cgroup: %d %d", oom, forks)
	}
}
