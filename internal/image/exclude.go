package image

import (
	"path"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Exclude is a set of path patterns a commit leaves out (caches, secrets).
// A pattern starting with "/" matches a path from the root ("/root/.cache",
// "/tmp/*"); one without matches a name at any depth ("__pycache__",
// "*.pyc"). '*', '?' and '[...]' work as in path.Match, within one path
// part. A directory that matches is left out with everything under it.
type Exclude struct {
	anchored, anywhere []string
}

// MaxExcludes bounds how many patterns a commit takes.
const MaxExcludes = 256

const excludeHelp = `patterns are "/abs/path" (from the root) or "name" (at any depth), with '*', '?' and '[...]' within one path part`

// ParseExclude checks patterns and returns their set.
func ParseExclude(patterns []string) (*Exclude, error) {
	if len(patterns) > MaxExcludes {
		return nil, errdefs.InvalidArgument("exclude: %d patterns; at most %d", len(patterns), MaxExcludes)
	}
	e := &Exclude{}
	for _, p := range patterns {
		if p == "" || len(p) > 1024 || strings.ContainsRune(p, 0) {
			return nil, errdefs.InvalidArgument("exclude pattern %q: empty, NUL or longer than 1024 bytes; %s", errdefs.Clip(p, 64), excludeHelp)
		}
		clean := path.Clean(p)
		if _, err := path.Match(clean, ""); err != nil {
			return nil, errdefs.InvalidArgument("exclude pattern %q: %v; %s", p, err, excludeHelp)
		}
		if strings.HasPrefix(clean, "/") {
			if clean == "/" {
				return nil, errdefs.InvalidArgument("exclude pattern %q: would leave out everything", p)
			}
			e.anchored = append(e.anchored, strings.TrimPrefix(clean, "/"))
		} else {
			if strings.Contains(clean, "/") {
				return nil, errdefs.InvalidArgument("exclude pattern %q: a pattern without a leading '/' names one path part; %s", p, excludeHelp)
			}
			e.anywhere = append(e.anywhere, clean)
		}
	}
	return e, nil
}

// Matches reports whether rel (a path relative to the root, "/"-separated)
// is left out. A nil set matches nothing.
func (e *Exclude) Matches(rel string) bool {
	if e == nil {
		return false
	}
	for _, p := range e.anchored {
		if ok, _ := path.Match(p, rel); ok {
			return true
		}
	}
	base := path.Base(rel)
	for _, p := range e.anywhere {
		if ok, _ := path.Match(p, base); ok {
			return true
		}
	}
	return false
}
