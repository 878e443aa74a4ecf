package e2e

import "testing"

// TestEachPackageDrawsPortsOfItsOwn: packages run side by side never
// share a port slice, and every slice lies below the ephemeral range.
func TestEachPackageDrawsPortsOfItsOwn(t *testing.T) {
	seen := map[int]string{}
	for _, bin := range append(append([]string{}, e2ePackages...), "e2e", "other") {
		lo := portSlice(bin + ".test")
		if lo < 20000 || lo+portSliceLen > 32768 {
			t.Errorf("%s: ports %d-%d leave 20000-32767", bin, lo, lo+portSliceLen-1)
		}
		if prev, ok := seen[lo]; ok && bin != "other" {
			t.Errorf("%s and %s share the ports from %d", bin, prev, lo)
		}
		seen[lo] = bin
	}
}
