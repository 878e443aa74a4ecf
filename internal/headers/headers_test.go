package headers

import "testing"

func TestLimitEventsRoundTrip(t *testing.T) {
	t.Parallel()
	for _, c := range [][2]int64{{0, 0}, {3, 0}, {1, 1 << 40}} {
		oom, forks, ok := ParseLimitEvents(FormatLimitEvents(c[0], c[1]))
		if !ok || oom != c[0] || forks != c[1] {
			t.Fatalf("%v: parsed %d %d %v", c, oom, forks, ok)
		}
	}
	for _, bad := range []string{"", "oom_kills=1", "oom_kills=-1 forks_refused=0", "oom_kills=x forks_refused=0", "oom_kills forks_refused=1", "forks_refused=1 other=2", "oom_kills=1 oom_kills=2 forks_refused=0"} {
		if _, _, ok := ParseLimitEvents(bad); ok {
			t.Errorf("%q was taken", bad)
		}
	}
	// Keys it does not know are passed over (a newer agent may say more).
	if oom, forks, ok := ParseLimitEvents("oom_kills=2 later=9 forks_refused=5"); !ok || oom != 2 || forks != 5 {
		t.Fatalf("with an unknown key: %d %d %v", oom, forks, ok)
	}
}

// FuzzParseLimitEvents: the value comes from an agent, which a sandbox's
// root may replace: anything parses to counts that are never negative, or
// to nothing.
func FuzzParseLimitEvents(f *testing.F) {
	f.Add("oom_kills=1 forks_refused=2")
	f.Add("oom_kills=9223372036854775807 forks_refused=0")
	f.Add("oom_kills=1 oom_kills=2")
	f.Fuzz(func(t *testing.T, v string) {
		oom, forks, ok := ParseLimitEvents(v)
		if !ok && (oom != 0 || forks != 0) {
			t.Fatalf("%q: not taken, but counts %d %d", v, oom, forks)
		}
		if oom < 0 || forks < 0 {
			t.Fatalf("%q: negative counts %d %d", v, oom, forks)
		}
	})
}
