package e2b

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/api/gen/e2b/filesystem/envdfsconnect"
	"github.com/opendsec/opendsec/api/gen/e2b/process/envdprocessconnect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/rpcproxy"
)

// envdCall is what an envd request carries: the sandbox, checked against
// its access token, and the user to act as.
type envdCall struct {
	sandbox string
	user    string
}

type envdKey struct{}

// envdPort is the port E2B's SDKs name for envd.
const envdPort = "49983"

func callOf(ctx context.Context) envdCall {
	c, _ := ctx.Value(envdKey{}).(envdCall)
	return c
}

func (g *Gateway) envdMux(ports func(http.ResponseWriter, *http.Request, int, string)) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", g.health)
	mux.HandleFunc("GET /files", g.download)
	mux.HandleFunc("POST /files", g.upload)
	opts := append(connectOpts(), connect.WithInterceptors(goneInterceptor{g}))
	mux.Handle(envdprocessconnect.NewProcessHandler(&processService{g: g}, opts...))
	mux.Handle(envdfsconnect.NewFilesystemHandler(&fsService{g: g}, opts...))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeStatus(w, http.StatusNotFound, r.Method+" "+r.URL.Path+": not an envd route this gateway serves")
	})
	ew := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("E2b-Sandbox-Id")
		if port := r.Header.Get("E2b-Sandbox-Port"); port != "" && port != envdPort {
			n, err := strconv.Atoi(port)
			if err != nil || n < 1 || n > 65535 {
				writeStatus(w, http.StatusBadRequest, "E2b-Sandbox-Port "+strconv.Quote(port)+": want 1 to 65535")
				return
			}
			ports(w, r, n, id)
			return
		}
		authed := g.validToken(id, r.Header.Get("X-Access-Token"))
		if !authed && isSigned(r) {
			if err := g.checkSignature(id, r); err != nil {
				writeError(w, err)
				return
			}
			authed = true
		}
		if !authed {
			err := errdefs.Unauthenticated("sandbox %s: missing or wrong X-Access-Token (the envd access token from create or connect)", id)
			if plain := r.URL.Path == "/files" || r.URL.Path == "/health"; !plain && ew.IsSupported(r) {
				ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
				return
			}
			writeError(w, err)
			return
		}
		user, err := basicUser(r.Header.Get("Authorization"))
		if err != nil {
			writeError(w, err)
			return
		}
		if u := r.URL.Query().Get("username"); u != "" {
			user = u
		}
		if user == "" {
			user = g.cfg.DefaultUser
		}
		if r.URL.Path != "/files" {
			// Connect's routes: a broken body is the client's error (400), not 500.
			rpcproxy.BoundBody(w, r, envdMaxMessage)
		}
		ctx := context.WithValue(inSandbox(r.Context(), id), envdKey{}, envdCall{sandbox: id, user: user})
		mux.ServeHTTP(w, r.WithContext(ctx))
	})
}

// health answers 204 while the sandbox's agent answers, and 502 with E2B's
// "was not found" message once the sandbox is gone.
func (g *Gateway) health(w http.ResponseWriter, r *http.Request) {
	// A probe must not wake a paused sandbox: E2B's SDKs ask /health for
	// is_running(), which is false while paused.
	req := connect.NewRequest(&agentv1.HealthRequest{})
	req.Header().Set(headers.NoResume, "1")
	if _, err := g.agent.Health(r.Context(), req); err != nil {
		err = g.explain(r.Context(), err)
		writeStatus(w, http.StatusBadGateway, messageOf(err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// explain turns the error of a call into a sandbox that no longer exists
// into what E2B's proxy answers then: Unavailable, "… was not found", which
// the SDKs raise as "sandbox not running". A file that is not found stays
// NotFound: only the sandbox's own absence is rewritten. A stream cut
// because its sandbox was killed (an HTTP/2 reset on the way, "internal")
// is rewritten too: the SDKs then say the sandbox was killed or reached
// its end of life.
func (g *Gateway) explain(ctx context.Context, err error) error {
	switch errdefs.Code(err) {
	case connect.CodeNotFound, connect.CodeUnavailable, connect.CodeFailedPrecondition, connect.CodeInternal, connect.CodeUnknown:
	default:
		return err
	}
	id := callOf(ctx).sandbox
	// The client's own context may be what ended; ask with one of ours.
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	got, gerr := g.sandbox.GetSandbox(qctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: id}))
	switch {
	case errdefs.Code(gerr) == connect.CodeNotFound:
		return connect.NewError(connect.CodeUnavailable, sandboxGone(fmt.Sprintf("The sandbox %s was not found", id)))
	case gerr == nil && got.Msg.Sandbox.State == sandboxv1.SandboxState_SANDBOX_STATE_STOPPING:
		// Being removed is gone already, as E2B tells it: "was not found"
		// is what the SDKs read as not running.
		return connect.NewError(connect.CodeUnavailable, sandboxGone(fmt.Sprintf("The sandbox %s was not found: it was killed", id)))
	case gerr == nil && got.Msg.Sandbox.State == sandboxv1.SandboxState_SANDBOX_STATE_PAUSED && got.Msg.Sandbox.Spec.GetExplicitResume():
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("The sandbox %s is paused and was created without auto-resume: connect to it to resume it", id))
	}
	return err
}

// sandboxGone is explain's message for a sandbox that was killed or ended.
type sandboxGone string

func (e sandboxGone) Error() string { return string(e) }

// goneInterceptor applies explain to the envd services' errors.
type goneInterceptor struct{ g *Gateway }

func (i goneInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		if err != nil {
			return nil, errdefs.ToConnect(i.g.explain(ctx, err))
		}
		return resp, nil
	}
}

func (i goneInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i goneInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		sc := &sendsSeen{StreamingHandlerConn: conn}
		err := next(ctx, sc)
		if err == nil {
			return nil
		}
		err = i.g.explain(ctx, err)
		var gone sandboxGone
		if sc.sent.Load() && errors.As(err, &gone) {
			// E2B's proxy drops the connection of a stream whose sandbox
			// ends under it. The SDKs then probe /health, hear 502 "was
			// not found", and say the sandbox "was killed or reached its
			// end of life while the request was in flight"; an error at
			// the stream's end would read as a timeout instead. A stream
			// that never started answers the error.
			i.g.log.Debug("cutting a stream whose sandbox ended", "sandbox", callOf(ctx).sandbox, "err", err)
			panic(http.ErrAbortHandler)
		}
		return errdefs.ToConnect(err)
	}
}

// sendsSeen notes whether a stream sent its client anything.
type sendsSeen struct {
	connect.StreamingHandlerConn
	sent atomic.Bool
}

func (c *sendsSeen) Send(msg any) error {
	err := c.StreamingHandlerConn.Send(msg)
	if err == nil {
		c.sent.Store(true)
	}
	return err
}

// basicUser reads the user from envd's "Authorization: Basic base64(user:)".
func basicUser(h string) (string, error) {
	v, ok := strings.CutPrefix(h, "Basic ")
	if !ok {
		return "", nil
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(v))
	if err != nil {
		return "", errdefs.InvalidArgument("Authorization: not base64")
	}
	user, _, _ := strings.Cut(string(raw), ":")
	return user, nil
}

// home is where a user's relative paths start.
func home(user string) string {
	if user == "root" {
		return "/root"
	}
	return "/home/" + user
}

// resolve makes an envd path absolute for user ("~" and relative paths
// start at the user's home).
func resolve(user, p string) string {
	switch {
	case p == "" || p == "~":
		return home(user)
	case strings.HasPrefix(p, "~/"):
		return path.Join(home(user), p[2:])
	case !strings.HasPrefix(p, "/"):
		return path.Join(home(user), p)
	}
	return path.Clean(p)
}
