package main

import "testing"

func TestCoresRoundsFloatNoise(t *testing.T) {
	for in, want := range map[float64]string{127.999999999997: "128", 0.1 + 0.2: "0.3", 2.5: "2.5", 0: "0", 0.125: "0.13"} {
		if got := cores(in); got != want {
			t.Errorf("cores(%v) = %q, want %q", in, got, want)
		}
	}
}
