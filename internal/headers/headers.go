// Package headers names the HTTP headers that route agent calls: a client
// names the sandbox with SandboxID; the apiserver adds Scope, the project
// subtree the caller may reach, after authenticating it. Clients cannot set
// Scope: the apiserver removes it from every incoming request.
package headers

import "strings"

const (
	// SandboxID names the sandbox an agent call is for.
	SandboxID = "Dsec-Sandbox-Id"
	// Scope carries the caller's project path from the apiserver to the edge.
	Scope = "Dsec-Scope"
	// NoResume ("1") asks the edge not to resume a paused sandbox for this
	// call but to fail it with FailedPrecondition: a liveness probe must not
	// wake what it probes.
	NoResume = "Dsec-No-Resume"
	// AgentPathPrefix starts every agent RPC path.
	AgentPathPrefix = "/opendsec.agent.v1."
	// SandboxPort, from the apiserver to the edge, marks an HTTP request
	// for a port inside the sandbox SandboxID names.
	SandboxPort = "Dsec-Sandbox-Port"
	// Public ("1"), from the apiserver to the edge, marks a port request
	// that carried no credentials: only a sandbox that allows public
	// traffic answers it.
	Public = "Dsec-Public"
	// HostTime is the node's clock (Unix nanoseconds) on every request the
	// edge sends an agent: an agent whose clock stops when its sandbox is
	// paused (a VM's) steps its clock to it.
	HostTime = "Dsec-Host-Time"
)

// Internal are the headers only the apiserver may set: it removes them
// from every incoming request.
var Internal = []string{Scope, SandboxPort, Public, HostTime}

// IsAgentPath reports whether an HTTP path is an agent RPC.
func IsAgentPath(p string) bool { return strings.HasPrefix(p, AgentPathPrefix) }
