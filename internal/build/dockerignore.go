package build

import (
	"bufio"
	"errors"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Ignore is a build context's .dockerignore, read as docker reads it: one
// pattern a line relative to the context ("#" starts a comment), `*` and
// `?` within a path part, `**` across parts, `[...]` classes, "!" before a
// pattern keeps what an earlier one left out; the last pattern that
// matches a path, or a directory above it, decides.
type Ignore struct {
	rules []ignoreRule
}

type ignoreRule struct {
	re     *regexp.Regexp
	keep   bool
	source string
}

// Limits of a .dockerignore.
const (
	maxIgnoreBytes = 1 << 20
	maxIgnoreRules = 10000
)

// LoadIgnore reads dir/.dockerignore; none means nothing is left out.
func LoadIgnore(dir string) (*Ignore, error) {
	f, err := os.Open(filepath.Join(dir, ".dockerignore"))
	if errors.Is(err, fs.ErrNotExist) {
		return &Ignore{}, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ParseIgnore(f)
}

// ParseIgnore reads .dockerignore text. Errors name the line.
func ParseIgnore(r io.Reader) (*Ignore, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxIgnoreBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxIgnoreBytes {
		return nil, errdefs.InvalidArgument(".dockerignore: larger than %d bytes", maxIgnoreBytes)
	}
	ig := &Ignore{}
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	sc.Buffer(make([]byte, 64<<10), maxIgnoreBytes)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		keep := strings.HasPrefix(line, "!")
		if keep {
			line = strings.TrimSpace(line[1:])
		}
		p := path.Clean(strings.TrimPrefix(filepath.ToSlash(line), "/"))
		if p == "." || p == "" {
			continue
		}
		re, err := ignoreRegexp(p)
		if err != nil {
			return nil, errdefs.InvalidArgument(".dockerignore:%d: %q: %v", n, errdefs.Clip(line, 80), err)
		}
		if len(ig.rules) == maxIgnoreRules {
			return nil, errdefs.InvalidArgument(".dockerignore: more than %d patterns", maxIgnoreRules)
		}
		ig.rules = append(ig.rules, ignoreRule{re: re, keep: keep, source: line})
	}
	return ig, sc.Err()
}

// ignoreRegexp turns a cleaned pattern into a regexp of a whole path.
func ignoreRegexp(p string) (*regexp.Regexp, error) {
	var b strings.Builder
	b.WriteString("^")
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case c == '*' && i+1 < len(p) && p[i+1] == '*':
			i++
			if i+1 < len(p) && p[i+1] == '/' {
				i++
				b.WriteString("(?:.*/)?") // "**/": any parts, or none
			} else {
				b.WriteString(".*")
			}
		case c == '*':
			b.WriteString("[^/]*")
		case c == '?':
			b.WriteString("[^/]")
		case c == '[':
			end := strings.IndexByte(p[i:], ']')
			if end < 0 {
				return nil, errors.New("unclosed [")
			}
			class := p[i+1 : i+end]
			if strings.HasPrefix(class, "!") {
				class = "^" + class[1:]
			}
			b.WriteString("[" + strings.ReplaceAll(class, `\`, `\\`) + "]")
			i += end
		case c == '\\' && i+1 < len(p):
			i++
			b.WriteString(regexp.QuoteMeta(string(p[i])))
		default:
			b.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	b.WriteString("$")
	return regexp.Compile(b.String())
}

// Excluded reports whether rel (a path relative to the context, with
// "/") is left out.
func (ig *Ignore) Excluded(rel string) bool {
	if ig == nil || len(ig.rules) == 0 {
		return false
	}
	rel = path.Clean(filepath.ToSlash(rel))
	out := false
	for _, r := range ig.rules {
		if r.matches(rel) {
			out = !r.keep
		}
	}
	return out
}

// matches a path, or a directory above it.
func (r ignoreRule) matches(rel string) bool {
	for p := rel; p != "." && p != "/" && p != ""; p = path.Dir(p) {
		if r.re.MatchString(p) {
			return true
		}
	}
	return false
}

// keepsAny reports whether some pattern keeps what others leave out ("!"):
// then an excluded directory must still be walked.
func (ig *Ignore) keepsAny() bool {
	for _, r := range ig.rules {
		if r.keep {
			return true
		}
	}
	return false
}
