package fsm

import (
	"encoding/json"
	"sort"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Warm pools set through the API are kept here, replicated, so that every
// node takes them: one that joins later, was unreachable or lost its state
// directory as well as those that answered the call (the apiserver's pool
// reconciler pushes the difference; docs/design.md, "warm pools").

// CmdSetPool sets or (size 0) removes a warm pool. IgnoreUnknown: a
// replica from before cluster-wide pools skips it.
const CmdSetPool = 10 | IgnoreUnknown

// PoolSetting is one pool set through the API.
type PoolSetting struct {
	// Key names the pool: its project, image and shape, as the apiserver
	// writes them; settings with the same key are the same pool.
	Key string `json:"key"`
	// Project is the project whose view of images resolves the image.
	Project string `json:"project"`
	// Spec is the pool's sandbox spec as the apiserver sends it to nodes
	// (protojson); the state keeps it as it is.
	Spec json.RawMessage `json:"spec"`
	// Size is how many sandboxes each node keeps started; 0 is a removal,
	// kept (with its spec, which names the pool to a node) for nodes that
	// did not hear of it until tombstoneKept has passed.
	Size int32     `json:"size"`
	At   time.Time `json:"at"`
}

// SetPool is CmdSetPool's body.
type SetPool struct {
	Pool PoolSetting `json:"pool"`
}

// MaxPoolKey bounds a pool's key (an image reference and a shape).
const MaxPoolKey = 1024

// tombstoneKept is how long a removed pool is remembered: a node away
// longer than this keeps a pool removed meanwhile until it is removed
// again.
const tombstoneKept = 30 * 24 * time.Hour

func (f *FSM) setPool(c SetPool) error {
	p := c.Pool
	switch {
	case p.Key == "" || len(p.Key) > MaxPoolKey:
		return errdefs.InvalidArgument("pool key: want 1 to %d bytes, have %d", MaxPoolKey, len(p.Key))
	case p.Size < 0:
		return errdefs.InvalidArgument("pool size %d: want 0 or more", p.Size)
	case !json.Valid(p.Spec):
		return errdefs.InvalidArgument("pool %s: its spec is not JSON", p.Key)
	}
	f.pools[p.Key] = &p
	// Removals older than tombstoneKept go, judged by the command's own
	// time so that every replica drops the same ones.
	for k, old := range f.pools {
		if old.Size == 0 && p.At.Sub(old.At) > tombstoneKept {
			delete(f.pools, k)
		}
	}
	return nil
}

// Pools are the pools set through the API, removals included, by key.
func (f *FSM) Pools() []PoolSetting {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.poolsLocked()
}

func (f *FSM) poolsLocked() []PoolSetting {
	out := make([]PoolSetting, 0, len(f.pools))
	for _, p := range f.pools {
		out = append(out, *p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}
