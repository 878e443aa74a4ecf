package edge

import (
	"context"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// A sandbox serves a bounded number of unary agent calls at once [ours].
// gVisor's ptrace platform answered 155 of 2,000 concurrent execs and let
// the rest run into their deadlines after 80-127 s; past what a backend
// serves at once, more concurrency only makes every call slower. A call
// beyond the bound waits for a slot for at most callQueueWait (less if its
// own deadline is nearer: half of what is left of it, so the refusal
// reaches the caller in time), then is refused with resource-exhausted and
// a retry hint, instead of a wait that ends in a timeout.
// Streams (a process's output, a watch) are not counted: they live as long
// as what they follow.

// DefaultConcurrentCalls is the bound of a backend that sets none.
const DefaultConcurrentCalls = 1024

// callQueueWait is the longest a call waits for a slot.
const callQueueWait = 60 * time.Second

// RetryAfter is the hint, in seconds, of a call refused for want of a slot.
const RetryAfter = 1

// filesPerCall is about what one exec holds of the agent's open files at
// its peak (its pipes, the child's, the stream's): the agent shares the
// sandbox's open_files with its processes, so a sandbox of 1,024 serves
// some 40 execs at once before a pipe fails with EMFILE.
const filesPerCall = 32

// callSlots returns the semaphore of a sandbox's unary calls: its
// backend's bound n (or the default), and no more than its open files
// serve.
func callSlots(n int, openFiles int64) chan struct{} {
	if n <= 0 {
		n = DefaultConcurrentCalls
	}
	if openFiles > 0 {
		n = min(n, max(8, int(openFiles/filesPerCall)))
	}
	return make(chan struct{}, n)
}

// acquireCall takes one of sb's call slots, waiting as above; the release
// function gives it back.
func (sb *sandbox) acquireCall(ctx context.Context) (release func(), err error) {
	select {
	case sb.slots <- struct{}{}:
		return func() { <-sb.slots }, nil
	default:
	}
	wait := callQueueWait
	if d, ok := ctx.Deadline(); ok {
		// Leave the call time to be answered with the refusal.
		wait = min(wait, time.Until(d)/2)
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case sb.slots <- struct{}{}:
		return func() { <-sb.slots }, nil
	case <-ctx.Done():
		return nil, errdefs.Wrap(errdefs.ErrDeadlineExceeded, ctx.Err(), "sandbox %s: waiting for one of its %d call slots", sb.id, cap(sb.slots))
	case <-timer.C:
		return nil, errdefs.ResourceExhausted("sandbox %s: %d calls in flight, the most its backend serves at once, and none ended within %s; retry after %d s, or send fewer at once",
			sb.id, cap(sb.slots), wait.Round(time.Millisecond), RetryAfter)
	}
}
