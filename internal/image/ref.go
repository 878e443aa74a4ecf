// Package image is the OCI image store on the shared file system [paper:
// layering, on demand; ours: OCI, any shared FS]. Blobs are content-addressed
// (blobs/sha256/HEX, as in an OCI image layout) and names live one file per
// tag under refs/, written by rename so several nodes can share the store.
// Each node unpacks a layer once into its own cache, when a sandbox first
// needs it, and stacks layers with overlayfs.
package image

import (
	"regexp"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/project"
)

// Ref is a parsed image name "project/name:tag". The project is a project
// path (internal/project: "root", "root/team"), everything before the last
// slash; the name and tag follow OCI's looser rules.
type Ref struct {
	Project string
	Name    string
	Tag     string
}

var (
	nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
	tagRE  = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)
)

const refHelp = `want "project/name:tag" (e.g. "root/py:3.11"): a project path, then a name of lowercase letters, digits, '.', '_' or '-'; the tag defaults to "latest"`

// ParseRef parses and validates an image name.
func ParseRef(s string) (Ref, error) {
	if s == "" {
		return Ref{}, errdefs.InvalidArgument("image: empty; %s", refHelp)
	}
	if len(s) > 255 {
		return Ref{}, errdefs.InvalidArgument("image: longer than 255 characters")
	}
	path, tag := s, "latest"
	if i := strings.LastIndexByte(s, ':'); i > strings.LastIndexByte(s, '/') {
		path, tag = s[:i], s[i+1:]
	}
	if !tagRE.MatchString(tag) {
		return Ref{}, errdefs.InvalidArgument("image %q: bad tag %q; %s", s, tag, refHelp)
	}
	i := strings.LastIndexByte(path, '/')
	if i <= 0 {
		return Ref{}, errdefs.InvalidArgument("image %q: no project; %s", s, refHelp)
	}
	proj, name := path[:i], path[i+1:]
	if !nameRE.MatchString(name) || name == "." || name == ".." {
		return Ref{}, errdefs.InvalidArgument("image %q: bad name %q; %s", s, name, refHelp)
	}
	if err := project.Valid(proj); err != nil {
		return Ref{}, errdefs.InvalidArgument("image %q: %v; %s", s, err, refHelp)
	}
	return Ref{Project: proj, Name: name, Tag: tag}, nil
}

// String returns "project/name:tag".
func (r Ref) String() string { return r.Project + "/" + r.Name + ":" + r.Tag }
