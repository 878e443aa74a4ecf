package snapxfer

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path"
	"strings"
	"testing"
)

// FuzzManifest: a manifest from a peer either fails Validate or names only
// clean relative paths inside the snapshot directory.
func FuzzManifest(f *testing.F) {
	f.Add(`{"files":[{"path":"memory/a","size":1,"sha256":"` + strings.Repeat("0", 64) + `"}]}`)
	f.Add(`{"files":[{"path":"../a","size":1,"sha256":""}]}`)
	f.Fuzz(func(t *testing.T, data string) {
		var m Manifest
		if json.Unmarshal([]byte(data), &m) != nil || m.Validate() != nil {
			return
		}
		for _, file := range m.Files {
			if path.Clean(file.Path) != file.Path || strings.HasPrefix(file.Path, "/") || strings.HasPrefix(file.Path, "..") {
				t.Fatalf("accepted path %q", file.Path)
			}
		}
	})
}

// FuzzHandler: any request path serves a listed file, the manifest, or a
// clear error; never another file, never a crash.
func FuzzHandler(f *testing.F) {
	dir := f.TempDir()
	m, err := Build(dir, nil)
	if err != nil {
		f.Fatal(err)
	}
	h := Handler(func(id, token string) (string, *Manifest, error) { return dir, m, nil })
	f.Add("snap-x/files/a")
	f.Add("snap-x/manifest")
	f.Add("../../etc/passwd")
	f.Fuzz(func(t *testing.T, p string) {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.URL.Path = Prefix + p
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code == http.StatusOK && !strings.HasSuffix(p, "/manifest") {
			t.Fatalf("%q: served with an empty manifest", p)
		}
	})
}
