package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
)

// daemons is the cluster as separate processes of one dsec binary, as
// scripts/cluster.sh runs it, on loopback: 3 IAM replicas, one edge, a
// watcher and 2 apiservers, with certificates from dsec ca.
type daemons struct {
	dir   string
	procs []*exec.Cmd
	urls  []string
	key   string
}

func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func startDaemons(ctx context.Context, dsec, agent, storeDir string, apis int) (*daemons, error) {
	for _, p := range []*string{&dsec, &agent, &storeDir} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			return nil, err
		}
		*p = abs
	}
	dir, err := os.MkdirTemp("", "dsec-bench-daemons-")
	if err != nil {
		return nil, err
	}
	d := &daemons{dir: dir}
	pki := filepath.Join(dir, "pki")
	run := func(args ...string) error {
		if out, err := exec.CommandContext(ctx, dsec, args...).CombinedOutput(); err != nil {
			return fmt.Errorf("dsec %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	start := func(name string, args ...string) error {
		logf, err := os.Create(filepath.Join(dir, name+".log"))
		if err != nil {
			return err
		}
		defer logf.Close()
		cmd := exec.Command(dsec, args...)
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			return err
		}
		d.procs = append(d.procs, cmd)
		return nil
	}
	tls := func(name string) []string {
		return []string{"--ca", filepath.Join(pki, "ca.crt"), "--cert", filepath.Join(pki, name+".crt"), "--key", filepath.Join(pki, name+".key")}
	}
	fail := func(err error) (*daemons, error) {
		d.stop()
		return nil, err
	}
	if err := run("ca", "init", "--dir", pki); err != nil {
		return fail(err)
	}
	roles := map[string]string{"iam-1": "iam", "iam-2": "iam", "iam-3": "iam", "edge-1": "edge", "watcher": "watcher"}
	for i := 1; i <= apis; i++ {
		roles[fmt.Sprintf("api-%d", i)] = "apiserver"
	}
	for name, role := range roles {
		if err := run("ca", "issue", "--dir", pki, "--role", role, "--host", "127.0.0.1", name); err != nil {
			return fail(err)
		}
	}
	ports := map[string]string{}
	for _, name := range []string{"iam-1", "iam-2", "iam-3", "edge-1", "watcher"} {
		if ports[name], err = freePort(); err != nil {
			return fail(err)
		}
	}
	keyFile := filepath.Join(dir, "admin.key")
	if err := start("iam-1", append([]string{"iam", "--id", "iam-1", "--dir", filepath.Join(dir, "iam-1"), "--bind", ports["iam-1"], "--bootstrap", "--admin-key-file", keyFile}, tls("iam-1")...)...); err != nil {
		return fail(err)
	}
	for _, id := range []string{"iam-2", "iam-3"} {
		if err := start(id, append([]string{"iam", "--id", id, "--dir", filepath.Join(dir, id), "--bind", ports[id], "--join", ports["iam-1"]}, tls(id)...)...); err != nil {
			return fail(err)
		}
	}
	if err := start("edge-1", append([]string{"edge", "--state-dir", filepath.Join(dir, "edge-1"), "--listen", ports["edge-1"], "--image-store", storeDir,
		"--backends", "container", "--agent", agent, "--sandbox-network=false", "--cpu-overcommit", "64", "--memory-overcommit", "3"}, tls("edge-1")...)...); err != nil {
		return fail(err)
	}
	if err := start("watcher", append([]string{"watcher", "--listen", ports["watcher"], "--edges", ports["edge-1"]}, tls("watcher")...)...); err != nil {
		return fail(err)
	}
	for i := 1; i <= apis; i++ {
		name := fmt.Sprintf("api-%d", i)
		addr, err := freePort()
		if err != nil {
			return fail(err)
		}
		if err := start(name, append([]string{"apiserver", "--id", name, "--state-dir", filepath.Join(dir, name), "--listen", addr,
			"--edges", ports["edge-1"], "--iam", ports["iam-1"] + "," + ports["iam-2"] + "," + ports["iam-3"], "--image-store", storeDir,
			"--watcher", ports["watcher"]}, tls(name)...)...); err != nil {
			return fail(err)
		}
		d.urls = append(d.urls, "http://"+addr)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for d.key == "" {
		if data, _ := os.ReadFile(keyFile); len(data) > 0 {
			d.key = strings.TrimSpace(string(data))
		} else if time.Now().After(deadline) {
			return fail(fmt.Errorf("the bootstrap IAM replica wrote no admin key (logs in %s)", dir))
		} else {
			time.Sleep(100 * time.Millisecond)
		}
	}
	for _, u := range d.urls {
		cl, err := client.New(u, d.key)
		if err != nil {
			return fail(err)
		}
		for {
			nodes, err := cl.Sandboxes.ListNodes(ctx, connect.NewRequest(&sandboxv1.ListNodesRequest{}))
			if err == nil && len(nodes.Msg.Nodes) == 1 && nodes.Msg.Nodes[0].Healthy {
				break
			}
			if time.Now().After(deadline) {
				return fail(fmt.Errorf("apiserver %s did not see the edge: %v (logs in %s)", u, err, dir))
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	return d, nil
}

// stop ends every process (SIGTERM, SIGKILL after 10 s) and removes the
// directory.
func (d *daemons) stop() {
	for i := len(d.procs) - 1; i >= 0; i-- {
		p := d.procs[i]
		p.Process.Signal(syscall.SIGTERM) //nolint:errcheck // may be gone
		done := make(chan struct{})
		go func() { p.Wait(); close(done) }() //nolint:errcheck // ended
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			p.Process.Kill() //nolint:errcheck // may be gone
			<-done
		}
	}
	os.RemoveAll(d.dir)
}
