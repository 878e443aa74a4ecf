// Package filemeta is user-defined metadata on files in a sandbox [ours,
// after E2B]: extended attributes named user.e2b.KEY, the namespace E2B's
// envd uses, so a file's metadata reads the same through our API and
// E2B's, and metadata set inside the sandbox (setfattr, os.setxattr)
// shows too.
package filemeta

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// Prefix is the attribute namespace of the metadata.
const Prefix = "user.e2b."

// Bounds: Linux limits an attribute's name to 255 bytes (the prefix
// included), and ext4 keeps all of a file's attributes in one 4 KiB block.
const (
	MaxKeyLen   = 255 - len(Prefix)
	MaxTotalLen = 4096
)

// Validate says why metadata could not be stored, naming the key: keys not
// empty and at most MaxKeyLen bytes, keys and values printable US-ASCII
// (they travel as HTTP headers), all of it (names with the prefix, and
// values) at most MaxTotalLen bytes.
func Validate(metadata map[string]string) error {
	total := 0
	for k, v := range metadata {
		switch {
		case k == "":
			return errors.New("metadata: a key is empty")
		case len(k) > MaxKeyLen:
			return fmt.Errorf("metadata key %.32q…: %d bytes, at most %d", k, len(k), MaxKeyLen)
		}
		if i := notPrintable(k); i >= 0 {
			return fmt.Errorf("metadata key %q: byte %d (0x%02x) is not printable US-ASCII", k, i, k[i])
		}
		if i := notPrintable(v); i >= 0 {
			return fmt.Errorf("metadata value of key %q: byte %d (0x%02x) is not printable US-ASCII", k, i, v[i])
		}
		total += len(Prefix) + len(k) + len(v)
	}
	if total > MaxTotalLen {
		return fmt.Errorf("metadata: %d bytes in all (keys with their %q prefix, and values), at most %d", total, Prefix, MaxTotalLen)
	}
	return nil
}

func notPrintable(s string) int {
	for i := range len(s) {
		if s[i] < 0x20 || s[i] > 0x7e {
			return i
		}
	}
	return -1
}

// Read returns the metadata of path (not following a final symlink: a link
// has none), nil when it has none or its file system keeps no attributes.
// Entries whose name or value is not UTF-8 are left out.
func Read(path string) (map[string]string, error) {
	names, err := listNames(func(b []byte) (int, error) { return unix.Llistxattr(path, b) })
	if err != nil || len(names) == 0 {
		return nil, unsupportedIsNone(err)
	}
	var out map[string]string
	for _, name := range names {
		key, ok := strings.CutPrefix(name, Prefix)
		if !ok || !utf8.ValidString(key) {
			continue
		}
		v, err := get(func(b []byte) (int, error) { return unix.Lgetxattr(path, name, b) })
		if errors.Is(err, unix.ENODATA) {
			continue // removed meanwhile
		}
		if err != nil {
			return nil, err
		}
		if !utf8.Valid(v) {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[key] = string(v)
	}
	return out, nil
}

// Replace makes the metadata of the open file fd exactly metadata: the
// attributes of the namespace it lacks are removed.
func Replace(fd int, metadata map[string]string) error {
	if err := Validate(metadata); err != nil {
		return err
	}
	names, err := listNames(func(b []byte) (int, error) { return unix.Flistxattr(fd, b) })
	if err != nil {
		if unsupportedIsNone(err) == nil && len(metadata) == 0 {
			return nil // nothing to clear where nothing can be kept
		}
		return err
	}
	for _, name := range names {
		key, ok := strings.CutPrefix(name, Prefix)
		if _, keep := metadata[key]; !ok || keep {
			continue
		}
		if err := unix.Fremovexattr(fd, name); err != nil && !errors.Is(err, unix.ENODATA) {
			return err
		}
	}
	for k, v := range metadata {
		if err := unix.Fsetxattr(fd, Prefix+k, []byte(v), 0); err != nil {
			return err
		}
	}
	return nil
}

func unsupportedIsNone(err error) error {
	if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) {
		return nil
	}
	return err
}

// listNames calls a listxattr variant with a buffer that fits.
func listNames(list func([]byte) (int, error)) ([]string, error) {
	b, err := get(list)
	if err != nil || len(b) == 0 {
		return nil, err
	}
	return strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00"), nil
}

// get calls a sizing-then-reading attribute call, again if it grew.
func get(call func([]byte) (int, error)) ([]byte, error) {
	for range 3 {
		n, err := call(nil)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return nil, nil
		}
		b := make([]byte, n)
		n, err = call(b)
		if errors.Is(err, unix.ERANGE) {
			continue // it grew between the calls
		}
		if err != nil {
			return nil, err
		}
		return b[:n], nil
	}
	return nil, unix.ERANGE
}
