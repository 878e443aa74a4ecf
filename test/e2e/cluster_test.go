// Package e2e runs a whole cluster in the test process (internal/embed) and
// drives it through the public Go client, as a user would: the fake backend
// for the control plane, the container backend for real isolation (root).
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

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/fake"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/image/baseimage"
	"github.com/opendsec/opendsec/internal/testutil"
)

// cluster is a running all-in-one cluster and an admin client.
type cluster struct {
	*embed.Cluster
	cfg    embed.Config
	reg    *backend.Registry
	client *client.Client
	key    string
}

func registry() *backend.Registry {
	r := &backend.Registry{}
	r.Register(fake.Name, fake.New)
	r.Register(container.Name, container.New)
	r.Register(gvisor.Name, gvisor.New)
	r.Register(microvm.Name, microvm.New)
	return r
}

// startCluster runs a cluster with the named backends, busybox imported.
func startCluster(t testing.TB, backends ...string) *cluster {
	return startClusterWithStore(t, "", backends...)
}

// startClusterWithStore runs a cluster on an existing image store ("" for
// a new one).
func startClusterWithStore(t testing.TB, store string, backends ...string) *cluster {
	t.Helper()
	return startClusterWith(t, store, nil, backends...)
}

// startClusterWith runs a cluster whose configuration adjust changes first.
func startClusterWith(t testing.TB, store string, adjust func(*embed.Config), backends ...string) *cluster {
	t.Helper()
	dir := t.TempDir()
	cfg := embed.Config{
		StateDir: filepath.Join(dir, "state"), Listen: "127.0.0.1:0", AgentPath: testutil.AgentBinary(t),
		Backends:   map[string]map[string]string{},
		Capacity:   edge.Capacity{CPUCores: 16, MemoryMB: 16384, MaxSandboxes: 64, HostCPUCores: 2, HostMemoryMB: 8192},
		ImageStore: store,
	}
	for _, b := range backends {
		cfg.Backends[b] = map[string]string{}
	}
	if adjust != nil {
		adjust(&cfg)
	}
	c := &cluster{cfg: cfg, reg: registry()}
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

func (c *cluster) start(t testing.TB) {
	t.Helper()
	log := testutil.Logger(t)
	if _, fuzzing := t.(*testing.F); fuzzing {
		log = nil // t.Log must not be called from inside a fuzz target
	}
	ec, err := embed.Start(context.Background(), c.cfg, c.reg, log)
	if err != nil {
		t.Fatal(err)
	}
	c.Cluster = ec
	c.key = envKey(t, ec.ClientEnv)
	c.client, err = client.New(ec.APIURL, c.key)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Leave nothing behind, whatever the test did.
		if c.Cluster == ec {
			ec.Edge.DestroyAll(context.Background(), "root")
			ec.Close()
		}
	})
}

// restart stops every component and starts them again on the same state.
func (c *cluster) restart(t *testing.T) {
	t.Helper()
	c.Cluster.Close()
	c.cfg.Listen = "127.0.0.1:0"
	c.start(t)
}

func envKey(t testing.TB, path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "export DSEC_API_KEY="); ok {
			return v
		}
	}
	t.Fatalf("no DSEC_API_KEY in %s", path)
	return ""
}

func ctxT(t *testing.T) context.Context { return ctxTB(t) }

func ctxTB(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func shell(t *testing.T, sb *client.Sandbox, cmd string) *agentv1.RunResponse {
	t.Helper()
	r, err := sb.Shell(ctxT(t), cmd)
	if err != nil {
		t.Fatalf("%q: %v", cmd, err)
	}
	return r
}

// rawPost sends a Connect JSON request with any headers, for tests of what
// the server does with hostile input.
func rawPost(t testing.TB, url string, hdr map[string]string, body string) (*http.Response, []byte) {
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
