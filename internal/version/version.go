// Package version is the release every binary of one build reports: the
// daemons in their logs, metrics and status, the agent to its edge, which
// tells a sandbox whose agent is older than the edge it runs under (after
// an upgrade) from the others.
package version

// Version is set at build time:
//
//	go build -ldflags "-X github.com/opendsec/opendsec/internal/version.Version=v1.2.3"
//
// The Makefile sets it from `git describe`; a plain `go build` says "dev".
var Version = "dev"

// Fault, set at build time like Version, makes a build misbehave on
// purpose, for rollout drills (a rollout must catch it and roll back):
// "answer-errors" makes the apiserver answer every call with an internal
// error. Empty in every real build.
var Fault = ""
