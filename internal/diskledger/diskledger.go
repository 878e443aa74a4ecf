// Package diskledger lets processes that share a file system count what
// each has promised of its free space [ours].
//
// An edge admits a writable layer only while its disk can hold every layer
// it admitted written in full (internal/edge/diskroom). Several edges on one host
// (the edges of one `dsec up --edges N`, or edge daemons sharing a disk)
// each see the same free space; counting only its own layers, each would
// promise that space again. The ledger is a directory per file system
// (named by its device) with one entry per holder: the bytes it has
// promised and not yet written. A holder checks and raises its promise
// under the ledger's lock, so two admissions never both count on the same
// free space; it lowers it whenever it likes.
//
// A holder keeps an exclusive flock on its entry while it lives; an entry
// whose lock can be taken belongs to a holder that died (kill -9) and is
// removed by the next reader: what that holder's sandboxes wrote is
// already gone from the free space, and it promises the rest again when
// it comes back.
package diskledger

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

const entrySuffix = ".promise"

// Ledger is one holder's place in the ledger of one file system.
type Ledger struct {
	dir    string
	holder string

	mu   sync.Mutex // one operation at a time: flock does not exclude its own descriptor
	lock *os.File   // dir/.lock, flock'd exclusive for each operation
	own  *os.File   // dir/<holder>.promise, flock'd exclusive for life
}

// Open joins the ledger under root of the file system that holds fsDir, as
// holder (a name of letters, digits, '-', '_' and '.'). It fails if a live
// process holds that name.
func Open(root, fsDir, holder string) (*Ledger, error) {
	if holder == "" || strings.ContainsAny(holder, "/\x00") || holder[0] == '.' {
		return nil, fmt.Errorf("disk ledger: holder name %q: want a file name that does not start with '.'", holder)
	}
	var st unix.Stat_t
	if err := unix.Stat(fsDir, &st); err != nil {
		return nil, fmt.Errorf("disk ledger: %s: %w", fsDir, err)
	}
	dir := filepath.Join(root, fmt.Sprintf("%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev)))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("disk ledger: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("disk ledger: %w", err)
	}
	l := &Ledger{dir: dir, holder: holder, lock: lock}
	err = l.locked(func() error {
		own, err := os.OpenFile(l.entry(holder), os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return err
		}
		if err := unix.Flock(int(own.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			own.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return fmt.Errorf("holder %q is in use by a live process", holder)
			}
			return err
		}
		l.own = own
		return l.writeLocked(0)
	})
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("disk ledger %s: %w", dir, err)
	}
	return l, nil
}

// Dir is the ledger's directory (for messages).
func (l *Ledger) Dir() string { return l.dir }

// Raise runs check with what the other live holders have promised, under
// the ledger's lock, and records the promise check returns as this
// holder's. If check fails, the promise stays as it was.
func (l *Ledger) Raise(check func(others int64) (mine int64, err error)) error {
	return l.locked(func() error {
		others, err := l.othersLocked()
		if err != nil {
			return err
		}
		mine, err := check(others)
		if err != nil {
			return err
		}
		return l.writeLocked(mine)
	})
}

// Set records this holder's promise (used to lower it: a raise goes
// through Raise, which checks it against the others).
func (l *Ledger) Set(mine int64) error {
	return l.locked(func() error { return l.writeLocked(mine) })
}

// Others returns what the other live holders have promised.
func (l *Ledger) Others() (int64, error) {
	var others int64
	err := l.locked(func() (err error) {
		others, err = l.othersLocked()
		return err
	})
	return others, err
}

// Close leaves the ledger: this holder's promise is gone.
func (l *Ledger) Close() error {
	err := l.locked(func() error { return os.Remove(l.entry(l.holder)) })
	l.own.Close()
	l.lock.Close()
	return err
}

func (l *Ledger) entry(holder string) string { return filepath.Join(l.dir, holder+entrySuffix) }

func (l *Ledger) locked(fn func() error) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := unix.Flock(int(l.lock.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("disk ledger %s: lock: %w", l.dir, err)
	}
	defer unix.Flock(int(l.lock.Fd()), unix.LOCK_UN) //nolint:errcheck // closing would too
	return fn()
}

func (l *Ledger) writeLocked(mine int64) error {
	if mine < 0 {
		mine = 0
	}
	b := []byte(strconv.FormatInt(mine, 10) + "\n")
	if err := l.own.Truncate(0); err != nil {
		return err
	}
	if _, err := l.own.WriteAt(b, 0); err != nil {
		return err
	}
	return nil
}

// othersLocked sums the live holders' entries but this one, and removes
// the dead ones'.
func (l *Ledger) othersLocked() (int64, error) {
	ents, err := os.ReadDir(l.dir)
	if err != nil {
		return 0, err
	}
	var sum int64
	for _, ent := range ents {
		name, ok := strings.CutSuffix(ent.Name(), entrySuffix)
		if !ok || name == l.holder || name == "" {
			continue
		}
		n, live, err := readEntry(l.entry(name))
		if err != nil {
			return 0, fmt.Errorf("disk ledger: holder %q: %w", name, err)
		}
		if live {
			sum += n
		}
	}
	return sum, nil
}

// readEntry reads a holder's promise; live is false (and the entry
// removed) when no process holds it.
func readEntry(path string) (n int64, live bool, err error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err == nil {
		os.Remove(path) // its holder is gone; callers hold the ledger's lock
		return 0, false, nil
	} else if !errors.Is(err, unix.EWOULDBLOCK) {
		return 0, false, err
	}
	b := make([]byte, 32)
	k, _ := f.ReadAt(b, 0)
	s := strings.TrimSpace(string(b[:k]))
	if s == "" {
		return 0, true, nil // being written: its holder writes under the lock we hold, so only a new entry
	}
	n, err = strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, true, fmt.Errorf("entry %s holds %q, want a count of bytes", path, s)
	}
	return n, true, nil
}
