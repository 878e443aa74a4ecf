// Package project holds the one definition of a project path [paper:
// nested projects]: "root", "root/team", "root/team/run-7". Every check of
// the form "may a caller of project Q act on project P" goes through
// Within, so the direction of the test is written once.
package project

import (
	"regexp"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Root is the top of the tree.
const Root = "root"

// MaxDepth is how many names a path may have ("root" is one).
const MaxDepth = 16

var nameRE = regexp.MustCompile(`^[a-z][a-z0-9-]{0,39}$`)

// NameHelp says what a name may be, for error messages.
const NameHelp = "1 to 40 of a-z, 0-9 and '-', starting with a letter"

// ValidName checks one element of a path.
func ValidName(name string) error {
	if !nameRE.MatchString(name) {
		return errdefs.InvalidArgument("project name %q: %s", name, NameHelp)
	}
	return nil
}

// Valid checks a whole path: 1 to MaxDepth valid names joined by '/',
// starting at Root.
func Valid(path string) error {
	names := strings.Split(path, "/")
	if len(names) > MaxDepth {
		return errdefs.InvalidArgument("project %q: nested more than %d deep", path, MaxDepth)
	}
	for _, n := range names {
		if err := ValidName(n); err != nil {
			return errdefs.InvalidArgument("project %q: name %q: %s", path, n, NameHelp)
		}
	}
	if names[0] != Root {
		return errdefs.InvalidArgument("project %q: paths start at %q", path, Root)
	}
	return nil
}

// Within reports whether p is ancestor or lies below it. An empty
// ancestor contains nothing, so a missing scope never grants access.
func Within(p, ancestor string) bool {
	return ancestor != "" && (p == ancestor || strings.HasPrefix(p, ancestor+"/"))
}

// Related reports whether a and b are on one line of descent: one is
// within the other. Images are readable this way (a project's own, its
// ancestors' and its descendants').
func Related(a, b string) bool { return Within(a, b) || Within(b, a) }

// Parent returns the parent path, "" for a top-level path.
func Parent(path string) string {
	i := strings.LastIndexByte(path, '/')
	if i < 0 {
		return ""
	}
	return path[:i]
}

// Ancestry returns path and its ancestors, nearest first: "root/a/b",
// "root/a", "root".
func Ancestry(path string) []string {
	var out []string
	for p := path; p != ""; p = Parent(p) {
		out = append(out, p)
	}
	return out
}
