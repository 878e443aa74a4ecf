package apiserver

import (
	"errors"
	"testing"
)

var errOver = errors.New("over")

// budget registers a budget of proj with what its quotas left.
func budget(h *storageHolds, proj string, limits ...storageLimit) *storageBudget {
	b := &storageBudget{holds: h, proj: proj, limits: limits, over: func(int64) error { return errOver }}
	h.begin(b)
	return b
}

// Budgets at once count each other's holds against every quota they share,
// and one that began before another ended counts what that one stored;
// one that began after does not (its count of the store has it).
func TestStorageHoldsCountEachOther(t *testing.T) {
	t.Parallel()
	h := newStorageHolds()
	const mib = 1 << 20
	a := budget(h, "root/p/a", storageLimit{"root/p/a", 4 * mib}, storageLimit{"root/p", 3 * mib})
	b := budget(h, "root/p/b", storageLimit{"root/p", 3 * mib})
	other := budget(h, "root/q", storageLimit{"root/q", 3 * mib})
	if err := a.take(2 * mib); err != nil {
		t.Fatal(err)
	}
	if err := other.take(3 * mib); err != nil {
		t.Fatalf("another subtree's quota saw root/p's hold: %v", err)
	}
	if err := b.take(2 * mib); err != errOver {
		t.Fatalf("2 MiB beside a hold of 2 MiB in a 3 MiB quota: %v, want over", err)
	}
	if err := b.take(1 * mib); err != nil {
		t.Fatalf("1 MiB beside 2 MiB in 3 MiB: %v", err)
	}
	if err := a.take(1 * mib); err != nil {
		t.Fatalf("a take below what it holds: %v", err)
	}
	a.done()
	if err := b.take(2 * mib); err != errOver {
		t.Fatalf("after the other ended, its 2 MiB (stored since b began) is not counted: %v", err)
	}
	late := budget(h, "root/p/c", storageLimit{"root/p", 2 * mib}) // its count of the store has a's 2 MiB
	if err := late.take(1 * mib); err != nil {
		t.Fatalf("a budget that began after a's end counted a's bytes twice: %v", err)
	}
	if err := late.take(2 * mib); err != errOver {
		t.Fatalf("b's hold of 1 MiB is not counted for a later budget: %v", err)
	}
	b.done()
	if err := late.take(2 * mib); err != errOver {
		t.Fatalf("b ended after the later budget began, and its 1 MiB was dropped: %v", err)
	}
	late.done()
	other.done()
	if len(h.active) != 0 || len(h.finished) != 0 {
		t.Fatalf("holds kept after every budget ended: %d active, %d ended", len(h.active), len(h.finished))
	}
}
