package baseimage

import (
	"path/filepath"
	"strings"
	"testing"
)

// The package cache is per package set: adding a package to the image
// must not reuse a tarball that lacks it.
func TestPackageTarballIsPerPackageSet(t *testing.T) {
	a := packageTarball("/c", debianPackages)
	if a != packageTarball("/c", append([]string(nil), debianPackages...)) {
		t.Fatal("the same package set names two tarballs")
	}
	if b := packageTarball("/c", append(append([]string(nil), debianPackages...), "jq")); a == b {
		t.Fatalf("a package added to the set reuses %s", a)
	}
	if filepath.Dir(a) != "/c/debootstrap" || !strings.HasPrefix(filepath.Base(a), suite+"-py-") {
		t.Fatalf("tarball %s", a)
	}
}

// The mirror is read from either form of apt's sources, past a one-line
// entry's options and the security archive.
func TestMirrorIn(t *testing.T) {
	for _, c := range []struct{ sources, want string }{
		{"Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n", "http://mirror.example/debian"},
		{"URIs: http://security.debian.org/debian-security\n\nURIs: http://deb.debian.org/debian\n", "http://deb.debian.org/debian"},
		{"deb http://deb.debian.org/debian bookworm main\n", "http://deb.debian.org/debian"},
		{"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://m.example/debian bookworm main\n", "http://m.example/debian"},
		{"deb [arch=amd64 signed-by=/k.gpg] http://m.example/debian bookworm main\n", "http://m.example/debian"},
		{"deb http://security.debian.org/debian-security bookworm-security main\n", ""},
		{"deb [unclosed http://m.example/debian bookworm\n", ""},
		{"# deb http://m.example/debian bookworm main\n", ""},
	} {
		if got := mirrorIn(c.sources); got != c.want {
			t.Errorf("mirrorIn(%q) = %q, want %q", c.sources, got, c.want)
		}
	}
}
