package sandboxnet

import (
	"context"
	"strings"
	"sync"
	"time"
)

// A run of nft costs far more than the few rules a sandbox's update adds:
// a process, and a read of the node's chains and sets, which grows with
// the node's sandboxes. On this 2-core VM with 1,000 sandboxes attached, a
// sandbox's chain took 9.8 ms of CPU in a run of its own and 1.5 ms in a
// run of eight. So sandboxes' updates that arrive while a run is on wait
// for it and go together in the next run, one transaction (group commit):
// nothing waits when the node is idle, and a burst pays for one run per
// batch. If a batch fails, its scripts run again one by one, in the order
// they came, so each gets the answer it would have had alone.

// maxBatch bounds the scripts of one run.
const maxBatch = 64

// nftTimeout bounds one run (the callers' contexts do not end a run that
// carries other callers' scripts).
const nftTimeout = time.Minute

// The runs are made by the callers themselves, on their own threads (a
// test's node is a namespace a thread entered; nft acts on the namespace of
// the thread that starts it): a caller that finds no run on takes the
// queue and runs it; when that run ends, the first script still queued
// wakes to take the next batch, which holds it. So every caller runs at
// most the one batch its own script is in.
type nftBatch struct {
	run func(ctx context.Context, script string) error // nft; a test's fake

	mu      sync.Mutex
	queue   []*nftJob // guarded by mu
	running bool      // guarded by mu: a caller is running a batch
}

type nftJob struct {
	script string
	done   chan nftOutcome // one outcome, buffered
}

// nftOutcome is a script's error, or word that its caller runs the next
// batch.
type nftOutcome struct {
	err  error
	lead bool
}

func newNFTBatch(run func(ctx context.Context, script string) error) *nftBatch {
	return &nftBatch{run: run}
}

// do runs script in the next run of nft, with what else comes meanwhile,
// and returns its own outcome.
func (b *nftBatch) do(script string) error {
	j := &nftJob{script: script, done: make(chan nftOutcome, 1)}
	b.mu.Lock()
	b.queue = append(b.queue, j)
	lead := !b.running
	b.running = true
	b.mu.Unlock()
	if !lead {
		if o := <-j.done; !o.lead {
			return o.err
		}
	}
	// j is first in the queue: the batch taken holds it.
	b.mu.Lock()
	jobs := b.queue
	if len(jobs) > maxBatch {
		jobs = jobs[:maxBatch:maxBatch]
	}
	b.queue = b.queue[len(jobs):]
	b.mu.Unlock()
	b.runJobs(jobs)
	b.mu.Lock()
	if len(b.queue) == 0 {
		b.queue, b.running = nil, false
	} else {
		b.queue[0].done <- nftOutcome{lead: true}
	}
	b.mu.Unlock()
	return (<-j.done).err
}

func (b *nftBatch) runJobs(jobs []*nftJob) {
	if len(jobs) > 1 {
		var all strings.Builder
		for _, j := range jobs {
			all.WriteString(j.script)
			if !strings.HasSuffix(j.script, "\n") {
				all.WriteByte('\n')
			}
		}
		if err := b.runOne(all.String()); err == nil {
			for _, j := range jobs {
				j.done <- nftOutcome{}
			}
			return
		}
	}
	for _, j := range jobs {
		j.done <- nftOutcome{err: b.runOne(j.script)}
	}
}

func (b *nftBatch) runOne(script string) error {
	ctx, cancel := context.WithTimeout(context.Background(), nftTimeout)
	defer cancel()
	return b.run(ctx, script)
}
