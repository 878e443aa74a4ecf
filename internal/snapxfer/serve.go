package snapxfer

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Prefix is where an edge serves its snapshots to other edges:
// Prefix+ID+"/manifest" and Prefix+ID+"/files/"+path.
const Prefix = "/dsec-snapshots/"

// TokenHeader carries the export's token: a snapshot is served only to a
// puller that the apiserver gave it.
const TokenHeader = "Dsec-Snapshot-Token"

// Lookup finds an exported snapshot's directory and manifest by id and the
// token the request carries; its errors are errdefs classes.
type Lookup func(id, token string) (dir string, m *Manifest, err error)

// Handler serves exported snapshots. Only files the manifest lists are
// served, so no request path reaches another file; ranges let a cut
// transfer resume.
func Handler(lookup Lookup) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			errdefs.WriteHTTP(w, errdefs.InvalidArgument("method %s: snapshots are read with GET", r.Method))
			return
		}
		rest, ok := strings.CutPrefix(r.URL.Path, Prefix)
		id, what, _ := strings.Cut(rest, "/")
		if !ok || id == "" {
			errdefs.WriteHTTP(w, errdefs.NotFound("path %q: want %sID/manifest or %sID/files/PATH", errdefs.Clip(r.URL.Path, 80), Prefix, Prefix))
			return
		}
		dir, m, err := lookup(id, r.Header.Get(TokenHeader))
		if err != nil {
			errdefs.WriteHTTP(w, err)
			return
		}
		if what == "manifest" {
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(m) //nolint:errcheck // the puller went away
			return
		}
		name, ok := strings.CutPrefix(what, "files/")
		var file *File
		for i := range m.Files {
			if ok && m.Files[i].Path == name {
				file = &m.Files[i]
			}
		}
		if file == nil {
			errdefs.WriteHTTP(w, errdefs.NotFound("snapshot %s has no file %q", errdefs.Clip(id, 80), errdefs.Clip(name, 80)))
			return
		}
		f, err := os.Open(filepath.Join(dir, filepath.FromSlash(file.Path)))
		if err != nil {
			errdefs.WriteHTTP(w, errdefs.Wrap(errdefs.ErrNotFound, err, "snapshot %s: file %s", errdefs.Clip(id, 80), file.Path))
			return
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil || fi.Size() != file.Size {
			errdefs.WriteHTTP(w, errdefs.FailedPrecondition("snapshot %s: file %s changed since its manifest", errdefs.Clip(id, 80), file.Path))
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		http.ServeContent(w, r, "", fi.ModTime(), f)
	})
}
