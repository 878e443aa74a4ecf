package sandboxnet

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeNFT records the scripts of each run; a run blocks until released
// while gate is set, and a script containing "bad" fails.
type fakeNFT struct {
	mu   sync.Mutex
	runs []string
	gate chan struct{}
}

func (f *fakeNFT) run(_ context.Context, script string) error {
	f.mu.Lock()
	f.runs = append(f.runs, script)
	gate := f.gate
	f.mu.Unlock()
	if gate != nil {
		<-gate
	}
	if strings.Contains(script, "bad") {
		return errors.New("nft: " + strings.TrimSpace(script) + ": bad")
	}
	return nil
}

func (f *fakeNFT) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.runs)
}

func TestNFTBatchRunsAloneWhenIdleAndTogetherUnderLoad(t *testing.T) {
	f := &fakeNFT{}
	b := newNFTBatch(f.run)
	if err := b.do("add a\n"); err != nil || f.count() != 1 || f.runs[0] != "add a\n" {
		t.Fatalf("alone: %v, runs %q", err, f.runs)
	}
	// One run held; ten more scripts arrive meanwhile: one run takes them.
	f.gate = make(chan struct{})
	first := make(chan error, 1)
	go func() { first <- b.do("add first\n") }()
	waitFor(t, func() bool { return f.count() == 2 })
	var wg sync.WaitGroup
	errs := make([]error, 10)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = b.do(fmt.Sprintf("add s%d", i)) }()
	}
	waitFor(t, func() bool { b.mu.Lock(); defer b.mu.Unlock(); return len(b.queue) == 10 })
	close(f.gate)
	wg.Wait()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for i, err := range errs {
		if err != nil {
			t.Errorf("script %d: %v", i, err)
		}
	}
	if f.count() != 3 {
		t.Fatalf("runs %q: want the held one and one for the ten that waited", f.runs)
	}
	for i := range errs {
		if !strings.Contains(f.runs[2], fmt.Sprintf("add s%d\n", i)) {
			t.Errorf("the batch %q lacks script %d (or its line end)", f.runs[2], i)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.running || len(b.queue) != 0 {
		t.Errorf("after the burst: running %v, queue %d; want idle", b.running, len(b.queue))
	}
}

func TestNFTBatchGivesAFailingScriptItsOwnError(t *testing.T) {
	f := &fakeNFT{gate: make(chan struct{})}
	b := newNFTBatch(f.run)
	first := make(chan error, 1)
	go func() { first <- b.do("add held\n") }()
	waitFor(t, func() bool { return f.count() == 1 })
	scripts := []string{"add ok1\n", "add bad\n", "add ok2\n"}
	errs := make([]error, len(scripts))
	var wg sync.WaitGroup
	for i, s := range scripts {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = b.do(s) }()
		waitFor(t, func() bool { b.mu.Lock(); defer b.mu.Unlock(); return len(b.queue) == i+1 })
	}
	close(f.gate)
	wg.Wait()
	<-first
	if errs[0] != nil || errs[2] != nil || errs[1] == nil || !strings.Contains(errs[1].Error(), "add bad") {
		t.Errorf("outcomes %v: want the bad script's own error and the others fine", errs)
	}
	// The held run, the failed batch, then each script alone in order.
	want := []string{"add held\n", "add ok1\nadd bad\nadd ok2\n", "add ok1\n", "add bad\n", "add ok2\n"}
	if fmt.Sprint(f.runs) != fmt.Sprint(want) {
		t.Errorf("runs %q, want %q", f.runs, want)
	}
}

func TestNFTBatchBoundsABatch(t *testing.T) {
	f := &fakeNFT{gate: make(chan struct{})}
	b := newNFTBatch(f.run)
	first := make(chan error, 1)
	go func() { first <- b.do("add held\n") }()
	waitFor(t, func() bool { return f.count() == 1 })
	n := maxBatch + 5
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); _ = b.do(fmt.Sprintf("add s%d\n", i)) }()
	}
	waitFor(t, func() bool { b.mu.Lock(); defer b.mu.Unlock(); return len(b.queue) == n })
	close(f.gate)
	wg.Wait()
	<-first
	if f.count() != 3 || strings.Count(f.runs[1], "\n") != maxBatch || strings.Count(f.runs[2], "\n") != 5 {
		t.Errorf("%d runs; want the held one, one of %d and one of 5", f.count(), maxBatch)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 10 s")
		}
		time.Sleep(time.Millisecond)
	}
}
