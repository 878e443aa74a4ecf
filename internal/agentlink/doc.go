// Package agentlink is the channel between an edge and the agent in one
// sandbox [ours]. The edge listens on a Unix socket in a directory that is
// bind-mounted, read-only and root-only, into the sandbox; the agent dials it
// and serves HTTP/2 (prior knowledge) on the connection it made, so the edge is
// the HTTP client. The agent dials again whenever the connection drops, which
// is what lets the channel survive an edge restart and a gVisor
// checkpoint/restore: runsc cannot save a sandbox that holds a host socket, so
// the edge detaches (stops listening, half-closes, waits for the agent to
// close) before a checkpoint, and every restored copy dials its own edge
// socket afterwards.
package agentlink
