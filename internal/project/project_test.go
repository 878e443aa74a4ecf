package project

import (
	"strings"
	"testing"
)

func TestWithin(t *testing.T) {
	t.Parallel()
	cases := []struct {
		p, anc string
		want   bool
	}{
		{"root", "root", true},
		{"root/a", "root", true},
		{"root/a/b", "root/a", true},
		{"root/ab", "root/a", false}, // a prefix of the name is not a parent
		{"root", "root/a", false},    // the direction matters
		{"root/a", "", false},        // no scope, no access
		{"", "", false},
		{"other", "root", false},
	}
	for _, c := range cases {
		if got := Within(c.p, c.anc); got != c.want {
			t.Errorf("Within(%q, %q) = %v, want %v", c.p, c.anc, got, c.want)
		}
	}
	if !Related("root", "root/a") || !Related("root/a", "root") || Related("root/a", "root/b") {
		t.Error("Related is not symmetric or relates siblings")
	}
}

func TestValid(t *testing.T) {
	t.Parallel()
	deep := "root" + strings.Repeat("/a", MaxDepth-1)
	for _, ok := range []string{"root", "root/team-1", deep} {
		if err := Valid(ok); err != nil {
			t.Errorf("Valid(%q): %v", ok, err)
		}
	}
	for bad, why := range map[string]string{
		"":                                `name ""`,
		"root/":                           `name ""`,
		"root/0..":                        `name "0.."`,
		"root/..":                         `name ".."`,
		"root/A":                          `name "A"`,
		"team":                            "paths start at",
		"/root":                           `name ""`,
		deep + "/a":                       "nested more than 16 deep",
		"root/" + strings.Repeat("a", 41): "1 to 40",
	} {
		err := Valid(bad)
		if err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("Valid(%q) = %v, want an error with %q", bad, err, why)
		}
	}
}

func TestAncestry(t *testing.T) {
	t.Parallel()
	if got := strings.Join(Ancestry("root/a/b"), ","); got != "root/a/b,root/a,root" {
		t.Fatalf("Ancestry = %s", got)
	}
	if Parent("root") != "" || Parent("root/a") != "root" {
		t.Fatal("Parent")
	}
}

func FuzzValid(f *testing.F) {
	f.Add("root/a")
	f.Add("root/../x")
	f.Fuzz(func(t *testing.T, p string) {
		if Valid(p) != nil {
			return
		}
		// A valid path is safe as a file path and as a prefix test.
		for _, n := range strings.Split(p, "/") {
			if n == "" || n == "." || n == ".." || strings.ContainsAny(n, `.\:`) {
				t.Fatalf("%q valid with name %q", p, n)
			}
		}
		if !Within(p, Root) {
			t.Fatalf("%q valid but not within %q", p, Root)
		}
	})
}
