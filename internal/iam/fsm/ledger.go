package fsm

import (
	"encoding/json"
	"math"
	"sort"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/project"
)

// The quota ledger [ours]. Every sandbox counts against its project's
// quota through an entry in the replicated state, made before any edge is
// asked: Raft orders all reservations, so concurrent creates through any
// number of apiservers can never pass a quota together. An entry is first
// a reservation (its id "rsv-..."), then bound to the sandboxes the create
// made (one entry per sandbox id, the reservation's resources shared out),
// then released when the sandbox is removed. A reservation that is never
// bound (its apiserver died mid-create) lapses at Expires; an entry whose
// sandbox vanished without a removal through an apiserver (it expired on
// its edge, or the edge was lost) is released by the apiservers'
// reconciler. All times travel in the commands: Apply stays deterministic.

// Resources is what an entry holds.
type Resources struct {
	Sandboxes int64   `json:"sandboxes"`
	CPUCores  float64 `json:"cpu_cores"`
	MemoryMB  int64   `json:"memory_mb"`
}

// sum is a subtree's usage in integers (CPU in millicores), so that the
// order entries come and go in cannot change it in the last bits: every
// replica must admit or refuse a reservation at the limit alike.
type sum struct{ sandboxes, milliCPU, memoryMB int64 }

func milli(cores float64) int64 { return int64(math.Round(cores * 1000)) }

func (u sum) add(r Resources, sign int64) sum {
	return sum{u.sandboxes + sign*r.Sandboxes, u.milliCPU + sign*milli(r.CPUCores), u.memoryMB + sign*r.MemoryMB}
}

func (u sum) resources() Resources {
	return Resources{Sandboxes: u.sandboxes, CPUCores: float64(u.milliCPU) / 1000, MemoryMB: u.memoryMB}
}

// Entry is a ledger entry: a reservation or a sandbox.
type Entry struct {
	ID      string    `json:"id"`
	Project string    `json:"project"`
	Res     Resources `json:"res"`
	At      time.Time `json:"at"`               // reserved, or bound
	Expires time.Time `json:"expires,omitzero"` // a reservation's lapse
	// Key is the create's idempotency key, unique in its project while the
	// entry lasts: a retried create finds the sandbox the first one made.
	Key string `json:"key,omitempty"`
	// Holder is the replica (an apiserver's) that made a reservation, as
	// "ID/INCARNATION": another apiserver takes the key over when the
	// holder is gone (apiserver/quota.go).
	Holder string `json:"holder,omitempty"`
}

// Ledger commands. IgnoreUnknown: a replica from before the ledger skips them.
const (
	CmdReserve = 6 | IgnoreUnknown
	CmdBind    = 7 | IgnoreUnknown
	CmdRelease = 8 | IgnoreUnknown
	CmdAdopt   = 9 | IgnoreUnknown
)

// Adopt counts sandboxes that run without an entry: made by a create whose
// apiserver died before binding, or from before the ledger. Entries that
// exist already are left alone; no quota is checked (they run already).
type Adopt struct {
	Entries []Entry `json:"entries"`
}

// Reserve asks for Entry.Res in Entry.Project; refused with
// ResourceExhausted naming the project and the limit when it does not fit.
type Reserve struct {
	Entry Entry `json:"entry"`
}

// Bind turns reservation ID into one entry per sandbox in SandboxIDs,
// each with an equal share; a share not bound (fewer copies made than
// reserved) is given back.
type Bind struct {
	ID         string    `json:"id"`
	SandboxIDs []string  `json:"sandbox_ids"`
	At         time.Time `json:"at"`
}

// Release removes entries (reservation or sandbox ids); unknown ids are
// ignored, so a release can be repeated.
type Release struct {
	IDs []string `json:"ids"`
}

func (f *FSM) applyLedger(t CommandType, body []byte) error {
	switch t {
	case CmdReserve:
		var c Reserve
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		return f.reserve(c.Entry)
	case CmdBind:
		var c Bind
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		return f.bind(c)
	case CmdRelease:
		var c Release
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		for _, id := range c.IDs {
			f.dropEntry(id)
		}
		return nil
	case CmdAdopt:
		var c Adopt
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		for _, e := range c.Entries {
			if _, ok := f.entries[e.ID]; !ok && e.ID != "" && e.Res.Sandboxes >= 0 && e.Res.CPUCores >= 0 && e.Res.MemoryMB >= 0 {
				e.Expires, e.Key = time.Time{}, ""
				f.addEntry(e)
			}
		}
		return nil
	}
	return errdefs.InvalidArgument("iam: command %d is not a ledger command", t)
}

func (f *FSM) reserve(e Entry) error {
	if e.ID == "" || e.Res.Sandboxes < 0 || e.Res.CPUCores < 0 || e.Res.MemoryMB < 0 {
		return errdefs.InvalidArgument("reservation: want an id and resources that are not negative")
	}
	// Reservations whose apiserver never bound them lapse first: a key
	// they held is free again.
	for id, old := range f.entries {
		if !old.Expires.IsZero() && old.Expires.Before(e.At) {
			f.dropEntry(id)
		}
	}
	if _, ok := f.entries[e.ID]; ok {
		return errdefs.AlreadyExists("reservation %s: already made", e.ID)
	}
	if id, ok := f.byKey[keyOf(e.Project, e.Key)]; ok && e.Key != "" {
		return errdefs.AlreadyExists("idempotency key %q: already used in project %s (by %s)", e.Key, e.Project, id)
	}
	if _, ok := f.projects[e.Project]; !ok {
		return errdefs.NotFound("project %q: no such project", e.Project)
	}
	for _, p := range project.Ancestry(e.Project) {
		pr, ok := f.projects[p]
		if !ok {
			continue
		}
		q, used := pr.Quota, f.usage[p]
		switch {
		case q.MaxSandboxes > 0 && used.sandboxes+e.Res.Sandboxes > q.MaxSandboxes:
			return errdefs.ResourceExhausted("quota of project %s: %d of %d sandboxes in use, %d asked", p, used.sandboxes, q.MaxSandboxes, e.Res.Sandboxes)
		case q.CPUCores > 0 && used.milliCPU+milli(e.Res.CPUCores) > milli(q.CPUCores):
			return errdefs.ResourceExhausted("quota of project %s: %g of %g cpu cores in use, %g asked", p, used.resources().CPUCores, q.CPUCores, e.Res.CPUCores)
		case q.MemoryMB > 0 && used.memoryMB+e.Res.MemoryMB > q.MemoryMB:
			return errdefs.ResourceExhausted("quota of project %s: %d of %d MiB in use, %d asked", p, used.memoryMB, q.MemoryMB, e.Res.MemoryMB)
		}
	}
	f.addEntry(e)
	return nil
}

func (f *FSM) bind(c Bind) error {
	r, ok := f.entries[c.ID]
	if !ok {
		return errdefs.NotFound("reservation %s: none (it lapsed or was released)", c.ID)
	}
	f.dropEntry(c.ID)
	n := int64(len(c.SandboxIDs))
	if n == 0 {
		return nil
	}
	per := Resources{Sandboxes: 1, CPUCores: r.Res.CPUCores / float64(max(r.Res.Sandboxes, 1)), MemoryMB: r.Res.MemoryMB / max(r.Res.Sandboxes, 1)}
	key := ""
	if n == 1 {
		key = r.Key // a create's; a fork's copies have none
	}
	for _, id := range c.SandboxIDs {
		if _, dup := f.entries[id]; !dup && id != "" {
			f.addEntry(Entry{ID: id, Project: r.Project, Res: per, At: c.At, Key: key})
		}
	}
	return nil
}

// keyOf indexes an idempotency key within its project.
func keyOf(project, key string) string { return project + "\x00" + key }

func (f *FSM) addEntry(e Entry) {
	f.entries[e.ID] = &e
	if e.Key != "" {
		f.byKey[keyOf(e.Project, e.Key)] = e.ID
	}
	for _, p := range project.Ancestry(e.Project) {
		f.usage[p] = f.usage[p].add(e.Res, 1)
	}
}

func (f *FSM) dropEntry(id string) {
	e, ok := f.entries[id]
	if !ok {
		return
	}
	delete(f.entries, id)
	if k := keyOf(e.Project, e.Key); e.Key != "" && f.byKey[k] == id {
		delete(f.byKey, k)
	}
	for _, p := range project.Ancestry(e.Project) {
		u := f.usage[p].add(e.Res, -1)
		if u == (sum{}) {
			delete(f.usage, p)
			continue
		}
		f.usage[p] = u
	}
}

// Usage is what the ledger counts in path's subtree.
func (f *FSM) Usage(path string) Resources {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.usage[path].resources()
}

// EntryByKey finds the entry a create with idempotency key made in
// project: a reservation while the create runs, then its sandbox. A
// reservation past its lapse at now counts as none.
func (f *FSM) EntryByKey(project, key string, now time.Time) (Entry, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if id, ok := f.byKey[keyOf(project, key)]; ok && key != "" {
		e := f.entries[id]
		if e.Expires.IsZero() || !e.Expires.Before(now) {
			return *e, true
		}
	}
	return Entry{}, false
}

// Entries returns the ledger, reservations and sandboxes, by id.
func (f *FSM) Entries() []Entry {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]Entry, 0, len(f.entries))
	for _, e := range f.entries {
		out = append(out, *e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}
