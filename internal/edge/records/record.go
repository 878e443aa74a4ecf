// Package records is the node's sandbox records: what the edge keeps on
// disk for each sandbox so that a restarted (or upgraded) edge finds its
// sandboxes again, and the store that versions them.
package records

import (
	"encoding/json"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// Record is what the edge keeps on disk for a sandbox.
type Record struct {
	// Layout is the record's layout version (store.go); records of
	// releases before it had one are layout 0.
	Layout int          `json:"layout"`
	ID     sandboxid.ID `json:"id"`
	// Project is immutable.
	Project string `json:"project"`
	// SpecJSON is Spec as protojson, as it was last written.
	SpecJSON       json.RawMessage `json:"spec"`
	State          string          `json:"state"`
	CreatedAt      time.Time       `json:"created_at"`
	ExpiresAt      time.Time       `json:"expires_at"`
	ImageDigest    string          `json:"image_digest"`
	Handle         *backend.Handle `json:"handle,omitempty"`
	Message        string          `json:"message,omitempty"`
	SourceSnapshot string          `json:"source_snapshot,omitempty"`
	// LayerDir is the writable layer's mount point (layerfs), for backends
	// that keep it on the node's disk.
	LayerDir string `json:"layer_dir,omitempty"`
	// PausedTask is set when the sandbox was paused by a task-wide pause.
	PausedTask bool `json:"paused_task,omitempty"`
	// Offloaded, for a paused sandbox, is the checkpoint its memory went to
	// (in its directory); empty for a frozen one.
	Offloaded string `json:"offloaded,omitempty"`
	// TimeoutLeft is, for a paused sandbox, the time to live it resumes
	// with (its ExpiresAt is then the end of its paused lifetime).
	TimeoutLeft time.Duration `json:"timeout_left,omitempty"`
	// NetAddr is the sandbox's address on the node's sandbox network.
	NetAddr string `json:"net_addr,omitempty"`
	// Reservation is the apiserver's quota reservation the create settles.
	Reservation string `json:"reservation,omitempty"`
	// Checkpoint is the directory of a checkpoint being taken of the
	// sandbox (a snapshot, a fork, an offload): if it stopped the sandbox
	// and the edge went down before bringing it back, the restarted edge
	// restores it in place from there.
	Checkpoint string `json:"checkpoint,omitempty"`
	// AgentKey is the key the sandbox's agent presents at every connection
	// (agentlink/auth.go). Empty for a VM (its link is its serial port) and
	// for a sandbox made before agents authenticated.
	AgentKey string `json:"agent_key,omitempty"`
	// AgentVersion is the version of the agent running in the sandbox:
	// its edge's at the create, its snapshot's for a copy. Empty for a
	// sandbox made before versions were recorded.
	AgentVersion string `json:"agent_version,omitempty"`
	// FilesystemOnly, for a paused sandbox, says its processes were ended
	// at the pause (PAUSE_DEPTH_FILESYSTEM): its resume starts it afresh.
	FilesystemOnly bool `json:"filesystem_only,omitempty"`
	// Service is the image's service labels (image.LabelStart and the
	// labels that go with it), kept to start it again after such a resume.
	Service map[string]string `json:"service,omitempty"`

	// Spec is the decoded spec; SetSpec sets both, and a store writes
	// SpecJSON from it.
	Spec *sandboxv1.SandboxSpec `json:"-"`
}

// Record states; they match SandboxState names.
const (
	StateCreating = "creating"
	StateRunning  = "running"
	StatePaused   = "paused"
	StateStopping = "stopping"
	// StateFailed: the sandbox died; its record stays (with the reason in
	// Message) until it is stopped or its time to live ends, but it holds
	// nothing on the node.
	StateFailed = "failed"
)

var stateProto = map[string]sandboxv1.SandboxState{
	StateCreating: sandboxv1.SandboxState_SANDBOX_STATE_CREATING,
	StateRunning:  sandboxv1.SandboxState_SANDBOX_STATE_RUNNING,
	StatePaused:   sandboxv1.SandboxState_SANDBOX_STATE_PAUSED,
	StateStopping: sandboxv1.SandboxState_SANDBOX_STATE_STOPPING,
	StateFailed:   sandboxv1.SandboxState_SANDBOX_STATE_FAILED,
}

// SetSpec sets r's spec, decoded and encoded.
func (r *Record) SetSpec(s *sandboxv1.SandboxSpec) error {
	data, err := protojson.Marshal(s)
	if err != nil {
		return err
	}
	r.SpecJSON, r.Spec = data, s
	return nil
}

// Proto is r's public view, on node.
func (r *Record) Proto(node sandboxid.NodeID) *sandboxv1.Sandbox {
	return &sandboxv1.Sandbox{
		Id: string(r.ID), Project: r.Project, NodeId: string(node), Spec: proto.Clone(r.Spec).(*sandboxv1.SandboxSpec),
		State: stateProto[r.State], CreatedAt: timestamppb.New(r.CreatedAt), ExpiresAt: timestamppb.New(r.ExpiresAt),
		Message: r.Message, ImageDigest: r.ImageDigest, SourceSnapshotId: r.SourceSnapshot,
		PauseDepth: r.PauseDepth(), TimeoutLeftSeconds: int64(r.TimeoutLeft / time.Second),
		NetworkAddress: r.NetAddr, AgentVersion: r.AgentVersion,
	}
}

// PauseDepth is how deep a paused sandbox's pause went.
func (r *Record) PauseDepth() sandboxv1.PauseDepth {
	switch {
	case r.State != StatePaused:
		return sandboxv1.PauseDepth_PAUSE_DEPTH_UNSPECIFIED
	case r.FilesystemOnly:
		return sandboxv1.PauseDepth_PAUSE_DEPTH_FILESYSTEM
	case r.Offloaded != "":
		return sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD
	default:
		return sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE
	}
}
