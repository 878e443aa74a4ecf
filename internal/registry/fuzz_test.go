package registry

import (
	"context"
	"encoding/base64"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// FuzzParseDockerConfig: any file either parses, and every stored login
// it holds then decodes, or is refused with invalid argument.
func FuzzParseDockerConfig(f *testing.F) {
	f.Add([]byte(`{"auths":{"127.0.0.1:5000":{"auth":"` + base64.StdEncoding.EncodeToString([]byte("u:p")) + `"}}}`))
	f.Add([]byte(`{"auths":{"https://index.docker.io/v1/":{"identitytoken":"t"}},"credHelpers":{"ghcr.io":"gh"}}`))
	f.Add([]byte(`{"auths":{"x":{"auth":"!!"}}}`))
	f.Add([]byte(`{"credsStore":"../../bin/sh"}`))
	f.Add([]byte(``))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseDockerConfig(data)
		if err != nil {
			if errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
				t.Fatalf("refusal is not invalid argument: %v", err)
			}
			return
		}
		for host, h := range c.CredHelpers {
			if !helperName(h) {
				t.Fatalf("helper %q for %q accepted", h, host)
			}
		}
		c.CredHelpers, c.CredsStore = nil, "" // never run helpers here
		for k := range c.Auths {
			if _, err := c.For(context.Background(), configKey(k)); err != nil {
				t.Fatalf("For(%q): %v", k, err)
			}
		}
	})
}

// FuzzParseReference: a reference parses into one whose default store name
// is valid, or is refused with invalid argument.
func FuzzParseReference(f *testing.F) {
	for _, s := range []string{"python:3.12", "127.0.0.1:5000/a/b:c", "x@sha256:" + strings.Repeat("0", 64), "http://x/y", "", "A:B"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseReference(s)
		if err != nil {
			if errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
				t.Fatalf("refusal is not invalid argument: %v", err)
			}
			return
		}
		if _, err := DefaultName(r, "root"); err != nil && errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
			t.Fatalf("DefaultName(%q): %v", s, err)
		}
	})
}
