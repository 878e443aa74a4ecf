package e2b

import (
	"sync"
	"sync/atomic"
	"testing"
)

func TestKeyLocksSerializeOneKeyAndForgetIt(t *testing.T) {
	t.Parallel()
	var k keyLocks
	var inside, most atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			unlock := k.lock("key-a", "idem-1")
			n := inside.Add(1)
			for {
				m := most.Load()
				if n <= m || most.CompareAndSwap(m, n) {
					break
				}
			}
			inside.Add(-1)
			unlock()
		}()
	}
	wg.Wait()
	if most.Load() != 1 {
		t.Fatalf("%d holders of one key at once", most.Load())
	}
	// Another key is not blocked by a held one.
	unlock := k.lock("key-a", "idem-1")
	k.lock("key-b", "idem-1")()
	k.lock("key-a", "idem-2")()
	unlock()
	if len(k.locks) != 0 {
		t.Fatalf("%d locks kept after every holder left", len(k.locks))
	}
}
