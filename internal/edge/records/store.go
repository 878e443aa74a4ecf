package records

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"google.golang.org/protobuf/encoding/protojson"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/atomicfile"
	"github.com/opendsec/opendsec/internal/edge/layout"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// upgrades[v] turns a record of layout v, as a JSON object, into
// layout v+1; its length is the layout this release writes. A change to
// what a record's fields mean or how they are spelled adds a step here, so
// that a node upgraded in place reads the records of its running
// sandboxes.
var upgrades = []layout.Upgrade{
	// 0 → 1: releases before layouts were numbered wrote the same fields.
	0: func(map[string]json.RawMessage) error { return nil },
}

// CurrentLayout is the layout of the records this release writes.
func CurrentLayout() int { return len(upgrades) }

// Store keeps the edge's sandbox records: what a restarted edge reads to
// find its sandboxes again.
type Store interface {
	// Put writes r in this release's layout, replacing any record of r.ID.
	Put(r *Record) error
	// Get reads the record of id, upgraded to this release's layout; an
	// error wrapping fs.ErrNotExist when there is none.
	Get(id sandboxid.ID) (*Record, error)
	// Delete removes the record of id; none is not an error.
	Delete(id sandboxid.ID) error
	// List reads every record, upgraded. Those that cannot be read (a
	// newer release's layout, one changed by hand) are kept where they
	// are and reported in unreadable; a listing that failed whole is
	// reported there under the empty id.
	List() (recs []*Record, unreadable map[sandboxid.ID]error)
}

// encode is r in this release's layout.
func encode(r *Record) ([]byte, error) {
	data, err := protojson.Marshal(r.Spec)
	if err != nil {
		return nil, fmt.Errorf("record %s spec: %w", r.ID, err)
	}
	r.SpecJSON, r.Layout = data, len(upgrades)
	return json.MarshalIndent(r, "", " ")
}

// decode reads a record of any layout this release knows, upgraded
// to its own. One of a newer layout is refused (FailedPrecondition), not
// guessed at: a node downgraded past a layout change keeps such records
// for the release that wrote them.
func decode(data []byte) (*Record, error) {
	var r Record
	if err := layout.Read("record", data, upgrades, &r); err != nil {
		return nil, err
	}
	r.Spec = &sandboxv1.SandboxSpec{}
	if err := protojson.Unmarshal(r.SpecJSON, r.Spec); err != nil {
		return nil, errdefs.FailedPrecondition("record %s spec: %v", r.ID, err)
	}
	return &r, nil
}

// File is a record's name in its sandbox's directory.
const File = "record.json"

// Dir keeps each record as record.json in its sandbox's directory under
// Root (which the sandbox's other files share).
type Dir struct{ Root string }

func (s Dir) path(id sandboxid.ID) string {
	return filepath.Join(s.Root, string(id), File)
}

func (s Dir) Put(r *Record) error {
	data, err := encode(r)
	if err != nil {
		return err
	}
	return atomicfile.Write(s.path(r.ID), data, 0o600)
}

func (s Dir) Get(id sandboxid.ID) (*Record, error) {
	data, err := os.ReadFile(s.path(id))
	if err != nil {
		return nil, err
	}
	r, err := decode(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", s.path(id), err)
	}
	return r, nil
}

func (s Dir) Delete(id sandboxid.ID) error {
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

func (s Dir) List() ([]*Record, map[sandboxid.ID]error) {
	ents, err := os.ReadDir(s.Root)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, map[sandboxid.ID]error{"": err}
	}
	var ids []sandboxid.ID
	for _, ent := range ents {
		if ent.IsDir() { // else not a sandbox's directory (recovery removes it)
			ids = append(ids, sandboxid.ID(ent.Name()))
		}
	}
	return readAll(ids, s.Get)
}

// readAll reads the records of ids with get for List: one that is
// not there (a directory without a record, one deleted meanwhile) is
// left out, one that cannot be read is reported.
func readAll(ids []sandboxid.ID, get func(sandboxid.ID) (*Record, error)) ([]*Record, map[sandboxid.ID]error) {
	var recs []*Record
	bad := map[sandboxid.ID]error{}
	for _, id := range ids {
		r, err := get(id)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			bad[id] = err
		default:
			recs = append(recs, r)
		}
	}
	return recs, bad
}

// Mem is a Store in memory, for tests; it keeps records encoded, so they
// pass through the same layouts as on disk.
type Mem struct {
	mu   sync.Mutex
	data map[sandboxid.ID][]byte
}

// NewMem is an empty Mem.
func NewMem() *Mem { return &Mem{data: map[sandboxid.ID][]byte{}} }

func (s *Mem) Put(r *Record) error {
	data, err := encode(r)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.data[r.ID] = data
	return nil
}

func (s *Mem) Get(id sandboxid.ID) (*Record, error) {
	s.mu.Lock()
	data, ok := s.data[id]
	s.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("record %s: %w", id, fs.ErrNotExist)
	}
	return decode(data)
}

func (s *Mem) Delete(id sandboxid.ID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.data, id)
	return nil
}

func (s *Mem) List() ([]*Record, map[sandboxid.ID]error) {
	s.mu.Lock()
	ids := make([]sandboxid.ID, 0, len(s.data))
	for id := range s.data {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	slices.Sort(ids)
	return readAll(ids, s.Get)
}
