package sandbox

import (
	"context"
	"fmt"
	"net/netip"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/netpolicy"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// policyOf is the sandbox's policy as its record holds it. It was checked
// when the sandbox was accepted, so an error means a record this release
// reads differently (or one changed by hand): the sandbox gets no network
// rather than a policy other than its own.
func policyOf(rec *records.Record) (netpolicy.Policy, error) {
	p, err := sandboxspec.NetworkPolicy(rec.Spec.Network)
	if err != nil {
		// Not a wrap: the parser's InvalidArgument would be the class, and
		// the request at hand is not what is wrong.
		return p, errdefs.FailedPrecondition("its recorded network policy: %v", err)
	}
	return p, nil
}

// attachNetwork gives a sandbox whose spec asks for a network its
// namespace and policy, and records its address. Callers hold sb.mu.
func (sb *Sandbox) attachNetwork(ctx context.Context) error {
	if sb.rec.Spec.Network == nil {
		return nil
	}
	if sb.nodeNet == nil {
		return errdefs.FailedPrecondition("network: node %s runs without sandbox networking (%s); create the sandbox without a network policy", sb.node, sb.nodeNetOff)
	}
	p, err := policyOf(sb.rec)
	if err != nil {
		return err
	}
	l, err := sb.nodeNet.Attach(ctx, string(sb.id), netip.Addr{}, p)
	if err != nil {
		return err
	}
	sb.net = l
	sb.rec.NetAddr = l.Addr.String()
	return sb.save()
}

// adoptNetwork takes back a recovered sandbox's attachment. Callers hold
// sb.mu.
func (sb *Sandbox) adoptNetwork(ctx context.Context) error {
	if sb.rec.Spec.Network == nil {
		return nil
	}
	if sb.nodeNet == nil {
		return errdefs.FailedPrecondition("its network cannot be re-attached: the edge now runs without sandbox networking (%s)", sb.nodeNetOff)
	}
	addr, err := netip.ParseAddr(sb.rec.NetAddr)
	if err != nil {
		return errdefs.FailedPrecondition("its record has no network address (%q)", sb.rec.NetAddr)
	}
	p, err := policyOf(sb.rec)
	if err != nil {
		return err
	}
	l, err := sb.nodeNet.Adopt(ctx, string(sb.id), addr, p)
	if err != nil {
		return err
	}
	sb.net = l
	return nil
}

// detachNetwork removes what attachNetwork made (or what a crash before
// the record named the address left). Callers hold sb.mu.
func (sb *Sandbox) detachNetwork(ctx context.Context) error {
	if sb.nodeNet == nil || sb.rec.Spec.Network == nil {
		return nil
	}
	var err error
	if sb.net != nil {
		err = sb.nodeNet.Detach(ctx, sb.net)
	} else {
		err = sb.nodeNet.Forget(ctx, string(sb.id))
	}
	if err != nil {
		return fmt.Errorf("detach sandbox %s from the network: %w", sb.id, err)
	}
	sb.net = nil
	return nil
}

// UpdateNetwork changes sb's policy by exactly what req says and returns
// its description as it then is.
func (sb *Sandbox) UpdateNetwork(ctx context.Context, req *sandboxv1.UpdateNetworkRequest) (*sandboxv1.Sandbox, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.rec.State != records.StateRunning && sb.rec.State != records.StatePaused {
		return nil, errdefs.FailedPrecondition("sandbox %s is %s", sb.id, sb.rec.State)
	}
	if sb.rec.Spec.Network == nil || sb.net == nil {
		return nil, errdefs.FailedPrecondition("sandbox %s has no network (loopback only); a network policy is chosen at create", sb.id)
	}
	old, err := sb.nodeNet.Policy(sb.net)
	if err != nil {
		return nil, err
	}
	p, err := sandboxspec.NetworkUpdate(old, req)
	if err != nil {
		return nil, err
	}
	if err := sb.nodeNet.Node().CheckPolicy("the updated policy's rules", p); err != nil {
		return nil, err
	}
	if err := sb.nodeNet.Update(ctx, sb.net, p); err != nil {
		return nil, errdefs.Wrap(errdefs.ErrUnavailable, err, "update the network policy of %s", sb.id)
	}
	sb.rec.Spec.Network = sandboxspec.NetworkPolicyProto(p, sb.rec.Spec.Network)
	if err := sb.save(); err != nil {
		return nil, err
	}
	sb.log.Info("sandbox network policy updated", "rules", len(p.Rules), "internet", p.Internet)
	return sb.View(), nil
}

// Network is the node's sandbox network as a sandbox uses it
// (sandboxnet.Network).
type Network interface {
	Attach(ctx context.Context, name string, addr netip.Addr, p netpolicy.Policy) (*sandboxnet.Link, error)
	Adopt(ctx context.Context, name string, addr netip.Addr, p netpolicy.Policy) (*sandboxnet.Link, error)
	Policy(l *sandboxnet.Link) (netpolicy.Policy, error)
	Update(ctx context.Context, l *sandboxnet.Link, p netpolicy.Policy) error
	Reset(ctx context.Context, l *sandboxnet.Link) error
	Detach(ctx context.Context, l *sandboxnet.Link) error
	Forget(ctx context.Context, name string) error
	Node() sandboxnet.Node
}
