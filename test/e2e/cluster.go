// Package e2e holds what the end-to-end suites share: a whole cluster in
// the test process (internal/embed) driven through the public Go client as
// a user would, `dsec up` and its binaries run as processes of their own,
// and clients of the E2B gateway. The suites live in its subpackages, each
// a test binary with a timeout of its own:
//
//   - controlplane: IAM, quotas, projects, placement across nodes, the CLI,
//     the daemons run apart, service installs (mostly the fake backend);
//   - sandboxes: each real backend, fork, liveness, sessions across nodes;
//   - hostile: hostile sandbox code and clients, a full disk, fuzzed API,
//     gateway and port requests;
//   - crash: kill -9 of dsec up during creates, forks, snapshots and task
//     pauses, and task pause drills;
//   - network: sandbox networks against an internet of the test's own, and
//     the E2B gateway.
//
// make test-go runs them one at a time by default, three at a time with
// E2E_PARALLEL=3, and hostile always alone (its exec flood must be
// answered or refused within 3 s, which a node busy with other suites
// cannot promise). They share the node, so what
// a package checks is its own: FreePort draws from a slice of ports per
// package, AssertNoLeaks and the crash checks look for what names their own
// nodes, and networks, cgroups and runtime state are named by node id. The
// preemption drill's host memory figure (MemAvailable rose by a third of
// what the nodes report given back) leaves room for a neighbour's noise.
package e2e

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/fake"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/edge/backend/vm"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/image/baseimage"
	"github.com/opendsec/opendsec/internal/testutil"
)

// Cluster is a running all-in-one cluster and an admin client.
type Cluster struct {
	*embed.Cluster
	Cfg    embed.Config
	Reg    *backend.Registry
	Client *client.Client
	Key    string
}

func registry() *backend.Registry {
	r := &backend.Registry{}
	r.Register(fake.Name, fake.New)
	r.Register(container.Name, container.New)
	r.Register(gvisor.Name, gvisor.New)
	r.Register(microvm.Name, microvm.New)
	r.Register(vm.Name, vm.New)
	return r
}

// StartCluster runs a cluster with the named backends, busybox imported.
func StartCluster(t testing.TB, backends ...string) *Cluster {
	return StartClusterWithStore(t, "", backends...)
}

// StartClusterWithStore runs a cluster on an existing image store ("" for
// a new one).
func StartClusterWithStore(t testing.TB, store string, backends ...string) *Cluster {
	t.Helper()
	return StartClusterWith(t, store, nil, backends...)
}

// StartClusterWith runs a cluster whose configuration adjust changes first.
func StartClusterWith(t testing.TB, store string, adjust func(*embed.Config), backends ...string) *Cluster {
	t.Helper()
	dir := t.TempDir()
	cfg := embed.Config{
		StateDir: filepath.Join(dir, "state"), Listen: "127.0.0.1:0", AgentPath: testutil.AgentBinary(t),
		Backends:   map[string]map[string]string{},
		Capacity:   capacity.Node{CPUCores: 16, MemoryMB: 16384, MaxSandboxes: 64, HostCPUCores: 2, HostMemoryMB: 8192},
		ImageStore: store,
	}
	for _, b := range backends {
		cfg.Backends[b] = map[string]string{}
	}
	if adjust != nil {
		adjust(&cfg)
	}
	c := &Cluster{Cfg: cfg, Reg: registry()}
	c.start(t)
	ref, _ := image.ParseRef("root/busybox:latest")
	if _, err := c.Images.Resolve(ref); err == nil {
		return c
	}
	if _, err := baseimage.Build(context.Background(), c.Images, "busybox", ref, baseimage.Options{}); err != nil {
		t.Fatal(err)
	}
	return c
}

func (c *Cluster) start(t testing.TB) {
	t.Helper()
	log := testutil.Logger(t)
	if _, fuzzing := t.(*testing.F); fuzzing {
		log = nil // t.Log must not be called from inside a fuzz target
	}
	ec, err := embed.Start(context.Background(), c.Cfg, c.Reg, log)
	if err != nil {
		t.Fatal(err)
	}
	c.Cluster = ec
	c.Key = EnvKey(t, ec.ClientEnv)
	if ec.CAFile != "" {
		c.Client, err = client.NewWithTLS(ec.APIURL, c.Key, client.TLSFiles{CA: ec.CAFile, Cert: ec.ClientCert, Key: ec.ClientKey})
	} else {
		c.Client, err = client.New(ec.APIURL, c.Key)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Leave nothing behind, whatever the test did.
		if c.Cluster == ec {
			for _, e := range ec.Edges { // every edge's, not only the first's
				e.DestroyAll(context.Background(), "root")
				e.DrainPools(context.Background())
			}
			ec.Close()
		}
	})
}

// Restart stops every component and starts them again on the same state.
func (c *Cluster) Restart(t *testing.T) {
	t.Helper()
	c.Cluster.Close()
	c.Cfg.Listen = "127.0.0.1:0"
	c.start(t)
}

func EnvKey(t testing.TB, path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	v := EnvValue(string(data), "DSEC_API_KEY")
	if v == "" {
		t.Fatalf("no DSEC_API_KEY in %s", path)
	}
	return v
}

// EnvValue reads NAME from the "export NAME=value" lines of a client.env.
func EnvValue(content, name string) string {
	for _, line := range strings.Split(content, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "export "+name+"="); ok {
			return v
		}
	}
	return ""
}

func Ctx(t *testing.T) context.Context { return CtxTB(t) }

// CtxTB is a test's context: its deadline only keeps a hung call from
// holding the package until its timeout, so it is generous. On a busy
// node (CI beside other work) a test of a microVM under TCG or of gVisor
// took more than the 2 minutes it had before; nothing here is timed.
func CtxTB(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func Shell(t *testing.T, sb *client.Sandbox, cmd string) *agentv1.RunResponse {
	t.Helper()
	r, err := sb.Shell(Ctx(t), cmd)
	if err != nil {
		t.Fatalf("%q: %v", cmd, err)
	}
	return r
}

// RawPost sends a Connect JSON request with any headers, for tests of what
// the server does with hostile input.
func RawPost(t testing.TB, url string, hdr map[string]string, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// Project makes path (its parent must exist) with quota and returns a
// member client of it.
func (c *Cluster) Project(t *testing.T, parent, name string, q *iamv1.Quota) *client.Client {
	t.Helper()
	ctx := Ctx(t)
	if _, err := c.Client.IAM.CreateProject(ctx, connect.NewRequest(&iamv1.CreateProjectRequest{Parent: parent, Name: name, Quota: q})); err != nil {
		t.Fatal(err)
	}
	r, err := c.Client.IAM.CreateAPIKey(ctx, connect.NewRequest(&iamv1.CreateAPIKeyRequest{Project: parent + "/" + name, Name: "k", Role: iamv1.Role_ROLE_MEMBER}))
	if err != nil {
		t.Fatal(err)
	}
	cl, err := client.New(c.APIURL, r.Msg.Secret)
	if err != nil {
		t.Fatal(err)
	}
	return cl
}
