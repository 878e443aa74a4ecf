package errdefs

import (
	"context"
	"errors"
	"math"
	"strconv"
	"time"

	"connectrpc.com/connect"
)

// classes maps every class to its Connect code. It is the one place where
// errors become RPC codes and back.
var classes = []struct {
	class error
	code  connect.Code
}{
	{ErrNotFound, connect.CodeNotFound},
	{ErrAlreadyExists, connect.CodeAlreadyExists},
	{ErrInvalidArgument, connect.CodeInvalidArgument},
	{ErrFailedPrecondition, connect.CodeFailedPrecondition},
	{ErrPermissionDenied, connect.CodePermissionDenied},
	{ErrUnauthenticated, connect.CodeUnauthenticated},
	{ErrResourceExhausted, connect.CodeResourceExhausted},
	{ErrUnavailable, connect.CodeUnavailable},
	{ErrUnsupported, connect.CodeUnimplemented},
	{ErrDeadlineExceeded, connect.CodeDeadlineExceeded},
}

// Code returns the Connect code for err: its class's code, the code of a
// Connect error it wraps, or CodeInternal.
func Code(err error) connect.Code {
	if err == nil {
		return 0
	}
	for _, c := range classes {
		if errors.Is(err, c.class) {
			return c.code
		}
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	}
	return connect.CodeInternal
}

// RetryHeader ("1") on an error's metadata says the same request, sent
// again as it is, may succeed (e.g. a create whose idempotency key is
// being taken over): clients retry it; other errors of the same code,
// such as a service that never got ready, they do not.
const RetryHeader = "Dsec-Retry"

// retry marks an error as worth sending the request again for.
type retry struct{ error }

func (r retry) Unwrap() error { return r.error }

// Retry marks err so ToConnect sets RetryHeader.
func Retry(err error) error { return retry{err} }

// RetryAfterHeader, beside RetryHeader, says how long to wait before
// sending the request again, in whole seconds as HTTP's Retry-After: a
// node that is full now may have room once sandboxes end, so a burst past
// it backs off instead of failing.
const RetryAfterHeader = "Retry-After"

// retryAfter marks an error as worth sending again after a pause.
type retryAfter struct {
	error
	after time.Duration
}

func (r retryAfter) Unwrap() error { return r.error }

// RetryAfter marks err so ToConnect sets RetryHeader and RetryAfterHeader
// (after rounded up to whole seconds, at least one).
func RetryAfter(err error, after time.Duration) error { return retryAfter{err, after} }

// RetryDelay is the pause RetryAfter marked err with.
func RetryDelay(err error) (time.Duration, bool) {
	var r retryAfter
	if errors.As(err, &r) {
		return r.after, true
	}
	return 0, false
}

// retryAfterSeconds is after as the header's whole seconds.
func retryAfterSeconds(after time.Duration) string {
	return strconv.Itoa(max(1, int(math.Ceil(after.Seconds()))))
}

// ItemError is err as a per-item result (a fork's copy, one sandbox of a
// task-wide call) carries it: the name of its RPC code, as Connect spells
// it ("resource_exhausted"), and its message; both "" for nil.
func ItemError(err error) (code, message string) {
	if err == nil {
		return "", ""
	}
	ce := ToConnect(err).(*connect.Error)
	return ce.Code().String(), ce.Message()
}

// ItemCode is the RPC code an item's error code names; CodeUnknown for a
// name it does not know.
func ItemCode(name string) connect.Code {
	var c connect.Code
	if err := c.UnmarshalText([]byte(name)); err != nil {
		return connect.CodeUnknown
	}
	return c
}

// ToConnect turns err into a *connect.Error with its class's code. A Connect
// error passes through unchanged so codes survive proxying.
func ToConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) && !hasClass(err) {
		return ce
	}
	out := connect.NewError(Code(err), errors.New(err.Error()))
	var r retry
	if errors.As(err, &r) {
		out.Meta().Set(RetryHeader, "1")
	}
	if after, ok := RetryDelay(err); ok {
		out.Meta().Set(RetryHeader, "1")
		out.Meta().Set(RetryAfterHeader, retryAfterSeconds(after))
	}
	return out
}

// FromConnect turns an error returned by a Connect client back into a classed
// error, keeping the server's message.
func FromConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	for _, c := range classes {
		if c.code == ce.Code() {
			return &classed{class: c.class, msg: ce.Message()}
		}
	}
	return err
}

func hasClass(err error) bool {
	for _, c := range classes {
		if errors.Is(err, c.class) {
			return true
		}
	}
	return false
}

// Interceptor converts handler errors with ToConnect, so handlers return
// plain classed errors.
func Interceptor() connect.Interceptor { return interceptor{} }

type interceptor struct{}

func (interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		return resp, ToConnect(err)
	}
}

func (interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return ToConnect(next(ctx, conn))
	}
}
