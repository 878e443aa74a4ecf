package controlplane

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// daemonCluster is a cluster of separate dsec processes with certificates
// from dsec ca: three IAM replicas, two edges (container and gvisor, no
// sandbox network), a watcher and two apiservers serving clients plain
// HTTP; each serves its metrics.
type daemonCluster struct {
	d        *daemons
	pkiDir   string
	iamAddrs map[string]string // replica name → address
	edges    map[string]string // edge-1, edge-2 → address
	apis     map[string]string // api-1, api-2 → address
	watcher  string
	metrics  map[string]string // daemon name → its --metrics-listen address
	key      string            // the admin key of project root
	cl       *client.Client
}

func startDaemonCluster(t *testing.T, ctx context.Context, dir string, d *daemons) *daemonCluster {
	t.Helper()
	storeDir := e2e.BusyboxStore(t, dir)
	c := &daemonCluster{d: d, pkiDir: filepath.Join(dir, "pki"),
		iamAddrs: map[string]string{"iam-1": freeAddr(t), "iam-2": freeAddr(t), "iam-3": freeAddr(t)},
		edges:    map[string]string{"edge-1": freeAddr(t), "edge-2": freeAddr(t)},
		apis:     map[string]string{"api-1": freeAddr(t), "api-2": freeAddr(t)},
		watcher:  freeAddr(t),
		metrics:  map[string]string{},
	}
	certFlags := d.certificates(c.pkiDir, map[string]string{"iam-1": "iam", "iam-2": "iam", "iam-3": "iam", "edge-1": "edge", "edge-2": "edge", "api-1": "apiserver", "api-2": "apiserver", "watcher": "watcher"})
	tlsFlags := func(name string) []string {
		c.metrics[name] = freeAddr(t)
		return append(certFlags(name), "--metrics-listen", c.metrics[name])
	}
	keyFile := filepath.Join(dir, "admin.key")
	d.start("iam-1", append([]string{"iam", "--id", "iam-1", "--dir", filepath.Join(dir, "iam-1"), "--bind", c.iamAddrs["iam-1"], "--bootstrap", "--admin-key-file", keyFile}, tlsFlags("iam-1")...)...)
	for _, id := range []string{"iam-2", "iam-3"} {
		d.start(id, append([]string{"iam", "--id", id, "--dir", filepath.Join(dir, id), "--bind", c.iamAddrs[id], "--join", c.iamAddrs["iam-1"]}, tlsFlags(id)...)...)
	}
	allIAM := c.iamAddrs["iam-1"] + "," + c.iamAddrs["iam-2"] + "," + c.iamAddrs["iam-3"]
	edges := c.edges["edge-1"] + "," + c.edges["edge-2"]
	for name, addr := range c.edges {
		d.start(name, append([]string{"edge", "--state-dir", filepath.Join(dir, name), "--listen", addr, "--image-store", storeDir,
			"--backends", "container,gvisor", "--agent", testutil.AgentBinary(t), "--sandbox-network=false"}, tlsFlags(name)...)...)
	}
	d.start("watcher", append([]string{"watcher", "--listen", c.watcher, "--edges", edges}, tlsFlags("watcher")...)...)
	for name, addr := range c.apis {
		d.start(name, append([]string{"apiserver", "--id", name, "--state-dir", filepath.Join(dir, name), "--listen", addr,
			"--edges", edges, "--iam", allIAM, "--image-store", storeDir, "--watcher", c.watcher}, tlsFlags(name)...)...)
	}
	for deadline := time.Now().Add(30 * time.Second); c.key == ""; time.Sleep(100 * time.Millisecond) {
		key, _ := os.ReadFile(keyFile)
		if c.key = strings.TrimSpace(string(key)); c.key == "" && time.Now().After(deadline) {
			t.Fatal("the bootstrap replica wrote no admin key")
		}
	}
	var err error
	if c.cl, err = client.New("http://"+c.apis["api-1"]+",http://"+c.apis["api-2"], c.key); err != nil {
		t.Fatal(err)
	}
	c.waitAPI(t, ctx, c.apis["api-1"])
	c.waitAPI(t, ctx, c.apis["api-2"])
	return c
}

// waitAPI waits until the apiserver at addr answers with both edges
// healthy in its view, and returns that view.
func (c *daemonCluster) waitAPI(t *testing.T, ctx context.Context, addr string) []*sandboxv1.Node {
	t.Helper()
	one, _ := client.New("http://"+addr, c.key)
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		nodes, err := one.Sandboxes.ListNodes(ctx, connect.NewRequest(&sandboxv1.ListNodesRequest{}))
		healthy := 0
		if err == nil {
			for _, n := range nodes.Msg.Nodes {
				if n.Healthy {
					healthy++
				}
			}
		}
		if err == nil && healthy == 2 {
			return nodes.Msg.Nodes
		}
		if time.Now().After(deadline) {
			t.Fatalf("apiserver %s: %d healthy edges in its view, %v", addr, healthy, err)
		}
	}
}
