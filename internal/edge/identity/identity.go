// Package identity is a copy's first request to its agent. A sandbox
// restored from a snapshot, or made from a template, runs with its
// source's hostname, machine id and entropy pool in memory (and, for a
// template's copy, its neutral settings); the edge gives it its own before
// anything else reaches it, and the backend conformance suite does the
// same.
package identity

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"os"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/edge/backend"
)

// Request is the identity of a copy named hostname: a new machine id, 64
// bytes to reseed its entropy pool, settings (nil for a snapshot's copy,
// which keeps its source's) and its network interface (nil for none or
// an unchanged one).
func Request(hostname string, settings *agentv1.SandboxSettings, n *backend.GuestNetwork) *agentv1.SetIdentityRequest {
	machineID, entropy := make([]byte, 16), make([]byte, 64)
	rand.Read(machineID) //nolint:errcheck // crypto/rand does not fail on Linux
	rand.Read(entropy)   //nolint:errcheck // crypto/rand does not fail on Linux
	req := &agentv1.SetIdentityRequest{Hostname: hostname, MachineId: hex.EncodeToString(machineID), Entropy: entropy, Settings: settings}
	if n != nil {
		req.Network = &agentv1.GuestNetwork{Address: n.Address, Gateway: n.Gateway, Mac: n.MAC}
	}
	return req
}

// Settings is what a sandbox made from a template takes from spec in its
// first request: its environment, working directory, /etc/hosts and
// resolv.conf (the template booted with neutral ones).
func Settings(spec *backend.Spec) *agentv1.SandboxSettings {
	st := &agentv1.SandboxSettings{Env: spec.Env, WorkDir: spec.WorkDir}
	if data, err := os.ReadFile(spec.HostsFile); err == nil {
		st.Hosts = string(data)
	}
	if data, err := os.ReadFile(spec.ResolvConf); err == nil {
		st.ResolvConf = string(data)
	}
	return st
}

// Set sends req to the agent over link and says whether the agent
// answered. A refusal is an answer (waiting longer would not change it);
// a link that failed, a deadline or an error the agent's server did not
// classify is not, and the caller may try again.
func Set(ctx context.Context, link http.RoundTripper, req *agentv1.SetIdentityRequest) (answered bool, err error) {
	c := agentv1connect.NewAgentServiceClient(&http.Client{Transport: link}, "http://agent")
	if _, err := c.SetIdentity(ctx, connect.NewRequest(req)); err != nil {
		switch connect.CodeOf(err) {
		case connect.CodeUnavailable, connect.CodeDeadlineExceeded, connect.CodeCanceled, connect.CodeUnknown:
			return false, err
		}
		return true, err
	}
	return true, nil
}
