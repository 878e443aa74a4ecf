package chronus

import "sync"

// ringLog is an append-only byte log that keeps only its newest max bytes.
// Offsets count every byte ever written, so a reader can resume and can tell
// how much it missed.
type ringLog struct {
	mu    sync.Mutex
	max   int
	first int64  // guarded by mu: offset of data[0]
	data  []byte // guarded by mu
}

func newRingLog(max int) *ringLog { return &ringLog{max: max} }

// write appends p and returns the offset it starts at.
func (r *ringLog) write(p []byte) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	off := r.first + int64(len(r.data))
	if len(p) >= r.max {
		r.first = off + int64(len(p)) - int64(r.max)
		r.data = append(r.data[:0], p[len(p)-r.max:]...)
		return off
	}
	if over := len(r.data) + len(p) - r.max; over > 0 {
		// Drop at least a quarter at a time so appends stay amortised O(1).
		drop := max(over, r.max/4)
		drop = min(drop, len(r.data))
		r.data = append(r.data[:0], r.data[drop:]...)
		r.first += int64(drop)
	}
	r.data = append(r.data, p...)
	return off
}

// read returns up to limit bytes from offset, the next offset and the oldest
// offset kept. An offset before the oldest is moved up to it.
func (r *ringLog) read(offset int64, limit int) (data []byte, next, first int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	end := r.first + int64(len(r.data))
	if offset < r.first {
		offset = r.first
	}
	if offset > end {
		offset = end
	}
	start := int(offset - r.first)
	stop := min(len(r.data), start+limit)
	return append([]byte(nil), r.data[start:stop]...), offset + int64(stop-start), r.first
}
