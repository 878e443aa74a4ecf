// Package snapshots is an edge's store of memory snapshots: its own
// (named ones, and a fork's ephemeral one while its copies start), the
// exports that let other edges pull them, and the snapshots pulled from
// other edges for restores here. What spans sandboxes and snapshots (take
// one, start copies from it) is the edge's.
package snapshots

import (
	"encoding/json"
	"path/filepath"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/atomicfile"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/layout"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// Snapshot is a memory snapshot held by this node, under snapshots/<id>/:
// what its backend wrote (a runsc checkpoint, a microVM's RAM and device
// state), described by snapshot.json.
type Snapshot struct {
	// Layout is the description's layout version (internal/edge/layout).
	Layout        int                  `json:"layout"`
	ID            sandboxid.SnapshotID `json:"id"`
	Project       string               `json:"project"`
	SourceSandbox sandboxid.ID         `json:"source_sandbox"`
	Backend       string               `json:"backend"`
	ImageDigest   string               `json:"image_digest"`
	Spec          json.RawMessage      `json:"spec"`
	CreatedAt     time.Time            `json:"created_at"`
	SizeBytes     int64                `json:"size_bytes"`
	// Ephemeral snapshots exist only for the length of a fork.
	Ephemeral bool   `json:"ephemeral,omitempty"`
	Name      string `json:"name,omitempty"`
	// AgentKey is the source's agent key: the agent in the snapshot's
	// memory presents it, so every copy's record takes it.
	AgentKey string `json:"agent_key,omitempty"`
	// AgentVersion is the source's agent's version: the agent in the
	// snapshot's memory is the one every copy runs.
	AgentVersion string `json:"agent_version,omitempty"`

	// Dir is the directory of its files: this node's store, or the
	// store's cache of snapshots pulled from other nodes.
	Dir string `json:"-"`
	// SandboxSpec is Spec decoded.
	SandboxSpec *sandboxv1.SandboxSpec `json:"-"`
}

// File is a snapshot's description in its directory.
const File = "snapshot.json"

// upgrades[v] turns a snapshot description of layout v into
// layout v+1; its length is the layout this release writes.
var upgrades = []layout.Upgrade{
	// 0 → 1: releases before layouts were numbered wrote the same fields.
	0: func(map[string]json.RawMessage) error { return nil },
}

// Encode is the snapshot's description in this release's layout.
func (s *Snapshot) Encode() ([]byte, error) {
	c := *s // exports of one snapshot encode it at once
	c.Layout = len(upgrades)
	return json.MarshalIndent(&c, "", " ")
}

// Decode reads a snapshot description of any layout this release
// knows, with its spec.
func Decode(data []byte) (*Snapshot, error) {
	var s Snapshot
	if err := layout.Read("snapshot", data, upgrades, &s); err != nil {
		return nil, err
	}
	if err := s.parseSpec(); err != nil {
		return nil, errdefs.FailedPrecondition("snapshot %s spec: %v", s.ID, err)
	}
	return &s, nil
}

// Ref is where its backend finds it.
func (s *Snapshot) Ref() backend.SnapshotRef { return backend.SnapshotRef{ID: s.ID, Dir: s.Dir} }

// Proto is its public description, as node holds it.
func (s *Snapshot) Proto(node sandboxid.NodeID) *sandboxv1.Snapshot {
	return &sandboxv1.Snapshot{
		Id: string(s.ID), Project: s.Project, SourceSandboxId: string(s.SourceSandbox), Name: s.Name,
		Spec: proto.Clone(s.SandboxSpec).(*sandboxv1.SandboxSpec), CreatedAt: timestamppb.New(s.CreatedAt),
		SizeBytes: s.SizeBytes, NodeId: string(node), ImageDigest: s.ImageDigest,
	}
}

// Save writes its description into its directory.
func (s *Snapshot) Save() error {
	data, err := s.Encode()
	if err != nil {
		return err
	}
	return atomicfile.Write(filepath.Join(s.Dir, File), data, 0o600)
}

// parseSpec reads the spec the snapshot's JSON carries.
func (s *Snapshot) parseSpec() error {
	s.SandboxSpec = &sandboxv1.SandboxSpec{}
	return protojson.Unmarshal(s.Spec, s.SandboxSpec)
}

// CurrentLayout is the layout of the descriptions this release writes.
func CurrentLayout() int { return len(upgrades) }
