package sandbox

import (
	"context"
	"fmt"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/identity"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/netpolicy"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// A warm pool's sandbox [ours; issue 28] is started ahead of any create,
// with a spec of its image and shape, for a project of no one's, and
// counted by its pool, not the node's registry. A create of that image
// and shape claims it instead of starting one: what a create sets that
// is not its image and shape is either the record's (project, spec,
// metadata, time to live, task) or its agent's defaults for the processes
// it starts (environment, directory), which the claim's one request
// sets. Its hostname and machine id were its own from its start. A
// pool's sandbox with a network waits with a policy that lets nothing
// out; the claim gives it the create's before the create sees it.

// claimWait bounds a claim's one request: a pool's sandbox whose agent
// does not answer within it is taken for dead (the health checks find a
// dead one within seconds, not at once), and the create starts one of its
// own.
const claimWait = 3 * time.Second

// Claim makes sb, a pool's sandbox that runs and is registered nowhere,
// the sandbox of spec (of sb's image im and shape) in project, settling
// reservation: its agent takes spec's defaults, admit registers it (with
// its new record: the node's admission, under sb's lock, so nothing sees
// it half claimed), and host is then what it reaches of the edge. On an
// error sb is still the pool's, to be removed.
func (sb *Sandbox) Claim(ctx context.Context, spec *sandboxv1.SandboxSpec, project, reservation string, im *image.Image, host Host, admit func() error) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.removed || sb.rec.State != records.StateRunning || sb.link == nil {
		return errdefs.FailedPrecondition("pooled sandbox %s is %s", sb.id, sb.rec.State)
	}
	claimed := *sb.rec
	claimed.Project, claimed.Reservation = project, reservation
	if err := claimed.SetSpec(spec); err != nil {
		return err
	}
	// Its agent's defaults: the environment a create of spec starts with
	// (the image's, spec's, the sandbox id, the image's USER) and the
	// image's directory. Its hosts and resolv.conf are already its own.
	settings := identity.Settings(sb.parts.backendSpec(&claimed, sb.dir, sb.runDir, nil, im.Config.Config))
	settings.Hosts, settings.ResolvConf = "", ""
	req := identity.Request(string(sb.id), settings, nil)
	answered, err := identity.Set(ctxTimeout(ctx, claimWait), sb.link, req)
	if err != nil {
		if answered {
			return fmt.Errorf("claim pooled sandbox %s: %w: %w", sb.id, errIdentity, errdefs.FromConnect(err))
		}
		return fmt.Errorf("claim pooled sandbox %s: %w", sb.id, errdefs.FromConnect(err))
	}
	if spec.Network != nil {
		if err := sb.claimNetwork(ctx, spec.Network); err != nil {
			return fmt.Errorf("claim pooled sandbox %s: %w", sb.id, err)
		}
	}
	now := time.Now()
	claimed.CreatedAt = now
	claimed.ExpiresAt = now.Add(time.Duration(spec.TimeoutSeconds) * time.Second)
	pooled, pooledProj := *sb.rec, sb.proj
	*sb.rec, sb.proj = claimed, project
	err = sb.save() // before it is admitted: a restarted edge must not pool it again
	if err == nil {
		err = admit()
	}
	if err != nil {
		saved := err
		*sb.rec, sb.proj = pooled, pooledProj
		if err := sb.save(); err != nil { // the pool's again, on disk too
			sb.log.Warn("record a pooled sandbox's failed claim", logging.Error, err)
		}
		if spec.Network != nil && sb.net != nil {
			// Still the pool's, to be removed: with nothing let out
			// until then, not its claimer's policy.
			if err := sb.nodeNet.Update(context.WithoutCancel(ctx), sb.net, netpolicy.Policy{}); err != nil {
				sb.log.Warn("put a pooled sandbox's deny-all policy back after a failed claim", logging.Error, err)
			}
		}
		return saved
	}
	sb.host = host
	// What it used and did while it waited in the pool is nobody's.
	sb.metrics.forget()
	sb.limits.reset()
	sb.started.Store(now.UnixNano())
	sb.expiry.Poke()
	sb.publish()
	return nil
}

// claimNetwork gives a pool's networked sandbox the policy a create asked
// for (checked by the create). Callers hold sb.mu.
func (sb *Sandbox) claimNetwork(ctx context.Context, policy *sandboxv1.NetworkPolicy) error {
	if sb.net == nil {
		return errdefs.FailedPrecondition("it has no network attachment")
	}
	p, err := sandboxspec.NetworkPolicy(policy)
	if err != nil {
		return err
	}
	return sb.nodeNet.Update(ctx, sb.net, p)
}
