package snapxfer

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Source is where a snapshot is pulled from.
type Source struct {
	Client  *http.Client
	BaseURL string // the holder, e.g. https://10.0.0.5:7080
	ID      string
	Token   string
	// Received, if set, counts the bytes that came over the network (not
	// those a resumed pull already had).
	Received *atomic.Int64
}

// Progress is told how many bytes of how many have arrived.
type Progress func(done, total int64)

// partSuffix marks a file still arriving.
const partSuffix = ".part"

// emptySHA256 is the SHA-256 of no bytes.
const emptySHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

// maxFailures is how many attempts in a row may fail, per file, before a
// pull gives up; an attempt that moved bytes resets the count.
const maxFailures = 6

// Pull copies the snapshot into dst (created if needed) and returns its
// manifest once every file is there and matches its SHA-256. A pull cut
// short resumes: files already complete are checked, not fetched again, and
// a partial file continues from its last byte, with a range request.
func Pull(ctx context.Context, src Source, dst string, progress Progress) (*Manifest, error) {
	m, err := fetchManifest(ctx, src)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dst, 0o700); err != nil {
		return nil, err
	}
	total, done := m.Total(), int64(0)
	report := func(n int64) {
		done += n
		if progress != nil {
			progress(done, total)
		}
	}
	for _, f := range m.Files {
		if err := pullFile(ctx, src, dst, f, report); err != nil {
			return nil, fmt.Errorf("pull snapshot %s: %w", src.ID, err)
		}
	}
	return m, nil
}

func (s Source) url(rest string) string {
	return s.BaseURL + Prefix + url.PathEscape(s.ID) + "/" + rest
}

func (s Source) get(ctx context.Context, rest string, from int64) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url(rest), nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set(TokenHeader, s.Token)
	if from > 0 {
		req.Header.Set("Range", "bytes="+strconv.FormatInt(from, 10)+"-")
	}
	resp, err := s.Client.Do(req)
	if err != nil {
		return nil, errdefs.Wrap(errdefs.ErrUnavailable, err, "snapshot %s: reach %s", s.ID, s.BaseURL)
	}
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusPartialContent {
		defer resp.Body.Close()
		var body struct{ Code, Message string }
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		json.Unmarshal(data, &body) //nolint:errcheck // a plain message is kept below
		if body.Message == "" {
			body.Message = errdefs.Clip(string(data), 80)
		}
		return nil, peerError(resp.StatusCode, fmt.Sprintf("snapshot %s at %s: %s", s.ID, s.BaseURL, body.Message))
	}
	return resp, nil
}

// peerError classes the holder's answer: its refusals are final, the rest
// may pass.
func peerError(status int, msg string) error {
	switch status {
	case http.StatusNotFound:
		return errdefs.NotFound("%s", msg)
	case http.StatusUnauthorized, http.StatusForbidden:
		return errdefs.PermissionDenied("%s", msg)
	case http.StatusBadRequest, http.StatusRequestedRangeNotSatisfiable, http.StatusPreconditionFailed:
		return errdefs.FailedPrecondition("%s", msg)
	}
	return errdefs.Unavailable("%s (HTTP %d)", msg, status)
}

func fetchManifest(ctx context.Context, src Source) (*Manifest, error) {
	var lastErr error
	for try := range maxFailures {
		if try > 0 && sleep(ctx, try) != nil {
			break
		}
		resp, err := src.get(ctx, "manifest", 0)
		if err != nil {
			lastErr = err
			if errors.Is(err, errdefs.ErrUnavailable) {
				continue
			}
			return nil, err
		}
		data, err := io.ReadAll(io.LimitReader(resp.Body, MaxManifestSize+1))
		resp.Body.Close()
		if err != nil {
			lastErr = errdefs.Wrap(errdefs.ErrUnavailable, err, "snapshot %s: read the manifest", src.ID)
			continue
		}
		if len(data) > MaxManifestSize {
			return nil, errdefs.FailedPrecondition("snapshot %s: manifest over %d bytes", src.ID, MaxManifestSize)
		}
		var m Manifest
		if err := json.Unmarshal(data, &m); err != nil {
			return nil, errdefs.FailedPrecondition("snapshot %s: manifest: %v", src.ID, err)
		}
		if err := m.Validate(); err != nil {
			return nil, errdefs.FailedPrecondition("snapshot %s: %v", src.ID, err)
		}
		return &m, nil
	}
	return nil, errors.Join(lastErr, ctx.Err())
}

func sleep(ctx context.Context, try int) error {
	d := min(100*time.Millisecond<<try, 2*time.Second)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// pullFile brings one file to dst/f.Path, checked against f.SHA256.
func pullFile(ctx context.Context, src Source, dst string, f File, report func(int64)) error {
	final := filepath.Join(dst, filepath.FromSlash(f.Path))
	if sum, size, err := hashFile(final); err == nil && size == f.Size && sum == f.SHA256 {
		report(size)
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(final), 0o700); err != nil {
		return err
	}
	part := final + partSuffix
	if f.Size == 0 {
		if f.SHA256 != emptySHA256 {
			return errdefs.FailedPrecondition("file %s: empty, yet its SHA-256 in the manifest is not that of no bytes", f.Path)
		}
		return os.WriteFile(final, nil, 0o600)
	}
	restarted := false
	failures := 0
	for {
		h, have, err := resumePart(part, f.Size)
		if err != nil {
			return err
		}
		report(have)
		if have < f.Size {
			n, err := fetchRange(ctx, src, f, part, have, h)
			report(n)
			if src.Received != nil {
				src.Received.Add(n)
			}
			if err != nil {
				if !errors.Is(err, errdefs.ErrUnavailable) || ctx.Err() != nil {
					return err
				}
				if n == 0 {
					failures++
				} else {
					failures = 0
				}
				if failures >= maxFailures {
					return err
				}
				report(-have - n) // counted again on the next attempt
				if sleep(ctx, failures) != nil {
					return errors.Join(err, ctx.Err())
				}
				continue
			}
			have += n
		}
		if have == f.Size && hex.EncodeToString(h.Sum(nil)) == f.SHA256 {
			return os.Rename(part, final)
		}
		// The bytes do not match the manifest: start the file over once;
		// a second mismatch is the holder's or the disk's fault.
		os.Remove(part)
		report(-have)
		if restarted {
			return errdefs.FailedPrecondition("file %s: SHA-256 does not match the manifest after a full second transfer", f.Path)
		}
		restarted = true
	}
}

// resumePart opens what a cut transfer left and hashes it; past the
// expected size it starts over.
func resumePart(part string, want int64) (hash.Hash, int64, error) {
	h := sha256.New()
	f, err := os.Open(part)
	if errors.Is(err, os.ErrNotExist) {
		return h, 0, nil
	}
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	n, err := io.Copy(h, f)
	if err != nil {
		return nil, 0, err
	}
	if n > want {
		os.Remove(part)
		return sha256.New(), 0, nil
	}
	return h, n, nil
}

// fetchRange appends bytes from offset have to part, hashing them into h,
// and returns how many arrived.
func fetchRange(ctx context.Context, src Source, f File, part string, have int64, h hash.Hash) (int64, error) {
	resp, err := src.get(ctx, "files/"+f.Path, have)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	flags := os.O_WRONLY | os.O_CREATE | os.O_APPEND
	if have > 0 && resp.StatusCode != http.StatusPartialContent {
		// The holder ignored the range: the whole file comes again.
		return 0, errdefs.FailedPrecondition("file %s: the holder did not serve a range", f.Path)
	}
	out, err := os.OpenFile(part, flags, 0o600)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(io.MultiWriter(out, h), io.LimitReader(resp.Body, f.Size-have))
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return n, errdefs.Wrap(errdefs.ErrUnavailable, err, "file %s: transfer cut at byte %d", f.Path, have+n)
	}
	if have+n < f.Size {
		return n, errdefs.Unavailable("file %s: transfer ended at byte %d of %d", f.Path, have+n, f.Size)
	}
	return n, nil
}
