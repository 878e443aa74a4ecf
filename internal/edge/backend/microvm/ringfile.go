package microvm

import (
	"encoding/binary"
	"fmt"
	"os"
)

// ringFile is a file of fixed size that keeps the last bytes written to
// it: a header holding how many bytes were ever written, then the ring.
// It survives its writer's end (kill -9 included); after a crash between
// a write and its header the ring may hold a few bytes out of order,
// which a console can bear.
type ringFile struct {
	f       *os.File
	size    int64
	written uint64
}

const ringHeader = 8

// openRing opens the ring at path, making it (or remaking it, if it is
// not a ring of size) as needed.
func openRing(path string, size int64) (*ringFile, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	r := &ringFile{f: f, size: size}
	var hdr [ringHeader]byte
	st, err := f.Stat()
	if err == nil && st.Size() == ringHeader+size {
		if _, err = f.ReadAt(hdr[:], 0); err == nil {
			r.written = binary.LittleEndian.Uint64(hdr[:])
			return r, nil
		}
	}
	if err := f.Truncate(0); err != nil {
		f.Close()
		return nil, err
	}
	if err := f.Truncate(ringHeader + size); err != nil {
		f.Close()
		return nil, err
	}
	return r, nil
}

// Write keeps the end of p in the ring; it never grows the file.
func (r *ringFile) Write(p []byte) (int, error) {
	n := len(p)
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
	var hdr [ringHeader]byte
	binary.LittleEndian.PutUint64(hdr[:], r.written)
	if _, err := r.f.WriteAt(hdr[:], 0); err != nil {
		return 0, err
	}
	return n, nil
}

// readRing is the ring's content, oldest byte first; a missing file is
// an empty ring.
func readRing(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if len(data) <= ringHeader {
		return nil, fmt.Errorf("%s: not a ring", path)
	}
	written := binary.LittleEndian.Uint64(data[:ringHeader])
	ring := data[ringHeader:]
	size := uint64(len(ring))
	if written <= size {
		return ring[:written], nil
	}
	off := written % size
	return append(append([]byte{}, ring[off:]...), ring[:off]...), nil
}
