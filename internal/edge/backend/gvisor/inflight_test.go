package gvisor

import (
	"bytes"
	"testing"
)

func TestIsCheckpointOf(t *testing.T) {
	argv := func(s string) [][]byte { return bytes.Split([]byte(s), []byte(" ")) }
	for cmd, want := range map[string]bool{
		"/usr/bin/runsc --root /r checkpoint --image-path /s/memory abc-1":                  true,
		"/work/bin/runsc-net --root /r --platform systrap checkpoint --leave-running abc-1": true,
		"/usr/bin/runsc --root /r checkpoint --image-path /s/memory abc-12":                 false, // another id
		"/usr/bin/runsc --root /r restore --image-path /s/memory abc-1":                     false,
		"/bin/sh -c checkpoint abc-1":                                                       false,
		"/usr/bin/runsc abc-1":                                                              false,
	} {
		if got := isCheckpointOf(argv(cmd), "abc-1"); got != want {
			t.Errorf("%q: %v, want %v", cmd, got, want)
		}
	}
}
