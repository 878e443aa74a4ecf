package e2e

import (
	"io"
	"net/http"
	"testing"
	"time"
)

// earlyAnswerServer answers a POST before it reads the body: headers and
// a first chunk, then the body echoed once it is all there, then a last
// chunk. Every proxy
// on the way (gateway, apiserver, edge) must go on sending the request
// body after the response started and keep the response whole: an HTTP/1
// server closes a request body once the response starts unless the
// handler asked for full duplex, and the proxy's transport then dropped
// its connection, cutting the response ("terminated" in E2B's JS SDK).
const earlyAnswerServer = `
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def chunk(self, b):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
        self.wfile.flush()
    def do_POST(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.chunk(b"start|")
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.chunk(b"echo:" + body)
        self.chunk(b"|done")
        self.wfile.write(b"0\r\n\r\n")
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
`

// serveEarlyAnswerCmd is the command that starts earlyAnswerServer on port.
func serveEarlyAnswerCmd(port string) string {
	return "cat > /tmp/early.py <<'EOF'\n" + earlyAnswerServer + "\nEOF\nnohup python3 /tmp/early.py " + port + " >/dev/null 2>&1 &"
}

// postAfterAnswer POSTs "hello" to url (with Host host if not empty),
// in two parts 300 ms apart after the headers, so that the server's
// answer has started before the body arrives, and checks the whole answer.
func postAfterAnswer(t *testing.T, hc *http.Client, url, host string) {
	t.Helper()
	pr, pw := io.Pipe()
	go func() {
		for _, part := range []string{"hel", "lo"} {
			time.Sleep(300 * time.Millisecond)
			if _, err := pw.Write([]byte(part)); err != nil {
				return // the request failed: seen below
			}
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", url, pr)
	req.ContentLength = 5
	if host != "" {
		req.Host = host
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("POST %s (host %q): %v", url, host, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 || string(got) != "start|echo:hello|done" {
		t.Fatalf("POST %s (host %q) with the body sent after the answer began: status %d, body %q, err %v; want 200 %q", url, host, resp.StatusCode, got, err, "start|echo:hello|done")
	}
}
