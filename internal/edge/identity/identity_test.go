package identity

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/edge/backend"
)

// agent answers SetIdentity with err and keeps what it was sent.
type agent struct {
	agentv1connect.UnimplementedAgentServiceHandler
	err  error
	got  *agentv1.SetIdentityRequest
	sent int
}

func (a *agent) SetIdentity(_ context.Context, req *connect.Request[agentv1.SetIdentityRequest]) (*connect.Response[agentv1.SetIdentityResponse], error) {
	a.got, a.sent = req.Msg, a.sent+1
	if a.err != nil {
		return nil, a.err
	}
	return connect.NewResponse(&agentv1.SetIdentityResponse{}), nil
}

// to sends every request to srv, as a link sends "http://agent" to its
// sandbox.
type to struct{ srv *httptest.Server }

func (t to) RoundTrip(r *http.Request) (*http.Response, error) {
	u, _ := url.Parse(t.srv.URL)
	r = r.Clone(r.Context())
	r.URL.Scheme, r.URL.Host = u.Scheme, u.Host
	return http.DefaultTransport.RoundTrip(r)
}

func TestSetSaysWhetherTheAgentAnswered(t *testing.T) {
	a := &agent{}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentServiceHandler(a))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	link := to{srv}
	req := Request("n1-copy", &agentv1.SandboxSettings{WorkDir: "/w"}, &backend.GuestNetwork{Address: "10.0.0.2/32", Gateway: "10.0.0.1", MAC: "02:00:00:00:00:02"})

	for _, c := range []struct {
		err      error
		answered bool
	}{
		{nil, true},
		{connect.NewError(connect.CodeInvalidArgument, errors.New("bad hostname")), true},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("no such interface")), true},
		{connect.NewError(connect.CodeUnavailable, errors.New("starting")), false},
		{connect.NewError(connect.CodeUnknown, errors.New("?")), false},
	} {
		a.err = c.err
		answered, err := Set(context.Background(), link, req)
		if answered != c.answered || (err == nil) != (c.err == nil) {
			t.Errorf("agent error %v: answered %v, err %v; want answered %v", c.err, answered, err, c.answered)
		}
	}
	if a.got.GetHostname() != "n1-copy" || a.got.GetSettings().GetWorkDir() != "/w" || a.got.GetNetwork().GetMac() != "02:00:00:00:00:02" || a.got.GetNetwork().GetAddress() != "10.0.0.2/32" {
		t.Errorf("the agent got %v", a.got)
	}

	srv.Close() // a link that fails is not an answer
	if answered, err := Set(context.Background(), link, req); answered || err == nil {
		t.Errorf("a closed link: answered %v, err %v", answered, err)
	}
}

func TestRequestIsFreshEachTime(t *testing.T) {
	a, b := Request("x", nil, nil), Request("x", nil, nil)
	if len(a.MachineId) != 32 || a.MachineId == b.MachineId {
		t.Errorf("machine ids %q, %q: want two different 32-digit ones", a.MachineId, b.MachineId)
	}
	if len(a.Entropy) != 64 || string(a.Entropy) == string(b.Entropy) {
		t.Error("entropy: want 64 new bytes each time")
	}
	if a.Network != nil || a.Settings != nil {
		t.Errorf("a copy without new settings or network: %v", a)
	}
}

func TestSettingsReadTheSpecsFiles(t *testing.T) {
	dir := t.TempDir()
	hosts, resolv := filepath.Join(dir, "hosts"), filepath.Join(dir, "resolv.conf")
	os.WriteFile(hosts, []byte("127.0.0.1 localhost\n"), 0o600)     //nolint:errcheck // read back below
	os.WriteFile(resolv, []byte("nameserver 169.254.1.1\n"), 0o600) //nolint:errcheck // read back below
	st := Settings(&backend.Spec{Env: []string{"A=1"}, WorkDir: "/srv", HostsFile: hosts, ResolvConf: resolv})
	if st.Hosts != "127.0.0.1 localhost\n" || st.ResolvConf != "nameserver 169.254.1.1\n" || st.WorkDir != "/srv" || len(st.Env) != 1 {
		t.Errorf("settings %v", st)
	}
	if st := Settings(&backend.Spec{HostsFile: filepath.Join(dir, "gone")}); st.Hosts != "" {
		t.Errorf("a missing hosts file: %q", st.Hosts)
	}
}
