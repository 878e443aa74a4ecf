package errdefs

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
)

func TestRoundTripThroughConnect(t *testing.T) {
	t.Parallel()
	for _, c := range classes {
		err := fmt.Errorf("outer: %w", Wrap(c.class, errors.New("cause"), "field x: bad"))
		ce := ToConnect(err).(*connect.Error)
		if ce.Code() != c.code {
			t.Errorf("%v: code %v, want %v", c.class, ce.Code(), c.code)
		}
		back := FromConnect(ce)
		if !errors.Is(back, c.class) {
			t.Errorf("%v did not survive the round trip: %v", c.class, back)
		}
	}
	if Code(context.DeadlineExceeded) != connect.CodeDeadlineExceeded || Code(errors.New("x")) != connect.CodeInternal {
		t.Fatal("unclassified errors")
	}
	// A Connect error passes through proxies unchanged.
	orig := connect.NewError(connect.CodeNotFound, errors.New("gone"))
	if ToConnect(orig) != orig {
		t.Fatal("connect error rewrapped")
	}
	if got := NotFound("sandbox %s: no such sandbox", "x").Error(); got != "sandbox x: no such sandbox" {
		t.Fatalf("message %q", got)
	}
}

// Every class has a client-error or unavailable status, never a 500, and a
// code Connect itself would map differently is not invented here.
func TestHTTPStatusOfEveryClass(t *testing.T) {
	t.Parallel()
	for _, c := range classes {
		st := HTTPStatus(c.code)
		if st < 400 || st == 500 {
			t.Errorf("%v (%v): HTTP %d", c.class, c.code, st)
		}
	}
	if HTTPStatus(connect.CodeInternal) != 500 || HTTPStatus(connect.CodeNotFound) != 404 || HTTPStatus(connect.CodeResourceExhausted) != 429 {
		t.Fatal("mapping differs from Connect's")
	}
}

func TestRetryMarksTheConnectError(t *testing.T) {
	t.Parallel()
	marked := ToConnect(Retry(Unavailable("key held; retry"))).(*connect.Error)
	if marked.Code() != connect.CodeUnavailable || marked.Meta().Get(RetryHeader) != "1" {
		t.Fatalf("marked: %v %v", marked.Code(), marked.Meta())
	}
	plain := ToConnect(Unavailable("never ready")).(*connect.Error)
	if plain.Meta().Get(RetryHeader) != "" {
		t.Fatalf("unmarked error carries %v", plain.Meta())
	}
}

// A capacity refusal marked RetryAfter keeps its code and class, and its
// Connect error tells the client to send again after whole seconds.
func TestRetryAfterMarksTheConnectError(t *testing.T) {
	t.Parallel()
	err := RetryAfter(ResourceExhausted("node full"), 1500*time.Millisecond)
	if !errors.Is(err, ErrResourceExhausted) {
		t.Fatalf("the mark hides the class: %v", err)
	}
	if d, ok := RetryDelay(fmt.Errorf("placing: %w", err)); !ok || d != 1500*time.Millisecond {
		t.Fatalf("RetryDelay through a wrap: %v %v", d, ok)
	}
	ce := ToConnect(err).(*connect.Error)
	if ce.Code() != connect.CodeResourceExhausted || ce.Meta().Get(RetryHeader) != "1" || ce.Meta().Get(RetryAfterHeader) != "2" {
		t.Fatalf("connect error: %v %v", ce.Code(), ce.Meta())
	}
	if got := ToConnect(RetryAfter(ResourceExhausted("full"), 0)).(*connect.Error).Meta().Get(RetryAfterHeader); got != "1" {
		t.Fatalf("a zero pause is sent as %q, want at least 1 second", got)
	}
	if _, ok := RetryDelay(ResourceExhausted("quota")); ok {
		t.Fatal("an unmarked error has a retry delay")
	}
}

// Clip keeps short input whole and cuts long input at a character
// boundary, never inside a UTF-8 sequence.
func TestClip(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"short", 8, "short"},
		{"exactly8", 8, "exactly8"},
		{"longer than eight", 8, "longer t..."},
		{"aé", 2, "a..."}, // é is two bytes: not cut in half
		{"ééé", 3, "é..."},
	} {
		if got := Clip(tc.in, tc.n); got != tc.want {
			t.Errorf("Clip(%q, %d) = %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
}

// An item's error (a fork's copy, a task's sandbox) keeps its class's code
// by name, and the name reads back as that code.
func TestItemErrorsKeepTheirCode(t *testing.T) {
	t.Parallel()
	for _, c := range classes {
		code, msg := ItemError(Wrap(c.class, errors.New("cause"), "copy 2"))
		if ItemCode(code) != c.code || msg != "copy 2: cause" {
			t.Errorf("%v: item error %q %q, reads back as %v; want %v", c.class, code, msg, ItemCode(code), c.code)
		}
	}
	if code, msg := ItemError(nil); code != "" || msg != "" {
		t.Fatalf("no error: %q %q", code, msg)
	}
	if ItemCode("") != connect.CodeUnknown || ItemCode("no_such_code") != connect.CodeUnknown {
		t.Fatal("an unknown code name is not CodeUnknown")
	}
}
