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
