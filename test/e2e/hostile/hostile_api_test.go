package hostile

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend/oci"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// slowBody sends first, then blocks until release is closed: a server that
// reads the whole body before it answers does not answer while it blocks.
type slowBody struct {
	first   []byte
	release chan struct{}
}

func (b *slowBody) Read(p []byte) (int, error) {
	if len(b.first) > 0 {
		n := copy(p, b.first)
		b.first = b.first[n:]
		return n, nil
	}
	<-b.release
	return 0, io.EOF
}

// TestUnauthenticatedBodiesAreNotRead: a request without a valid key is
// refused from its headers, before the API reads its body, so no such
// request costs the server memory; every route of the API, including the
// agent proxy.
func TestUnauthenticatedBodiesAreNotRead(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	routes := []string{
		"/opendsec.sandbox.v1.SandboxService/CreateSandbox",
		"/opendsec.iam.v1.IAMService/CreateProject",
		"/opendsec.image.v1.ImageService/ListImages",
		"/opendsec.agent.v1.FilesystemService/WriteFile",
	}
	for _, route := range routes {
		for _, key := range []string{"", "dsec_not_a_key"} {
			body := &slowBody{first: []byte(strings.Repeat("x", 1<<20)), release: make(chan struct{})}
			req, _ := http.NewRequest(http.MethodPost, c.APIURL+route, body)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Dsec-Sandbox-Id", "aaaaaaaa-aaaaaaaaaaaaaaaa")
			if key != "" {
				req.Header.Set("Authorization", "Bearer "+key)
			}
			done := make(chan *http.Response, 1)
			go func() {
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					done <- nil
					return
				}
				resp.Body.Close()
				done <- resp
			}()
			select {
			case resp := <-done:
				if resp == nil || resp.StatusCode != http.StatusUnauthorized {
					t.Errorf("%s key %q: %v, want 401", route, key, resp)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("%s key %q: no answer while the body was still coming: the server reads it before the key", route, key)
			}
			close(body.release)
		}
	}
}

// rawHTTP sends a hand-written HTTP/1.1 request and returns the status
// line's code.
func rawHTTP(t *testing.T, apiURL, request string) int {
	t.Helper()
	u, _ := url.Parse(apiURL)
	conn, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second)) //nolint:errcheck // test
	if _, err := io.WriteString(conn, request); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestBrokenAndOversizedBodiesAreTheClientsError: the API promises no 5xx
// on any input: a malformed chunked body answers 400 (401 without a key), a
// body over its route's bound 429, and two different keys in one request
// 400.
func TestBrokenAndOversizedBodiesAreTheClientsError(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	chunked := func(auth string) string {
		return "POST /opendsec.sandbox.v1.SandboxService/ListSandboxes HTTP/1.1\r\nHost: api\r\n" +
			"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n" + auth +
			"\r\n5\r\n{\"a\":\r\nzz-not-hex\r\n\r\n"
	}
	if got := rawHTTP(t, c.APIURL, chunked("")); got != http.StatusUnauthorized {
		t.Errorf("malformed chunked body, no key: %d, want 401", got)
	}
	if got := rawHTTP(t, c.APIURL, chunked("Authorization: Bearer "+c.Key+"\r\n")); got != http.StatusBadRequest {
		t.Errorf("malformed chunked body with a key: %d, want 400", got)
	}
	agent := "POST /opendsec.agent.v1.ProcessService/Run HTTP/1.1\r\nHost: api\r\n" +
		"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nDsec-Sandbox-Id: aaaaaaaa-aaaaaaaaaaaaaaaa\r\n" +
		"Authorization: Bearer " + c.Key + "\r\n\r\n5\r\n{\"a\":\r\nzz-not-hex\r\n\r\n"
	if got := rawHTTP(t, c.APIURL, agent); got >= 500 {
		t.Errorf("malformed chunked body to the agent proxy: %d, want a 4xx", got)
	}

	big := fmt.Sprintf(`{"project":%q}`, strings.Repeat("p", 5<<20))
	resp, body := e2e.RawPost(t, c.APIURL+"/opendsec.sandbox.v1.SandboxService/ListSandboxes", map[string]string{"Authorization": "Bearer " + c.Key}, big)
	if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(string(body), "this route allows") {
		t.Errorf("5 MiB body on a control route: %d %s, want 429 naming the bound", resp.StatusCode, string(body[:min(len(body), 300)]))
	}

	resp, body = e2e.RawPost(t, c.APIURL+"/opendsec.sandbox.v1.SandboxService/ListSandboxes",
		map[string]string{"Authorization": "Bearer " + c.Key, "X-API-Key": "dsec_someone_else"}, "{}")
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "two different keys") {
		t.Errorf("two keys: %d %s, want 400", resp.StatusCode, body)
	}
	resp, _ = e2e.RawPost(t, c.APIURL+"/opendsec.sandbox.v1.SandboxService/ListSandboxes",
		map[string]string{"Authorization": "Bearer " + c.Key, "X-API-Key": c.Key}, "{}")
	if resp.StatusCode != http.StatusOK {
		t.Errorf("the same key twice: %d, want 200", resp.StatusCode)
	}
}

// TestHostWideLimitsAreSet: once an edge runs sandboxes, their threads
// together stay below the kernel's threads-max by the node's reserve, and
// the kernel's file table is not what bounds a sandbox's open files (its
// memory cgroup is: 262 bytes of it per open file, measured here).
func TestHostWideLimitsAreSet(t *testing.T) {
	testutil.RequireRoot(t)
	e2e.StartCluster(t, "container")
	tm, err := os.ReadFile("/proc/sys/kernel/threads-max")
	if err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(tm)), 10, 64)
	if got, want := e2e.NodeCgroups().TasksMax(), strconv.FormatInt(oci.SandboxThreadBound(n), 10); got != want {
		t.Errorf("the sandboxes' pids.max: %q, want %s (threads-max %d less the node's reserve)", got, want, n)
	}
	if fm, _ := os.ReadFile("/proc/sys/fs/file-max"); strings.TrimSpace(string(fm)) != "9223372036854775807" {
		t.Errorf("fs.file-max: %s, want its maximum", fm)
	}
}
