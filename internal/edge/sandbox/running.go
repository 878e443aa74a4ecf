package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/identity"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// running waits for the agent, gives a restored copy its own identity (a
// new sandbox's came with its agent's command line) and marks it running.
// Callers hold sb.mu.
func (sb *Sandbox) running(ctx context.Context, restored bool) error {
	wait, cancel := context.WithTimeout(ctx, sb.agentTimeout)
	defer cancel()
	ready := agentReady(sb)
	if restored && sb.be.Capabilities().LinkBeforeAgent { // the identity is the first request (one round trip less)
		ready = func(ctx context.Context) error { return sb.link.WaitServingWith(ctx, sb.identityCall()) }
	}
	if err := ready(wait); err != nil {
		if errors.Is(err, errIdentity) {
			return err
		}
		detail := consoleTail(sb.dir)
		if cr, ok := sb.be.(backend.ConsoleReader); ok {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			if t := cr.ConsoleTail(cctx, sb.id); t != "" {
				detail = t
			}
			cancel()
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return errdefs.Unavailable("sandbox %s: the agent did not connect within %s; console: %s", sb.id, sb.agentTimeout, detail)
	}
	if restored && !sb.be.Capabilities().LinkBeforeAgent {
		if err := sb.freshIdentity(ctx); err != nil {
			return err
		}
	}
	sb.settings, sb.guestNet = nil, nil // taken: a later identity is a copy's own
	sb.rec.State = records.StateRunning
	sb.started.Store(time.Now().UnixNano())
	sb.rec.ExpiresAt = time.Now().Add(time.Duration(sb.rec.Spec.TimeoutSeconds) * time.Second)
	sb.expiry.Poke()
	if err := sb.save(); err != nil {
		return err
	}
	sb.RecordMetrics(time.Now()) // the first sample: its use from the start
	return nil
}

// agentReady is how to wait for sb's agent: its connection, or, for a
// backend whose link precedes its agent (a VM's), its first answer.
func agentReady(sb *Sandbox) func(context.Context) error {
	if sb.be.Capabilities().LinkBeforeAgent {
		return sb.link.WaitServing
	}
	return sb.link.WaitReady
}

func consoleTail(dir string) string {
	data, err := os.ReadFile(filepath.Join(dir, "console.log"))
	if err != nil || len(data) == 0 {
		return "(empty)"
	}
	if len(data) > 1024 {
		data = data[len(data)-1024:]
	}
	return strings.TrimSpace(string(data))
}

// newMachineID is a random /etc/machine-id.
func newMachineID() string {
	b := make([]byte, 16)
	rand.Read(b) //nolint:errcheck // crypto/rand does not fail on Linux
	return hex.EncodeToString(b)
}

// freshIdentity gives a restored copy its own hostname
// (also in /etc/hostname, which images ship with their build host's name)
// and machine id, and reseeds its entropy pool. Callers hold sb.mu.
func (sb *Sandbox) freshIdentity(ctx context.Context) error {
	_, err := sb.setIdentity(ctxTimeout(ctx, 10*time.Second))
	return err
}

// errIdentity marks an identity the agent refused (not a link failure).
var errIdentity = errors.New("identity refused")

// setIdentity sends a copy its identity and says whether the agent
// answered (its refusal is an answer, and wraps errIdentity).
func (sb *Sandbox) setIdentity(ctx context.Context) (bool, error) {
	answered, err := identity.Set(ctx, sb.link, identity.Request(string(sb.id), sb.settings, sb.guestNet))
	switch {
	case err == nil:
		return true, nil
	case answered:
		return true, fmt.Errorf("set identity of %s: %w: %w", sb.id, errIdentity, errdefs.FromConnect(err))
	}
	return false, fmt.Errorf("set identity of %s: %w", sb.id, errdefs.FromConnect(err))
}

// identityCall is setIdentity as WaitServingWith's first request.
func (sb *Sandbox) identityCall() func(context.Context) (bool, error) {
	return func(try context.Context) (bool, error) { return sb.setIdentity(try) }
}

// relinkLocked waits, for a VM re-attached while it was stopped, until its
// agent serves the new edge: WaitServing drops a connection that does not
// answer, so the guest sees its host go and opens its port afresh.
// Callers hold sb.mu.
func (sb *Sandbox) relinkLocked(ctx context.Context) error {
	if !sb.relink || sb.link == nil {
		return nil
	}
	wait, cancel := context.WithTimeout(ctx, sb.agentTimeout)
	defer cancel()
	if err := sb.link.WaitServing(wait); err != nil {
		return errdefs.Wrap(errdefs.ErrUnavailable, err, "sandbox %s: its agent does not answer since the edge restarted", sb.id)
	}
	sb.relink = false
	return nil
}
