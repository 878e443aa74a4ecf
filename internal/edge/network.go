package edge

import (
	"context"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// Sandbox networking [ours; the paper filters with eBPF]. A sandbox
// created with a network policy gets its own network namespace, a veth to
// the node and an address from the node's sandbox subnet; the node's
// nftables table enforces its policy and a DNS proxy on the gateway
// address answers only the names it allows (internal/sandboxnet). One
// without a policy has loopback only. The table, the interface prefix and
// the subnet are the node's own (derived from its id by
// sandboxnet.OpenNode), so several edges on one machine do not meet.

// networkedRecords lists the sandboxes whose records say they are
// attached, for Open to accept their veths.
func networkedRecords(store records.Store) []string {
	recs, unreadable := store.List()
	var out []string
	for _, rec := range recs {
		if rec.Spec.Network != nil {
			out = append(out, string(rec.ID))
		}
	}
	// A record this release cannot read keeps its veth, for the release
	// that can.
	for id := range unreadable {
		if id != "" { // "": the directory itself could not be read
			out = append(out, string(id))
		}
	}
	return out
}

// checkPolicy refuses a policy the node's network n keeps closed (a rule
// naming its own address or the metadata service's), before anything is
// made.
func checkPolicy(n sandbox.Network, field string, network *sandboxv1.NetworkPolicy) error {
	if network == nil || n == nil {
		return nil
	}
	p, err := sandboxspec.NetworkPolicy(network)
	if err != nil {
		return err
	}
	return n.Node().CheckPolicy(field, p)
}

// UpdateNetwork changes a running or paused sandbox's policy by exactly
// what the request says.
func (e *Edge) UpdateNetwork(ctx context.Context, req *sandboxv1.UpdateNetworkRequest, scope string) (*sandboxv1.Sandbox, error) {
	sb, err := e.lookup(req.GetSandboxId(), scope)
	if err != nil {
		return nil, err
	}
	v, err := sb.UpdateNetwork(ctx, req)
	e.prom.policyUpdated(err)
	return v, err
}

// asSandboxNetwork is n for its sandboxes; nil (not a nil pointer in an
// interface) without one.
func asSandboxNetwork(n *sandboxnet.Network) sandbox.Network {
	if n == nil {
		return nil
	}
	return n
}
