package sandbox

import (
	"context"
	"sync/atomic"
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

// AcquireCall takes one of sb's call slots, waiting as above; the release
// function gives it back. A call that waited for its slot is refused too
// if what is left of its deadline is less than twice what sb's calls have
// been taking (callTimes; twice, for how much slower they get while a
// flood is refused around them): served, it would run into its deadline
// (a microVM under TCG answered 10 of 500 such calls too late).
func (sb *Sandbox) AcquireCall(ctx context.Context) (release func(), err error) {
	start := time.Now()
	release = func() {
		sb.callTimes.observe(time.Since(start))
		<-sb.slots
	}
	select {
	case sb.slots <- struct{}{}:
		return release, nil
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
		if d, ok := ctx.Deadline(); ok {
			if typical := sb.callTimes.typical(); typical > 0 && time.Until(d) < 2*typical {
				<-sb.slots
				return nil, errdefs.ResourceExhausted("sandbox %s: its calls take about %s now and this one has %s left of its deadline after waiting %s for one of its %d call slots; retry after %d s, or send fewer at once",
					sb.id, typical.Round(time.Millisecond), time.Until(d).Round(time.Millisecond), time.Since(start).Round(time.Millisecond), cap(sb.slots), RetryAfter)
			}
		}
		start = time.Now()
		return release, nil
	case <-ctx.Done():
		return nil, errdefs.Wrap(errdefs.ErrDeadlineExceeded, ctx.Err(), "sandbox %s: waiting for one of its %d call slots", sb.id, cap(sb.slots))
	case <-timer.C:
		return nil, errdefs.ResourceExhausted("sandbox %s: %d calls in flight, the most its backend serves at once, and none ended within %s; retry after %d s, or send fewer at once",
			sb.id, cap(sb.slots), wait.Round(time.Millisecond), RetryAfter)
	}
}

// callTimes follows how long a sandbox's unary calls hold their slot: a
// moving average that weighs the latest call an eighth.
type callTimes struct{ avg atomic.Int64 } // nanoseconds

func (c *callTimes) observe(d time.Duration) {
	for {
		old := c.avg.Load()
		next := int64(d)
		if old > 0 {
			next = old - old/8 + int64(d)/8
		}
		if c.avg.CompareAndSwap(old, next) {
			return
		}
	}
}

// typical is the average; 0 before any call ended.
func (c *callTimes) typical() time.Duration { return time.Duration(c.avg.Load()) }
