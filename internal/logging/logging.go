// Package logging holds the stable attribute keys and logger helpers shared by
// every component. Loggers are passed into constructors; nil means discard.
package logging

import (
	"io"
	"log/slog"
	"os"
)

// Attribute keys used across components.
const (
	SandboxID  = "sandbox_id"
	SnapshotID = "snapshot_id"
	NodeID     = "node_id"
	Project    = "project"
	Backend    = "backend"
	Image      = "image"
	RequestID  = "request_id"
	Component  = "component"
	Error      = "err"
)

// OrDiscard returns l, or a logger that drops everything when l is nil.
func OrDiscard(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return l
}

// New returns a logger writing text (dev) or JSON to stderr at the level.
func New(format string, level slog.Level) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}
