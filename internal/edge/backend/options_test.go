package backend_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
)

type testOptions struct {
	Runtime string        `option:"runtime"`
	Delay   time.Duration `option:"delay"`
	Ignored string
}

func TestDecodeOptions(t *testing.T) {
	var o testOptions
	if err := backend.DecodeOptions("test", map[string]string{"runtime": "runc", "delay": "1200ms"}, &o); err != nil {
		t.Fatal(err)
	}
	if o != (testOptions{Runtime: "runc", Delay: 1200 * time.Millisecond}) {
		t.Fatalf("decoded %+v", o)
	}
	var none testOptions
	if err := backend.DecodeOptions("test", nil, &none); err != nil || none != (testOptions{}) {
		t.Fatalf("no options: %+v %v", none, err)
	}
	for want, opts := range map[string]map[string]string{
		`test backend: option "runtim": unknown; it takes delay, runtime`: {"runtim": "crun"},
		`test backend: option "Ignored": unknown`:                         {"Ignored": "x"},
		`test backend: option delay "soon": want a duration`:              {"delay": "soon"},
	} {
		err := backend.DecodeOptions("test", opts, &testOptions{})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), want) {
			t.Errorf("%v: %v; want %q", opts, err, want)
		}
	}
}
