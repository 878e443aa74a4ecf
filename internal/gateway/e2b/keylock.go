package e2b

import (
	"crypto/sha256"
	"sync"
)

// keyLocks serializes work on one key while other keys go on in parallel:
// two creates retried at once with the same Idempotency-Key must not both
// find nothing and both create. Entries live only while someone holds or
// waits for them. Across several gateway processes the window stays open;
// one gateway per cluster closes it.
type keyLocks struct {
	mu    sync.Mutex
	locks map[[32]byte]*keyLock
}

type keyLock struct {
	mu   sync.Mutex
	refs int // guarded by keyLocks.mu
}

// lock takes the lock of the key made of parts and returns its release.
// Parts are hashed together, so secrets in them are not kept.
func (k *keyLocks) lock(parts ...string) (unlock func()) {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	var key [32]byte
	copy(key[:], h.Sum(nil))
	k.mu.Lock()
	if k.locks == nil {
		k.locks = make(map[[32]byte]*keyLock)
	}
	l := k.locks[key]
	if l == nil {
		l = &keyLock{}
		k.locks[key] = l
	}
	l.refs++
	k.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		k.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
}
