package edge

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

// recordUpgrades[v] turns a record of layout v, as a JSON object, into
// layout v+1; its length is the layout this release writes. A change to
// what a record's fields mean or how they are spelled adds a step here, so
// that a node upgraded in place reads the records of its running
// sandboxes.
var recordUpgrades = []layout.Upgrade{
	// 0 → 1: releases before layouts were numbered wrote the same fields.
	0: func(map[string]json.RawMessage) error { return nil },
}

// recordStore keeps the edge's sandbox records: what a restarted edge
// reads to find its sandboxes again.
type recordStore interface {
	// Put writes r in this release's layout, replacing any record of r.ID.
	Put(r *record) error
	// Get reads the record of id, upgraded to this release's layout; an
	// error wrapping fs.ErrNotExist when there is none.
	Get(id sandboxid.ID) (*record, error)
	// Delete removes the record of id; none is not an error.
	Delete(id sandboxid.ID) error
	// List reads every record, upgraded. Those that cannot be read (a
	// newer release's layout, one changed by hand) are kept where they
	// are and reported in unreadable; a listing that failed whole is
	// reported there under the empty id.
	List() (recs []*record, unreadable map[sandboxid.ID]error)
}

// encodeRecord is r in this release's layout.
func encodeRecord(r *record) ([]byte, error) {
	data, err := protojson.Marshal(r.spec)
	if err != nil {
		return nil, fmt.Errorf("record %s spec: %w", r.ID, err)
	}
	r.Spec, r.Layout = data, len(recordUpgrades)
	return json.MarshalIndent(r, "", " ")
}

// decodeRecord reads a record of any layout this release knows, upgraded
// to its own. One of a newer layout is refused (FailedPrecondition), not
// guessed at: a node downgraded past a layout change keeps such records
// for the release that wrote them.
func decodeRecord(data []byte) (*record, error) {
	var r record
	if err := layout.Read("record", data, recordUpgrades, &r); err != nil {
		return nil, err
	}
	r.spec = &sandboxv1.SandboxSpec{}
	if err := protojson.Unmarshal(r.Spec, r.spec); err != nil {
		return nil, errdefs.FailedPrecondition("record %s spec: %v", r.ID, err)
	}
	return &r, nil
}

const recordFile = "record.json"

// dirRecords keeps each record as record.json in its sandbox's directory
// under root (which the sandbox's other files share).
type dirRecords struct{ root string }

func (s dirRecords) path(id sandboxid.ID) string {
	return filepath.Join(s.root, string(id), recordFile)
}

func (s dirRecords) Put(r *record) error {
	data, err := encodeRecord(r)
	if err != nil {
		return err
	}
	return atomicfile.Write(s.path(r.ID), data, 0o600)
}

func (s dirRecords) Get(id sandboxid.ID) (*record, error) {
	data, err := os.ReadFile(s.path(id))
	if err != nil {
		return nil, err
	}
	r, err := decodeRecord(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", s.path(id), err)
	}
	return r, nil
}

func (s dirRecords) Delete(id sandboxid.ID) error {
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

func (s dirRecords) List() ([]*record, map[sandboxid.ID]error) {
	ents, err := os.ReadDir(s.root)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, map[sandboxid.ID]error{"": err}
	}
	var ids []sandboxid.ID
	for _, ent := range ents {
		if ent.IsDir() { // else not a sandbox's directory (recovery removes it)
			ids = append(ids, sandboxid.ID(ent.Name()))
		}
	}
	return readRecords(ids, s.Get)
}

// readRecords reads the records of ids with get for List: one that is
// not there (a directory without a record, one deleted meanwhile) is
// left out, one that cannot be read is reported.
func readRecords(ids []sandboxid.ID, get func(sandboxid.ID) (*record, error)) ([]*record, map[sandboxid.ID]error) {
	var recs []*record
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

// memRecords is a recordStore in memory, for tests; it keeps records
// encoded, so they pass through the same layouts as on disk.
type memRecords struct {
	mu   sync.Mutex
	data map[sandboxid.ID][]byte
}

func newMemRecords() *memRecords { return &memRecords{data: map[sandboxid.ID][]byte{}} }

func (s *memRecords) Put(r *record) error {
	data, err := encodeRecord(r)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.data[r.ID] = data
	return nil
}

func (s *memRecords) Get(id sandboxid.ID) (*record, error) {
	s.mu.Lock()
	data, ok := s.data[id]
	s.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("record %s: %w", id, fs.ErrNotExist)
	}
	return decodeRecord(data)
}

func (s *memRecords) Delete(id sandboxid.ID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.data, id)
	return nil
}

func (s *memRecords) List() ([]*record, map[sandboxid.ID]error) {
	s.mu.Lock()
	ids := make([]sandboxid.ID, 0, len(s.data))
	for id := range s.data {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	slices.Sort(ids)
	return readRecords(ids, s.Get)
}
