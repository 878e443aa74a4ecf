package e2b

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/rpcproxy"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// Sandbox hosts. E2B's SDKs build a sandbox port's address as
// "PORT-SANDBOXID.DOMAIN" (Sandbox.getHost), DOMAIN being what create
// answered. The gateway serves those hosts: a request whose Host has that
// form goes to the port through the apiserver's port route. With a valid
// E2b-Traffic-Access-Token header it goes with the gateway's key;
// without, as a public request, which only a sandbox created with
// allowPublicTraffic (E2B's default) answers.

// trafficTokenHeader is E2B's header for a sandbox's traffic access token.
const trafficTokenHeader = "E2b-Traffic-Access-Token"

type hostKey struct{}

// sandboxHost is a request's target port and sandbox.
type sandboxHost struct {
	port int
	id   string
	key  bool // send the gateway's key
}

// parseSandboxHost reads "PORT-ID.anything" (port 1-65535, ID a sandbox
// id); ok is false for any other host.
func parseSandboxHost(host string) (port int, id string, ok bool) {
	first, _, found := strings.Cut(host, ".")
	if !found {
		return 0, "", false
	}
	p, rest, found := strings.Cut(first, "-")
	if !found {
		return 0, "", false
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 1 || port > 65535 || strconv.Itoa(port) != p {
		return 0, "", false
	}
	if _, _, err := sandboxid.Parse(rest); err != nil {
		return 0, "", false
	}
	return port, rest, true
}

// portProxy returns a function forwarding a request for a sandbox's port
// (HTTP, WebSocket and other upgrades) over HTTP/1.1 to the apiserver:
// for sandbox hosts, and for envd-style requests whose E2b-Sandbox-Port
// is not envd's.
func (g *Gateway) portProxy() func(w http.ResponseWriter, r *http.Request, port int, id string) {
	var h1 http.Protocols
	h1.SetHTTP1(true)
	api, _ := url.Parse(strings.TrimRight(g.cfg.APIURL, "/"))
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			sh := pr.In.Context().Value(hostKey{}).(sandboxHost)
			pr.SetURL(api)
			pr.Out.URL.Path = strings.TrimRight(api.Path, "/") + "/v1/sandboxes/" + sh.id + "/ports/" + strconv.Itoa(sh.port) + pr.In.URL.Path
			pr.Out.URL.RawPath = ""
			pr.Out.Host = pr.In.Host
			pr.Out.Header.Del(trafficTokenHeader)
			if sh.key {
				pr.Out.Header.Set("X-API-Key", g.cfg.ServiceKey)
			}
		},
		Transport: &http.Transport{
			Protocols:           &h1,
			DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConnsPerHost: 64,
		},
		FlushInterval: -1,
		// OpenDsec's own errors (no network, no key, nothing listening)
		// in E2B's shape, with the statuses E2B's proxy answers: 403 for
		// a missing token, 502 "The sandbox was not found" for a sandbox
		// that is gone. The sandbox server's answers pass untouched.
		ModifyResponse: func(resp *http.Response) error {
			if resp.Header.Get(errdefs.ErrorHeader) == "" {
				return nil
			}
			var e struct{ Message string }
			json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&e) //nolint:errcheck // an empty message then
			resp.Body.Close()
			out := apiError{Code: resp.StatusCode, Message: e.Message}
			if sh, ok := resp.Request.Context().Value(hostKey{}).(sandboxHost); ok {
				out.SandboxID = sh.id
			}
			switch resp.StatusCode {
			case http.StatusUnauthorized:
				out.Code = http.StatusForbidden
			case http.StatusNotFound:
				out.Code, out.Message = http.StatusBadGateway, "The sandbox was not found"
			}
			resp.StatusCode = out.Code
			data, _ := json.Marshal(out)
			resp.Body = io.NopCloser(bytes.NewReader(data))
			resp.ContentLength = int64(len(data))
			resp.Header.Set("Content-Length", strconv.Itoa(len(data)))
			resp.Header.Del(errdefs.ErrorHeader)
			return nil
		},
		ErrorLog: slog.NewLogLogger(g.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			writeError(w, errdefs.Unavailable("apiserver: %v", err))
		},
	}
	return func(w http.ResponseWriter, r *http.Request, port int, id string) {
		sh := sandboxHost{port: port, id: id}
		if tok := r.Header.Get(trafficTokenHeader); tok != "" {
			if !g.validTrafficToken(id, tok) {
				writeStatus(w, http.StatusForbidden, trafficTokenHeader+": not this sandbox's traffic access token")
				return
			}
			sh.key = true
		}
		rpcproxy.FullDuplex(w)
		proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), hostKey{}, sh)))
	}
}
