package diskroom

import (
	"errors"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/testutil"
)

// With overcommit, the disk limits admitted add up to the budget (that
// many times the free space) and no further; a limit given back makes
// room again.
func TestOvercommitBoundsTheSumOfLimits(t *testing.T) {
	t.Parallel()
	r, err := New(t.TempDir(), 2, 0, testutil.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	budget := r.BudgetMB()
	if budget <= 0 {
		t.Fatalf("budget %d MiB", budget)
	}
	if err := r.Admit(budget); err != nil {
		t.Fatalf("the whole budget: %v", err)
	}
	if err := r.Admit(1); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node full: disk limits") {
		t.Fatalf("one more MiB: %v, want resource exhausted", err)
	}
	r.Count(-budget)
	if err := r.Admit(1); err != nil {
		t.Fatalf("after the limits went back: %v", err)
	}
}

// Two writes in progress do not both count on the same free space: a
// reservation holds its room until it is released.
func TestAReservationHoldsItsRoomUntilReleased(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	r, err := New(dir, 1, 0, testutil.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	r.SetKeepFree(0)
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	need := int64(st.Bavail) * st.Bsize / 10 * 6 // more than half of what is free
	release, err := r.Reserve(dir, need, "a snapshot")
	if err != nil {
		t.Fatalf("the first write: %v", err)
	}
	if _, err := r.Reserve(dir, need, "a second snapshot"); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node disk full: a second snapshot needs") {
		t.Fatalf("a second write beside the first: %v, want resource exhausted naming it", err)
	}
	release()
	release() // once only
	again, err := r.Reserve(dir, need, "a second snapshot")
	if err != nil {
		t.Fatalf("the second write once the first is released: %v", err)
	}
	again()
}
