// Package fsm is IAM's replicated state machine: projects nested to any
// depth with quotas delegated from parent to child, and API keys [paper:
// nesting, delegation; ours: Raft]. Commands are a type byte and a JSON body;
// a type with the IgnoreUnknown bit set may be skipped by an older replica,
// so new commands can roll out before every replica knows them (nomad's
// scheme). Apply is deterministic: timestamps travel in the command.
package fsm

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/project"
)

// Role of an API key.
type Role int

// Roles; the values match opendsec.iam.v1.Role.
const (
	RoleMember Role = 1
	RoleAdmin  Role = 2
)

// Quota limits a project subtree; zero fields have no limit of their own.
type Quota struct {
	MaxSandboxes int64   `json:"max_sandboxes,omitempty"`
	CPUCores     float64 `json:"cpu_cores,omitempty"`
	MemoryMB     int64   `json:"memory_mb,omitempty"`
	// NoInternet forbids the internet shorthand of network policies in
	// the subtree.
	NoInternet bool `json:"no_internet,omitempty"`
	// StorageMB bounds the subtree's images and snapshots (apiserver).
	StorageMB int64 `json:"storage_mb,omitempty"`
}

// Project is a node of the project tree, named by its full path.
type Project struct {
	Path      string    `json:"path"`
	Quota     Quota     `json:"quota"`
	CreatedAt time.Time `json:"created_at"`
}

// Key is an API key; only the SHA-256 of its secret is kept.
type Key struct {
	ID        string    `json:"id"`
	Project   string    `json:"project"`
	Name      string    `json:"name"`
	Role      Role      `json:"role"`
	Hash      string    `json:"hash"`
	CreatedAt time.Time `json:"created_at"`
}

// CommandType is the first byte of a log entry.
type CommandType byte

// IgnoreUnknown marks a command an older replica may skip.
const IgnoreUnknown CommandType = 0x80

// Commands. Append only: never renumber.
const (
	CmdCreateProject CommandType = 1
	CmdSetQuota      CommandType = 2
	CmdDeleteProject CommandType = 3
	CmdCreateKey     CommandType = 4
	CmdRevokeKey     CommandType = 5
)

// CreateProject creates Parent/Name.
type CreateProject struct {
	Parent string    `json:"parent"` // "" only for the root project
	Name   string    `json:"name"`
	Quota  Quota     `json:"quota"`
	At     time.Time `json:"at"`
}

// SetQuota replaces a project's quota.
type SetQuota struct {
	Path  string `json:"path"`
	Quota Quota  `json:"quota"`
}

// DeleteProject removes a leaf project without keys.
type DeleteProject struct {
	Path string `json:"path"`
}

// CreateKey adds a key.
type CreateKey struct {
	Key Key `json:"key"`
}

// RevokeKey removes a key.
type RevokeKey struct {
	ID string `json:"id"`
}

// Encode makes a log entry.
func Encode(t CommandType, body any) ([]byte, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	return append([]byte{byte(t)}, data...), nil
}

// Check reports whether data is a command this FSM can apply: a known
// type (or one an older replica may skip) with a body of its shape. The
// leader checks a command before it enters the log, since Apply must not
// fail on a committed entry in a way that differs between replicas, and
// panics on an unknown type.
func Check(data []byte) error {
	if len(data) == 0 {
		return errdefs.InvalidArgument("iam: empty command")
	}
	t, body := CommandType(data[0]), data[1:]
	var v any
	switch t &^ IgnoreUnknown {
	case CmdCreateProject:
		v = &CreateProject{}
	case CmdSetQuota:
		v = &SetQuota{}
	case CmdDeleteProject:
		v = &DeleteProject{}
	case CmdCreateKey:
		v = &CreateKey{}
	case CmdRevokeKey:
		v = &RevokeKey{}
	case CmdReserve &^ IgnoreUnknown:
		v = &Reserve{}
	case CmdBind &^ IgnoreUnknown:
		v = &Bind{}
	case CmdRelease &^ IgnoreUnknown:
		v = &Release{}
	case CmdAdopt &^ IgnoreUnknown:
		v = &Adopt{}
	case CmdSetPool &^ IgnoreUnknown:
		v = &SetPool{}
	default:
		return errdefs.InvalidArgument("iam: unknown command type %d", t)
	}
	if err := json.Unmarshal(body, v); err != nil {
		return errdefs.InvalidArgument("iam: command type %d: %v", t, err)
	}
	return nil
}

// FSM is the state; it implements raft.FSM.
type FSM struct {
	// applied is the index of the last log entry applied here. Raft's own
	// AppliedIndex moves when entries are handed to the FSM, before they
	// are applied, so a read at that index can miss them.
	applied atomic.Uint64

	mu       sync.RWMutex
	projects map[string]*Project     // guarded by mu
	keys     map[string]*Key         // guarded by mu
	byHash   map[string]string       // guarded by mu: hash -> key id
	entries  map[string]*Entry       // guarded by mu: the quota ledger by id
	usage    map[string]sum          // guarded by mu: the ledger's sum per subtree
	byKey    map[string]string       // guarded by mu: project+idempotency key -> entry id
	pools    map[string]*PoolSetting // guarded by mu: warm pools set through the API, by key
}

var _ raft.FSM = (*FSM)(nil)

// New returns an empty state.
func New() *FSM {
	return &FSM{projects: map[string]*Project{}, keys: map[string]*Key{}, byHash: map[string]string{}, entries: map[string]*Entry{}, usage: map[string]sum{}, byKey: map[string]string{}, pools: map[string]*PoolSetting{}}
}

// Apply applies one committed entry. It returns nil or an error value (the
// caller reads it from the future's Response).
func (f *FSM) Apply(l *raft.Log) any {
	defer f.applied.Store(l.Index)
	if l.Type != raft.LogCommand {
		return nil
	}
	return f.ApplyCommand(l.Data)
}

// Applied is the index of the last log entry applied (not counting a
// snapshot restored since).
func (f *FSM) Applied() uint64 { return f.applied.Load() }

// ApplyCommand applies an encoded command (also used by tests directly).
func (f *FSM) ApplyCommand(data []byte) error {
	if len(data) == 0 {
		return errdefs.InvalidArgument("iam: empty command")
	}
	t, body := CommandType(data[0]), data[1:]
	f.mu.Lock()
	defer f.mu.Unlock()
	switch t &^ IgnoreUnknown {
	case CmdReserve &^ IgnoreUnknown, CmdBind &^ IgnoreUnknown, CmdRelease &^ IgnoreUnknown, CmdAdopt &^ IgnoreUnknown:
		return f.applyLedger(t|IgnoreUnknown, body)
	case CmdSetPool &^ IgnoreUnknown:
		var c SetPool
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		return f.setPool(c)
	case CmdCreateProject:
		var c CreateProject
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		return f.createProject(c)
	case CmdSetQuota:
		var c SetQuota
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		return f.setQuota(c)
	case CmdDeleteProject:
		var c DeleteProject
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		return f.deleteProject(c)
	case CmdCreateKey:
		var c CreateKey
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		return f.createKey(c)
	case CmdRevokeKey:
		var c RevokeKey
		if err := json.Unmarshal(body, &c); err != nil {
			return err
		}
		if _, ok := f.keys[c.ID]; !ok {
			return errdefs.NotFound("api key %q: no such key", c.ID)
		}
		delete(f.byHash, f.keys[c.ID].Hash)
		delete(f.keys, c.ID)
		return nil
	}
	if t&IgnoreUnknown != 0 {
		return nil
	}
	panic(fmt.Sprintf("iam: unknown command type %d; upgrade this replica", t))
}

// effective returns the tightest limit on path from it and its ancestors.
func (f *FSM) effective(path string) Quota {
	var q Quota
	for p := path; p != ""; p = project.Parent(p) {
		pr, ok := f.projects[p]
		if !ok {
			break
		}
		pq := pr.Quota
		if pq.MaxSandboxes > 0 && (q.MaxSandboxes == 0 || pq.MaxSandboxes < q.MaxSandboxes) {
			q.MaxSandboxes = pq.MaxSandboxes
		}
		if pq.CPUCores > 0 && (q.CPUCores == 0 || pq.CPUCores < q.CPUCores) {
			q.CPUCores = pq.CPUCores
		}
		if pq.MemoryMB > 0 && (q.MemoryMB == 0 || pq.MemoryMB < q.MemoryMB) {
			q.MemoryMB = pq.MemoryMB
		}
		if pq.StorageMB > 0 && (q.StorageMB == 0 || pq.StorageMB < q.StorageMB) {
			q.StorageMB = pq.StorageMB
		}
	}
	return q
}

// within checks that child asks no more than limit allows.
func within(child, limit Quota, where string) error {
	if child.MaxSandboxes < 0 || child.CPUCores < 0 || child.MemoryMB < 0 || child.StorageMB < 0 {
		return errdefs.InvalidArgument("quota: values must not be negative")
	}
	switch {
	case limit.MaxSandboxes > 0 && child.MaxSandboxes > limit.MaxSandboxes:
		return errdefs.InvalidArgument("quota.max_sandboxes %d: over %s's %d", child.MaxSandboxes, where, limit.MaxSandboxes)
	case limit.CPUCores > 0 && child.CPUCores > limit.CPUCores:
		return errdefs.InvalidArgument("quota.cpu_cores %g: over %s's %g", child.CPUCores, where, limit.CPUCores)
	case limit.MemoryMB > 0 && child.MemoryMB > limit.MemoryMB:
		return errdefs.InvalidArgument("quota.memory_mb %d: over %s's %d", child.MemoryMB, where, limit.MemoryMB)
	case limit.StorageMB > 0 && child.StorageMB > limit.StorageMB:
		return errdefs.InvalidArgument("quota.storage_mb %d: over %s's %d", child.StorageMB, where, limit.StorageMB)
	}
	return nil
}

func (f *FSM) createProject(c CreateProject) error {
	if err := project.ValidName(c.Name); err != nil {
		return err
	}
	path := c.Name
	if c.Parent == "" {
		if c.Name != project.Root {
			return errdefs.InvalidArgument("project %q: only %q has no parent", c.Name, project.Root)
		}
	} else {
		if _, ok := f.projects[c.Parent]; !ok {
			return errdefs.NotFound("project %q: no such parent", c.Parent)
		}
		path = c.Parent + "/" + c.Name
		if err := project.Valid(path); err != nil {
			return err
		}
		if err := within(c.Quota, f.effective(c.Parent), "parent "+c.Parent); err != nil {
			return err
		}
	}
	if _, ok := f.projects[path]; ok {
		return errdefs.AlreadyExists("project %q: already exists", path)
	}
	f.projects[path] = &Project{Path: path, Quota: c.Quota, CreatedAt: c.At}
	return nil
}

func (f *FSM) setQuota(c SetQuota) error {
	p, ok := f.projects[c.Path]
	if !ok {
		return errdefs.NotFound("project %q: no such project", c.Path)
	}
	if parent := project.Parent(c.Path); parent != "" {
		if err := within(c.Quota, f.effective(parent), "parent "+parent); err != nil {
			return err
		}
	} else if err := within(c.Quota, Quota{}, ""); err != nil {
		return err
	}
	for path, child := range f.projects {
		if project.Parent(path) == c.Path {
			if err := within(child.Quota, c.Quota, "the new quota of "+c.Path); err != nil {
				return errdefs.FailedPrecondition("child %s: %v; lower it first", path, err)
			}
		}
	}
	p.Quota = c.Quota
	return nil
}

func (f *FSM) deleteProject(c DeleteProject) error {
	if _, ok := f.projects[c.Path]; !ok {
		return errdefs.NotFound("project %q: no such project", c.Path)
	}
	if c.Path == project.Root {
		return errdefs.FailedPrecondition("project root cannot be deleted")
	}
	for path := range f.projects {
		if project.Parent(path) == c.Path {
			return errdefs.FailedPrecondition("project %q has child %q; delete it first", c.Path, path)
		}
	}
	for _, k := range f.keys {
		if k.Project == c.Path {
			return errdefs.FailedPrecondition("project %q has API key %q; revoke it first", c.Path, k.ID)
		}
	}
	if u := f.usage[c.Path]; u.sandboxes > 0 {
		return errdefs.FailedPrecondition("project %q still holds %d sandboxes (or creates in progress); stop them first", c.Path, u.sandboxes)
	}
	delete(f.projects, c.Path)
	return nil
}

func (f *FSM) createKey(c CreateKey) error {
	k := c.Key
	if _, ok := f.projects[k.Project]; !ok {
		return errdefs.NotFound("project %q: no such project", k.Project)
	}
	if k.Role != RoleMember && k.Role != RoleAdmin {
		return errdefs.InvalidArgument("role %d: want MEMBER or ADMIN", k.Role)
	}
	if _, ok := f.keys[k.ID]; ok {
		return errdefs.AlreadyExists("api key %q: already exists", k.ID)
	}
	if _, ok := f.byHash[k.Hash]; ok {
		return errdefs.AlreadyExists("api key: secret already in use")
	}
	kk := k
	f.keys[k.ID] = &kk
	f.byHash[k.Hash] = k.ID
	return nil
}

// Project returns a project.
func (f *FSM) Project(path string) (Project, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	p, ok := f.projects[path]
	if !ok {
		return Project{}, false
	}
	return *p, true
}

// Effective returns the tightest quota on path from it and its ancestors.
func (f *FSM) Effective(path string) Quota {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.effective(path)
}

// Subtree lists path and its descendants, sorted.
func (f *FSM) Subtree(path string) []Project {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []Project
	for p, pr := range f.projects {
		if project.Within(p, path) {
			out = append(out, *pr)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out
}

// KeyByHash finds a key by the hash of its secret.
func (f *FSM) KeyByHash(hash string) (Key, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	id, ok := f.byHash[hash]
	if !ok {
		return Key{}, false
	}
	return *f.keys[id], true
}

// Key finds a key by id.
func (f *FSM) Key(id string) (Key, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	k, ok := f.keys[id]
	if !ok {
		return Key{}, false
	}
	return *k, true
}

// Keys lists the keys of path and its descendants.
func (f *FSM) Keys(path string) []Key {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []Key
	for _, k := range f.keys {
		if project.Within(k.Project, path) {
			out = append(out, *k)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Empty reports whether no project exists yet.
func (f *FSM) Empty() bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.projects) == 0
}

type snapshotData struct {
	Projects []*Project `json:"projects"`
	Keys     []*Key     `json:"keys"`
	Ledger   []*Entry   `json:"ledger,omitempty"`
	// Pools: a replica from before them reads a snapshot without them.
	Pools []PoolSetting `json:"pools,omitempty"`
}

// Snapshot captures the state.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var d snapshotData
	for _, p := range f.projects {
		pp := *p
		d.Projects = append(d.Projects, &pp)
	}
	for _, k := range f.keys {
		kk := *k
		d.Keys = append(d.Keys, &kk)
	}
	for _, e := range f.entries {
		ee := *e
		d.Ledger = append(d.Ledger, &ee)
	}
	d.Pools = f.poolsLocked()
	sort.Slice(d.Ledger, func(i, j int) bool { return d.Ledger[i].ID < d.Ledger[j].ID })
	sort.Slice(d.Projects, func(i, j int) bool { return d.Projects[i].Path < d.Projects[j].Path })
	sort.Slice(d.Keys, func(i, j int) bool { return d.Keys[i].ID < d.Keys[j].ID })
	return &fsmSnapshot{d}, nil
}

// Restore replaces the state from a snapshot.
func (f *FSM) Restore(r io.ReadCloser) error {
	defer r.Close()
	var d snapshotData
	if err := json.NewDecoder(r).Decode(&d); err != nil {
		return fmt.Errorf("iam snapshot: %w", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.projects, f.keys, f.byHash = map[string]*Project{}, map[string]*Key{}, map[string]string{}
	f.entries, f.usage, f.byKey = map[string]*Entry{}, map[string]sum{}, map[string]string{}
	f.pools = map[string]*PoolSetting{}
	for _, p := range d.Pools {
		f.pools[p.Key] = &p
	}
	for _, e := range d.Ledger {
		f.addEntry(*e)
	}
	for _, p := range d.Projects {
		f.projects[p.Path] = p
	}
	for _, k := range d.Keys {
		f.keys[k.ID] = k
		f.byHash[k.Hash] = k.ID
	}
	return nil
}

type fsmSnapshot struct{ d snapshotData }

func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	if err := json.NewEncoder(sink).Encode(s.d); err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}

func (s *fsmSnapshot) Release() {}
