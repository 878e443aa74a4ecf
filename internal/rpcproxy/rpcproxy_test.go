package rpcproxy

import (
	"bytes"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

func TestBufferUnary(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		ct, body string
		length   int64
		limit    int64
		buffered bool
		class    error
	}{
		"proto":               {ct: "application/proto", body: "abc", length: 3, limit: 10, buffered: true},
		"json unknown length": {ct: "application/json", body: "{}", length: -1, limit: 10, buffered: true},
		"connect stream":      {ct: "application/connect+proto", body: "abc", length: 3, limit: 1},
		"grpc":                {ct: "application/grpc+proto", body: "abc", length: 3, limit: 1},
		"declared too big":    {ct: "application/proto", body: "abcdef", length: 6, limit: 5, class: errdefs.ErrResourceExhausted},
		"undeclared too big":  {ct: "application/proto", body: "abcdef", length: -1, limit: 5, class: errdefs.ErrResourceExhausted},
		"exactly limit":       {ct: "application/proto", body: "abcde", length: -1, limit: 5, buffered: true},
	} {
		t.Run(name, func(t *testing.T) {
			r := httptest.NewRequest("POST", "/x", strings.NewReader(tc.body))
			r.Header.Set("Content-Type", tc.ct)
			r.ContentLength = tc.length
			err := BufferUnary(r, tc.limit)
			if tc.class != nil {
				if err == nil || !errors.Is(err, tc.class) {
					t.Fatalf("err = %v, want class %v", err, tc.class)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := r.GetBody != nil; got != tc.buffered {
				t.Fatalf("buffered = %v, want %v", got, tc.buffered)
			}
			b, _ := io.ReadAll(r.Body)
			if string(b) != tc.body {
				t.Fatalf("body = %q, want %q", b, tc.body)
			}
			if tc.buffered && r.ContentLength != int64(len(tc.body)) {
				t.Fatalf("ContentLength = %d", r.ContentLength)
			}
		})
	}
}

// FuzzBufferUnary: any content type, body and declared length either keeps
// the body byte for byte or fails with a classed error; nothing panics.
func FuzzBufferUnary(f *testing.F) {
	f.Add("application/proto", []byte("abc"), int64(3), int64(10))
	f.Add("application/connect+json", []byte("{}"), int64(-1), int64(1))
	f.Add("application/json", []byte("0123456789"), int64(-1), int64(4))
	f.Fuzz(func(t *testing.T, ct string, body []byte, declared, limit int64) {
		if limit < 0 || limit > 1<<20 {
			t.Skip()
		}
		r := httptest.NewRequest("POST", "/x", bytes.NewReader(body))
		r.Header.Set("Content-Type", ct)
		if declared >= 0 && declared != int64(len(body)) {
			declared = int64(len(body))
		}
		r.ContentLength = declared
		err := BufferUnary(r, limit)
		if err != nil {
			if !errors.Is(err, errdefs.ErrResourceExhausted) || int64(len(body)) <= limit {
				t.Fatalf("error %v for %d bytes under limit %d", err, len(body), limit)
			}
			return
		}
		got, _ := io.ReadAll(r.Body)
		if !bytes.Equal(got, body) {
			t.Fatalf("body changed: %q -> %q", body, got)
		}
		if IsUnary(r) && int64(len(body)) > limit {
			t.Fatalf("%d bytes over limit %d were buffered", len(body), limit)
		}
	})
}

func TestCallTimeout(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		hdr, val string
		want     time.Duration
		ok       bool
	}{
		"connect":                    {"Connect-Timeout-Ms", "1500", 1500 * time.Millisecond, true},
		"grpc seconds":               {"Grpc-Timeout", "5S", 5 * time.Second, true},
		"grpc millis":                {"Grpc-Timeout", "100m", 100 * time.Millisecond, true},
		"none":                       {"X-Other", "1", 0, false},
		"negative":                   {"Connect-Timeout-Ms", "-5", 0, false},
		"garbage":                    {"Connect-Timeout-Ms", "soon", 0, false},
		"bad unit":                   {"Grpc-Timeout", "5x", 0, false},
		"too long":                   {"Grpc-Timeout", "1234567890S", 0, false},
		"connect too long":           {"Connect-Timeout-Ms", "99999999999", 0, false},
		"grpc hours past a Duration": {"Grpc-Timeout", "8000000H", time.Duration(math.MaxInt64), true},
	}
	for name, c := range cases {
		h := http.Header{}
		h.Set(c.hdr, c.val)
		got, ok := CallTimeout(h)
		if got != c.want || ok != c.ok {
			t.Errorf("%s: %v %v, want %v %v", name, got, ok, c.want, c.ok)
		}
	}
}

func FuzzCallTimeout(f *testing.F) {
	f.Add("Connect-Timeout-Ms", "100")
	f.Add("Grpc-Timeout", "9H")
	f.Fuzz(func(t *testing.T, k, v string) {
		h := http.Header{}
		h.Set(k, v)
		if d, ok := CallTimeout(h); ok && d <= 0 {
			t.Fatalf("%s=%q gave a non-positive deadline %v", k, v, d)
		}
	})
}
