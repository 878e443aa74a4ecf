package image

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// PartialBlob is a blob being written from a stream that may break: a
// registry pull. What arrived stays in tmp/partial-HEX when the stream
// breaks, so the next attempt continues from Offset (an HTTP range request)
// instead of from zero. The file is locked while written, so two pullers of
// one store (two apiservers on a shared file system, or two pulls of one
// image) never write it at once: the second waits, then finds the blob
// stored. Nothing reaches blobs/ before its digest is checked.
type PartialBlob struct {
	s      *Store
	want   digest.Digest
	f      *os.File
	h      hash.Hash
	Offset int64 // bytes already written (and hashed)
}

// ErrBlobPresent is returned by OpenPartialBlob when the blob is stored
// (perhaps by another puller, while this one waited for the lock).
var ErrBlobPresent = errors.New("blob already in the store")

// OpenPartialBlob opens (or continues) the partial file of want, waiting
// for another writer of it to finish. It returns ErrBlobPresent when the
// blob is in the store already.
func (s *Store) OpenPartialBlob(want digest.Digest) (*PartialBlob, error) {
	if err := validDigest(want); err != nil {
		return nil, err
	}
	if s.HasBlob(want) {
		return nil, ErrBlobPresent
	}
	path := filepath.Join(s.dir, "tmp", "partial-"+want.Encoded())
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if s.HasBlob(want) { // another writer finished while this one waited
		os.Remove(path) // an empty file this call made after that rename
		f.Close()
		return nil, ErrBlobPresent
	}
	p := &PartialBlob{s: s, want: want, f: f, h: sha256.New()}
	// Hash what an earlier attempt wrote, so the final digest covers all.
	n, err := io.Copy(p.h, f)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	p.Offset = n
	return p, nil
}

// Write appends to the partial file.
func (p *PartialBlob) Write(b []byte) (int, error) {
	n, err := p.f.Write(b)
	p.h.Write(b[:n])
	p.Offset += int64(n)
	return n, err
}

// Restart drops what was written (the source could not continue from
// Offset and sends the whole blob again).
func (p *PartialBlob) Restart() error {
	if err := p.f.Truncate(0); err != nil {
		return err
	}
	if _, err := p.f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	p.h.Reset()
	p.Offset = 0
	return nil
}

// Commit checks the digest and moves the blob into the store. Content that
// does not match is dropped (a retry starts over) and reported.
func (p *PartialBlob) Commit() error {
	defer p.f.Close()
	got := digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(p.h.Sum(nil)))
	if got != p.want {
		os.Remove(p.f.Name())
		return errdefs.InvalidArgument("blob %s: content has digest %s (%d bytes); the source sent something else", p.want, got, p.Offset)
	}
	if err := p.f.Sync(); err != nil {
		return err
	}
	now := time.Now()
	if err := os.Chtimes(p.f.Name(), now, now); err != nil {
		return err
	}
	return os.Rename(p.f.Name(), p.s.BlobPath(p.want))
}

// Close keeps what was written for a later attempt and releases the lock.
func (p *PartialBlob) Close() error { return p.f.Close() }
