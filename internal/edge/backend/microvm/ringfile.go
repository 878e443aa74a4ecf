package microvm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// ringFile is a file of fixed size that keeps the last bytes written to
// it: a header, then the ring. The header holds a sequence number, odd
// while a write is under way, and how many bytes were ever written;
// readers retry while it is odd or moved under them. One writer holds the
// file's lock. The ring survives its writer's end (kill -9 included):
// after a crash in a write, the next writer evens the sequence, and the
// ring may hold a few bytes out of order, which a console can bear.
type ringFile struct {
	f       *os.File
	size    int64
	seq     uint64
	written uint64
}

const ringHeader = 16 // sequence, written: little-endian uint64s

// errRingBusy: another writer holds the ring.
var errRingBusy = errors.New("ring: another writer holds it")

// openRing takes the ring at path for writing, making it (or remaking it,
// if it is not a ring of size) as needed; its blocks are allocated, so a
// full disk cannot stop its writes. It waits up to wait for another writer
// to let go, then answers errRingBusy.
func openRing(path string, size int64, wait time.Duration) (*ringFile, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	for deadline := time.Now().Add(wait); ; time.Sleep(10 * time.Millisecond) {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) || !time.Now().Before(deadline) {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return nil, errRingBusy
			}
			return nil, fmt.Errorf("ring %s: %w", path, err)
		}
	}
	r := &ringFile{f: f, size: size}
	var hdr [ringHeader]byte
	if st, err := f.Stat(); err == nil && st.Size() == ringHeader+size {
		if _, err := f.ReadAt(hdr[:], 0); err == nil {
			r.seq = binary.LittleEndian.Uint64(hdr[:8]) &^ 1 // a write cut by a crash ends here
			r.written = binary.LittleEndian.Uint64(hdr[8:])
			return r, nil
		}
	}
	err = f.Truncate(0)
	if err == nil {
		err = unix.Fallocate(int(f.Fd()), 0, 0, ringHeader+size)
		if errors.Is(err, unix.EOPNOTSUPP) {
			err = f.Truncate(ringHeader + size)
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("ring %s: %w", path, err)
	}
	return r, nil
}

// Write keeps the end of p in the ring; it never grows the file.
func (r *ringFile) Write(p []byte) (int, error) {
	n := len(p)
	if err := r.header(r.seq + 1); err != nil { // odd: under way
		return 0, err
	}
	if int64(len(p)) > r.size {
		r.written += uint64(int64(len(p)) - r.size)
		p = p[int64(len(p))-r.size:]
	}
	for len(p) > 0 {
		off := int64(r.written % uint64(r.size))
		k := min(int64(len(p)), r.size-off)
		if _, err := r.f.WriteAt(p[:k], ringHeader+off); err != nil {
			return 0, err
		}
		r.written += uint64(k)
		p = p[k:]
	}
	if err := r.header(r.seq + 2); err != nil {
		return 0, err
	}
	r.seq += 2
	return n, nil
}

// header writes the header with sequence seq.
func (r *ringFile) header(seq uint64) error {
	var hdr [ringHeader]byte
	binary.LittleEndian.PutUint64(hdr[:8], seq)
	binary.LittleEndian.PutUint64(hdr[8:], r.written)
	_, err := r.f.WriteAt(hdr[:], 0)
	return err
}

// readRingWait bounds how long a read waits for a live writer to leave
// the ring still; after it the read is taken as it is.
const readRingWait = 2 * time.Second

// readRingPause is the pause between tries: short, as a writer's write is.
const readRingPause = 500 * time.Microsecond

// ringWriterLives: a writer holds the ring's lock. The probe takes a
// shared lock for an instant; a writer opening the ring then retries.
func ringWriterLives(f *os.File) bool {
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != nil {
		return errors.Is(err, unix.EWOULDBLOCK)
	}
	unix.Flock(int(f.Fd()), unix.LOCK_UN) //nolint:errcheck // closing the file lets it go too
	return false
}

// Close lets the ring go.
func (r *ringFile) Close() error { return r.f.Close() }

// readRing is the ring's content, oldest byte first; a missing file is
// an empty ring. It retries a read a write moved under it for as long as
// the ring's writer lives (it holds the file's lock), up to readRingWait;
// a sequence left odd by a writer that died mid-write (the lock is free)
// is taken as it is, a few bytes out of order.
func readRing(path string) ([]byte, error) {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() <= ringHeader {
		return nil, fmt.Errorf("%s: not a ring", path)
	}
	data := make([]byte, st.Size())
	seq := func() uint64 {
		var b [8]byte
		f.ReadAt(b[:], 0) //nolint:errcheck // a short read is a retry
		return binary.LittleEndian.Uint64(b[:])
	}
	deadline := time.Now().Add(readRingWait)
	for {
		before := seq()
		if _, err := f.ReadAt(data, 0); err != nil {
			return nil, err
		}
		after := seq()
		if before&1 == 0 && after == before {
			break
		}
		if before == after && !ringWriterLives(f) || !time.Now().Before(deadline) {
			break
		}
		time.Sleep(readRingPause)
	}
	written := binary.LittleEndian.Uint64(data[8:ringHeader])
	ring := data[ringHeader:]
	size := uint64(len(ring))
	if written <= size {
		return ring[:written], nil
	}
	off := written % size
	return append(append([]byte{}, ring[off:]...), ring[:off]...), nil
}
