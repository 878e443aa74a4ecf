package e2b

import (
	"encoding/base64"
	"errors"
	"net/http"
	"strings"
	"testing"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

func TestResolveStartsRelativePathsAtHome(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ user, in, want string }{
		{"user", "", "/home/user"},
		{"user", "~", "/home/user"},
		{"user", "~/a/../b", "/home/user/b"},
		{"user", "notes/a.txt", "/home/user/notes/a.txt"},
		{"root", "x", "/root/x"},
		{"user", "/etc//hosts", "/etc/hosts"},
		{"user", "/../..", "/"},
	} {
		if got := resolve(tc.user, tc.in); got != tc.want {
			t.Errorf("resolve(%q, %q) = %q, want %q", tc.user, tc.in, got, tc.want)
		}
	}
}

func TestBasicUser(t *testing.T) {
	t.Parallel()
	enc := func(s string) string { return "Basic " + base64.StdEncoding.EncodeToString([]byte(s)) }
	if u, err := basicUser(enc("user:")); err != nil || u != "user" {
		t.Fatalf("user: %q %v", u, err)
	}
	if u, err := basicUser(""); err != nil || u != "" {
		t.Fatalf("none: %q %v", u, err)
	}
	if _, err := basicUser("Basic !!!"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("not base64: %v", err)
	}
}

func TestImageFor(t *testing.T) {
	t.Parallel()
	g := &Gateway{cfg: Config{BaseImage: "root/py:3.11"}}
	for in, want := range map[string]string{
		"base": "root/py:3.11", "busybox": "root/busybox:latest", "py:3.11": "root/py:3.11", "root/team/tool:2": "root/team/tool:2",
	} {
		if got, err := g.imageFor(in); err != nil || got != want {
			t.Errorf("imageFor(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "Not A Template", "a/../b:1", "team/tool:2"} {
		if _, err := g.imageFor(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("imageFor(%q): %v, want an invalid argument", bad, err)
		}
	}
}

func TestMetadataFilter(t *testing.T) {
	t.Parallel()
	md, err := metadataFilter("user=abc&app=prod%20one")
	if err != nil || md["user"] != "abc" || md["app"] != "prod one" || len(md) != 2 {
		t.Fatalf("%v %v", md, err)
	}
	if _, err := metadataFilter("a=%zz"); err == nil || !strings.Contains(err.Error(), "metadata") {
		t.Fatalf("bad escape: %v", err)
	}
}

func TestPermissions(t *testing.T) {
	t.Parallel()
	if got := permissions(agentv1.FileType_FILE_TYPE_DIRECTORY, 0o755); got != "drwxr-xr-x" {
		t.Fatal(got)
	}
	if got := permissions(agentv1.FileType_FILE_TYPE_FILE, 0o640); got != "-rw-r-----" {
		t.Fatal(got)
	}
}

func TestAccessTokensAreStablePerSandboxAndSecret(t *testing.T) {
	t.Parallel()
	a := &Gateway{cfg: Config{TokenSecret: []byte("0123456789abcdef")}}
	b := &Gateway{cfg: Config{TokenSecret: []byte("fedcba9876543210")}}
	if a.accessToken("s1") != a.accessToken("s1") || a.accessToken("s1") == a.accessToken("s2") || a.accessToken("s1") == b.accessToken("s1") {
		t.Fatal("tokens must depend on exactly the sandbox and the secret")
	}
	if !a.validToken("s1", a.accessToken("s1")) || a.validToken("s2", a.accessToken("s1")) || a.validToken("s1", "") {
		t.Fatal("validToken")
	}
}

func FuzzPathsAndAuthHeaders(f *testing.F) {
	f.Add("user", "~/x/../../..", "Basic dXNlcjo=")
	f.Add("root", "\x00/a", "Basic")
	f.Fuzz(func(t *testing.T, user, p, auth string) {
		if r := resolve(user, p); !strings.HasPrefix(r, "/") {
			t.Fatalf("resolve(%q, %q) = %q is not absolute", user, p, r)
		}
		basicUser(auth)   //nolint:errcheck // must not panic
		metadataFilter(p) //nolint:errcheck // must not panic
	})
}

// Every autoResume shape an E2B SDK sends: older ones send enabled, newer
// ones policy; either alone, or both when they agree.
func TestAutoResumeShapes(t *testing.T) {
	t.Parallel()
	yes, no := true, false
	for _, c := range []struct {
		in      *autoResumeJSON
		resumes bool
		bad     string
	}{
		{in: nil, resumes: true},
		{in: &autoResumeJSON{}, resumes: true},
		{in: &autoResumeJSON{Enabled: &yes}, resumes: true},
		{in: &autoResumeJSON{Enabled: &no}, resumes: false},
		{in: &autoResumeJSON{Policy: "any"}, resumes: true},
		{in: &autoResumeJSON{Policy: "off"}, resumes: false},
		{in: &autoResumeJSON{Enabled: &no, Policy: "off"}, resumes: false},
		{in: &autoResumeJSON{Enabled: &yes, Policy: "off"}, bad: "disagree"},
		{in: &autoResumeJSON{Policy: "sometimes"}, bad: `autoResume.policy "sometimes"`},
	} {
		got, err := c.in.resumesOnCall()
		if c.bad != "" {
			if err == nil || !strings.Contains(err.Error(), c.bad) {
				t.Errorf("%+v: %v, want an error with %q", c.in, err, c.bad)
			}
			continue
		}
		if err != nil || got != c.resumes {
			t.Errorf("%+v: %v, %v; want %v", c.in, got, err, c.resumes)
		}
	}
}

// An upload's X-Metadata-* headers are its files' metadata, keys
// lowercased as envd stores them; a header given twice or a value envd
// would refuse is an error naming it.
func TestUploadMetadata(t *testing.T) {
	t.Parallel()
	h := http.Header{}
	h.Set("X-Metadata-Author", "mish")
	h.Set("x-metadata-PURPOSE", "upload")
	h.Set("Content-Type", "application/octet-stream")
	got, err := uploadMetadata(h)
	if err != nil || len(got) != 2 || got["author"] != "mish" || got["purpose"] != "upload" {
		t.Fatalf("metadata %v %v", got, err)
	}
	if got, err := uploadMetadata(http.Header{"Accept": {"*/*"}}); got != nil || err != nil {
		t.Fatalf("no metadata headers: %v %v, want none", got, err)
	}
	twice := http.Header{"X-Metadata-A": {"1", "2"}}
	if _, err := uploadMetadata(twice); err == nil || !strings.Contains(err.Error(), "more than once") {
		t.Fatalf("a header given twice: %v", err)
	}
	bad := http.Header{"X-Metadata-A": {"caf\xe9"}}
	if _, err := uploadMetadata(bad); err == nil || !strings.Contains(err.Error(), `key "a"`) {
		t.Fatalf("a value that is not ASCII: %v", err)
	}
}

// E2B's list_snapshots(name=…) names one snapshot: a longer name that
// starts with it is not it (E2B's test_list_snapshots_filtered_by_name).
func TestSnapshotCalled(t *testing.T) {
	s := &sandboxv1.Snapshot{Id: "snap-node1-abcdefghijklmnop", Name: "snap-filter-test"}
	for name, want := range map[string]bool{
		"snap-filter-test":                true,
		"snap-filter-test:default":        true,
		"snap-node1-abcdefghijklmnop":     true,
		"snap-filter-test-does-not-exist": false,
		"snap-filter":                     false,
		"":                                false,
	} {
		if got := snapshotCalled(s, name); got != want {
			t.Errorf("snapshotCalled(%q) = %v, want %v", name, got, want)
		}
	}
	if snapshotCalled(&sandboxv1.Snapshot{Id: "snap-node1-abcdefghijklmnop"}, ":") {
		t.Error("an unnamed snapshot matched the name \":\"")
	}
}
