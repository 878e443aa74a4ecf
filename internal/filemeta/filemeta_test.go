package filemeta

import (
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// file makes a file on a file system that keeps user attributes, or skips.
func file(t *testing.T) (*os.File, string) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "f")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := unix.Fsetxattr(int(f.Fd()), "user.probe", []byte("x"), 0); err != nil {
		t.Skipf("the test directory keeps no user attributes: %v", err)
	}
	unix.Fremovexattr(int(f.Fd()), "user.probe")
	return f, p
}

func read(t *testing.T, p string) map[string]string {
	t.Helper()
	m, err := Read(p)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// A replace leaves exactly the metadata given, and attributes outside the
// namespace alone; none at all clears it.
func TestReplaceLeavesExactlyWhatItIsGiven(t *testing.T) {
	t.Parallel()
	f, p := file(t)
	if err := unix.Setxattr(p, "user.other", []byte("kept"), 0); err != nil {
		t.Fatal(err)
	}
	if m := read(t, p); m != nil {
		t.Fatalf("a new file's metadata: %v, want none", m)
	}
	first := map[string]string{"author": "mish", "purpose": "upload"}
	if err := Replace(int(f.Fd()), first); err != nil {
		t.Fatal(err)
	}
	if m := read(t, p); !maps.Equal(m, first) {
		t.Fatalf("read back %v, want %v", m, first)
	}
	second := map[string]string{"purpose": "again"}
	if err := Replace(int(f.Fd()), second); err != nil {
		t.Fatal(err)
	}
	if m := read(t, p); !maps.Equal(m, second) {
		t.Fatalf("after a second replace %v, want %v (author gone)", m, second)
	}
	if err := Replace(int(f.Fd()), nil); err != nil {
		t.Fatal(err)
	}
	if m := read(t, p); m != nil {
		t.Fatalf("after clearing: %v", m)
	}
	b := make([]byte, 16)
	if n, err := unix.Getxattr(p, "user.other", b); err != nil || string(b[:n]) != "kept" {
		t.Fatalf("an attribute outside the namespace: %q %v, want it kept", b[:n], err)
	}
}

// Metadata set inside the sandbox by other means shows, unless it is not
// UTF-8; a symlink has none of its target's.
func TestReadShowsWhatWasSetOutOfBand(t *testing.T) {
	t.Parallel()
	_, p := file(t)
	for name, v := range map[string]string{Prefix + "author": "mish", Prefix + "bin": "\xff\xfe", Prefix + "\xffkey": "v"} {
		if err := unix.Setxattr(p, name, []byte(v), 0); err != nil {
			t.Fatal(err)
		}
	}
	if m := read(t, p); !maps.Equal(m, map[string]string{"author": "mish"}) {
		t.Fatalf("read %v, want only the UTF-8 entry", m)
	}
	link := filepath.Join(filepath.Dir(p), "link")
	if err := os.Symlink(p, link); err != nil {
		t.Fatal(err)
	}
	if m := read(t, link); m != nil {
		t.Fatalf("a symlink's metadata: %v, want none (its target's is not its own)", m)
	}
	if _, err := Read(filepath.Join(filepath.Dir(p), "missing")); err == nil {
		t.Fatal("a missing file's metadata read without an error")
	}
}

func TestValidateNamesWhatIsWrong(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		md   map[string]string
		want string
	}{
		{map[string]string{"": "v"}, "a key is empty"},
		{map[string]string{"bad key\n": "v"}, `key "bad key\n": byte 7`},
		{map[string]string{"good": "bad\nvalue"}, `value of key "good": byte 3 (0x0a)`},
		{map[string]string{"good": "value\n"}, `value of key "good"`},
		{map[string]string{"k": "caf\u00e9"}, "not printable US-ASCII"},
		{map[string]string{strings.Repeat("k", MaxKeyLen+1): "v"}, "at most 246"},
		{map[string]string{"a": strings.Repeat("v", 2100), "b": strings.Repeat("v", 2100)}, "at most 4096"},
	} {
		if err := Validate(c.md); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want an error with %q", c.md, err, c.want)
		}
	}
	if err := Validate(map[string]string{"bad key": "value with spaces", strings.Repeat("k", MaxKeyLen): ""}); err != nil {
		t.Errorf("printable keys and values: %v", err)
	}
}

// What Validate accepts (within half the bound, below ext4's own
// per-entry overhead) is stored and read back as it was given.
func FuzzValidatedMetadataRoundTrips(f *testing.F) {
	f.Add("author", "mish", "purpose", "upload")
	f.Add("", "v", "k", "\n")
	f.Add("Key.With-Marks!", "", "x", "~ ~")
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		md := map[string]string{k1: v1, k2: v2}
		if Validate(md) != nil {
			return
		}
		total := 0
		for k, v := range md {
			total += len(Prefix) + len(k) + len(v) + 32
		}
		if total > MaxTotalLen/2 {
			return
		}
		fh, p := file(t)
		if err := Replace(int(fh.Fd()), md); err != nil {
			t.Fatalf("replace %q: %v", md, err)
		}
		if got := read(t, p); !maps.Equal(got, md) {
			t.Fatalf("read back %q, want %q", got, md)
		}
	})
}
