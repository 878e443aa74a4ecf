package rpcproxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"testing"
	"time"
)

// h2cTransport speaks HTTP/2 without TLS, as the hops of the platform do.
func h2cTransport() *http.Transport {
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	return &http.Transport{Protocols: &protos}
}

func h2cServer(t *testing.T, h http.Handler) string {
	t.Helper()
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	srv := httptest.NewUnstartedServer(h)
	srv.Config.Protocols = &protos
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestEarlyErrorDoesNotHang reproduces the proxy deadlock BufferUnary
// prevents: the backend answers 404 before reading the body, the client's
// HTTP/2 transport then stops sending its body, and a proxy that streams the
// body would wait for it forever. With the body buffered the call completes.
func TestEarlyErrorDoesNotHang(t *testing.T) {
	t.Parallel()
	backend := h2cServer(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, `{"code":"not_found"}`) //nolint:errcheck // test
	}))
	target, _ := url.Parse(backend)
	proxy := &httputil.ReverseProxy{
		Rewrite:       func(pr *httputil.ProxyRequest) { pr.SetURL(target) },
		Transport:     h2cTransport(),
		FlushInterval: -1,
		BufferPool:    &BufferPool{},
	}
	front := h2cServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := BufferUnary(r, 1<<20); err != nil {
			http.Error(w, err.Error(), http.StatusRequestEntityTooLarge)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	client := &http.Client{Transport: h2cTransport()}
	for i := range 20 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		pr, pw := io.Pipe()
		req, _ := http.NewRequestWithContext(ctx, "POST", front+"/svc/Method", pr)
		req.Header.Set("Content-Type", "application/proto")
		go func() {
			time.Sleep(time.Millisecond)   // the body trails the headers, as connect-go's does
			pw.Write([]byte("0123456789")) //nolint:errcheck // test
			pw.Close()
		}()
		resp, err := client.Do(req)
		if err != nil {
			cancel()
			t.Fatalf("call %d: %v", i, err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close() //nolint:errcheck // test
		cancel()
		if err != nil {
			t.Fatalf("call %d: reading the answer: %v (the proxy hung)", i, err)
		}
		if resp.StatusCode != http.StatusNotFound || string(body) != `{"code":"not_found"}` {
			t.Fatalf("call %d: %d %q", i, resp.StatusCode, body)
		}
	}
}
