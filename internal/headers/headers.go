// Package headers names the HTTP headers that route agent calls: a client
// names the sandbox with SandboxID; the apiserver adds Scope, the project
// subtree the caller may reach, after authenticating it. Clients cannot set
// Scope: the apiserver removes it from every incoming request.
package headers

import (
	"strconv"
	"strings"
)

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
	// LimitEvents, on every answer of an agent, counts what the sandbox's
	// limits ended or refused inside it so far (FormatLimitEvents); the
	// edge takes it off the answer.
	LimitEvents = "Dsec-Limit-Events"
)

// FormatLimitEvents is LimitEvents' value: processes ended at the memory
// limit and forks refused at the task limit.
func FormatLimitEvents(oomKills, forksRefused int64) string {
	return "oom_kills=" + strconv.FormatInt(oomKills, 10) + " forks_refused=" + strconv.FormatInt(forksRefused, 10)
}

// ParseLimitEvents reads LimitEvents' value; ok is false if it is not one.
func ParseLimitEvents(v string) (oomKills, forksRefused int64, ok bool) {
	var hasOOM, hasForks bool
	for _, f := range strings.Fields(v) {
		k, val, found := strings.Cut(f, "=")
		n, err := strconv.ParseInt(val, 10, 64)
		if !found || err != nil || n < 0 {
			return 0, 0, false
		}
		switch {
		case k == "oom_kills" && !hasOOM:
			oomKills, hasOOM = n, true
		case k == "forks_refused" && !hasForks:
			forksRefused, hasForks = n, true
		case k == "oom_kills" || k == "forks_refused":
			return 0, 0, false // said twice
		}
	}
	if !hasOOM || !hasForks {
		return 0, 0, false
	}
	return oomKills, forksRefused, true
}

// Internal are the headers only the apiserver may set: it removes them
// from every incoming request.
var Internal = []string{Scope, SandboxPort, Public, HostTime}

// IsAgentPath reports whether an HTTP path is an agent RPC.
func IsAgentPath(p string) bool { return strings.HasPrefix(p, AgentPathPrefix) }
