package aether

import (
	"path/filepath"
	"strings"
	"testing"
)

func FuzzResolvePath(f *testing.F) {
	f.Add("relative/file")
	f.Add("/../../etc/passwd")
	f.Add("a\x00b")
	f.Fuzz(func(t *testing.T, p string) {
		got, err := resolvePath("path", p)
		if err != nil {
			return
		}
		if !filepath.IsAbs(got) || got != filepath.Clean(got) || strings.ContainsRune(got, 0) {
			t.Fatalf("resolvePath(%q) = %q: not a clean absolute path", p, got)
		}
	})
}
