package apiserver

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/version"
)

// faultInterceptor answers every call with an internal error in a build
// stamped version.Fault=answer-errors (a rollout drill's bad build); it is
// inside the metrics interceptor, so the errors count as the build's.
type faultInterceptor struct{}

// errBadBuild is unclassified: an internal error.
var errBadBuild = errors.New("a build made to fail (version.Fault=answer-errors)")

func (faultInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	if version.Fault != "answer-errors" {
		return next
	}
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		return nil, errdefs.ToConnect(errBadBuild)
	}
}

func (faultInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (faultInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	if version.Fault != "answer-errors" {
		return next
	}
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return errdefs.ToConnect(errBadBuild)
	}
}
