// Package errdefs holds the small set of error classes every component uses.
// Errors are classified by wrapping one of these sentinels and checked with
// errors.Is; they are translated to and from RPC codes only in rpc.go.
package errdefs

import (
	"errors"
	"fmt"
	"unicode/utf8"
)

// The classes. Each sentinel's text is the class name; the wrapping error
// carries the detail a user needs (which field, why, what is allowed).
var (
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrPermissionDenied   = errors.New("permission denied")
	ErrUnauthenticated    = errors.New("unauthenticated")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrUnavailable        = errors.New("unavailable")
	ErrUnsupported        = errors.New("unsupported")
	ErrDeadlineExceeded   = errors.New("deadline exceeded")
)

// classed is an error that belongs to a class but prints only its message.
type classed struct {
	class error
	msg   string
	cause error
}

func (e *classed) Error() string {
	if e.cause != nil {
		return e.msg + ": " + e.cause.Error()
	}
	return e.msg
}

func (e *classed) Is(target error) bool { return target == e.class }

func (e *classed) Unwrap() error { return e.cause }

func newf(class error, format string, args ...any) error {
	return &classed{class: class, msg: fmt.Sprintf(format, args...)}
}

// NotFound returns an error of class ErrNotFound with the given message.
func NotFound(format string, args ...any) error { return newf(ErrNotFound, format, args...) }

// AlreadyExists returns an error of class ErrAlreadyExists.
func AlreadyExists(format string, args ...any) error {
	return newf(ErrAlreadyExists, format, args...)
}

// InvalidArgument returns an error of class ErrInvalidArgument. The message
// should name the field, say why it is wrong and what is allowed.
func InvalidArgument(format string, args ...any) error {
	return newf(ErrInvalidArgument, format, args...)
}

// FailedPrecondition returns an error of class ErrFailedPrecondition.
func FailedPrecondition(format string, args ...any) error {
	return newf(ErrFailedPrecondition, format, args...)
}

// PermissionDenied returns an error of class ErrPermissionDenied.
func PermissionDenied(format string, args ...any) error {
	return newf(ErrPermissionDenied, format, args...)
}

// Unauthenticated returns an error of class ErrUnauthenticated.
func Unauthenticated(format string, args ...any) error {
	return newf(ErrUnauthenticated, format, args...)
}

// ResourceExhausted returns an error of class ErrResourceExhausted.
func ResourceExhausted(format string, args ...any) error {
	return newf(ErrResourceExhausted, format, args...)
}

// Unavailable returns an error of class ErrUnavailable.
func Unavailable(format string, args ...any) error { return newf(ErrUnavailable, format, args...) }

// Unsupported returns an error of class ErrUnsupported.
func Unsupported(format string, args ...any) error { return newf(ErrUnsupported, format, args...) }

// Wrap gives cause a class and a message while keeping it in the chain.
func Wrap(class error, cause error, format string, args ...any) error {
	return &classed{class: class, msg: fmt.Sprintf(format, args...), cause: cause}
}

// IsNotFound reports whether err is of class ErrNotFound.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// Clip shortens outside input quoted in an error message to at most n
// bytes (cut at a character boundary), marked with "...": a request cannot
// make its own error large.
func Clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}
