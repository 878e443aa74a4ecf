package aether

import (
	"sync"

	"golang.org/x/sys/unix"
)

// spareThreads is how many OS threads the agent starts before any
// sandbox process runs.
const spareThreads = 8

// warmThreads makes the Go runtime start n OS threads now, which it then
// keeps parked and reuses. The agent shares its sandbox's task limit: a
// fork bomb takes every task the limit allows within milliseconds, and a
// runtime that then needs one more thread (a goroutine blocked in a system
// call, such as wait4) cannot make it and aborts the agent ("failed to
// create new OS thread"). Seen once in a fresh make test
// (TestHostileSandboxes/container/fork_bomb: the agent's connection ended
// 0.26 s into the bomb). Each goroutine below blocks in a system call at
// the same time, so each holds a thread of its own.
func warmThreads(n int) {
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ts := unix.NsecToTimespec(20e6)
			unix.Nanosleep(&ts, nil) //nolint:errcheck // only holds the thread
		}()
	}
	wg.Wait()
}
