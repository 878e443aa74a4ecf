package controlplane

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	watcherv1 "github.com/opendsec/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/pki"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// daemons runs dsec processes for a test and shows their logs if it fails.
type daemons struct {
	t     *testing.T
	bin   string
	dir   string
	procs map[string]*exec.Cmd
	args  map[string][]string
	bins  map[string]string // a daemon's own binary, if not bin (an upgraded one)
}

func newDaemons(t *testing.T, dir string) *daemons {
	d := &daemons{t: t, bin: e2e.DsecBinary(t), dir: dir, procs: map[string]*exec.Cmd{}, args: map[string][]string{}, bins: map[string]string{}}
	t.Cleanup(func() {
		for name := range d.procs {
			d.stop(name)
		}
		if t.Failed() {
			for name := range d.args {
				log, _ := os.ReadFile(filepath.Join(dir, name+".log"))
				t.Logf("%s log:\n%s", name, log)
			}
		}
	})
	return d
}

// start runs `dsec args...` as name, logging to DIR/name.log.
func (d *daemons) start(name string, args ...string) {
	d.t.Helper()
	logf, err := os.OpenFile(filepath.Join(d.dir, name+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		d.t.Fatal(err)
	}
	defer logf.Close()
	bin := d.bin
	if b := d.bins[name]; b != "" {
		bin = b
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	d.procs[name], d.args[name] = cmd, args
}

// kill sends SIGKILL to name and reaps it.
func (d *daemons) kill(name string) {
	if p := d.procs[name]; p != nil {
		p.Process.Kill() //nolint:errcheck // may be gone
		p.Wait()         //nolint:errcheck // killed
		delete(d.procs, name)
	}
}

// stop ends name as an operator would (SIGTERM: an edge then removes its
// warm layers; its sandboxes stay), with SIGKILL after 20 s.
func (d *daemons) stop(name string) {
	p := d.procs[name]
	if p == nil {
		return
	}
	p.Process.Signal(syscall.SIGTERM) //nolint:errcheck // may be gone
	done := make(chan struct{})
	go func() { p.Wait(); close(done) }() //nolint:errcheck // ended
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		p.Process.Kill() //nolint:errcheck // may be gone
		<-done
	}
	delete(d.procs, name)
}

// mustIdentity loads the certificate dsec ca issued to name.
func mustIdentity(t *testing.T, pkiDir, name string) *pki.Identity {
	t.Helper()
	id, err := pki.LoadIdentity(filepath.Join(pkiDir, "ca.crt"), filepath.Join(pkiDir, name+".crt"), filepath.Join(pkiDir, name+".key"))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// run runs `dsec args...` to its end, failing the test if it fails.
func (d *daemons) run(args ...string) {
	d.t.Helper()
	if out, err := exec.Command(d.bin, args...).CombinedOutput(); err != nil {
		d.t.Fatalf("dsec %v: %v\n%s", args, err, out)
	}
}

// certificates makes a CA in pkiDir and a certificate for 127.0.0.1 for
// each name (→ its role), and returns the TLS flags a name's daemon takes.
func (d *daemons) certificates(pkiDir string, roles map[string]string) func(name string) []string {
	d.t.Helper()
	d.run("ca", "init", "--dir", pkiDir)
	for name, role := range roles {
		d.run("ca", "issue", "--dir", pkiDir, "--role", role, "--host", "127.0.0.1", name)
	}
	return func(name string) []string {
		return []string{"--ca", filepath.Join(pkiDir, "ca.crt"), "--cert", filepath.Join(pkiDir, name+".crt"), "--key", filepath.Join(pkiDir, name+".key")}
	}
}

// restart starts name again with the same arguments.
func (d *daemons) restart(name string) { d.start(name, d.args[name]...) }

// upgrade stops name as an operator would and starts bin in its place
// with the same arguments, but for the agent binary (an edge's --agent)
// when agent is not "".
func (d *daemons) upgrade(name, bin, agent string) {
	d.stop(name)
	args := slices.Clone(d.args[name])
	if i := slices.Index(args, "--agent"); i >= 0 && agent != "" {
		args[i+1] = agent
	}
	d.bins[name] = bin
	d.start(name, args...)
}

// TestDaemonsSurviveKill9 runs a cluster of separate processes on the
// container backend (three IAM replicas, two edges, two apiservers, all
// with certificates from dsec ca). SIGKILL of the IAM leader, then of an
// apiserver, while a client that lists both apiservers keeps creating
// (each create reserves quota through IAM) and running commands: no call
// fails, and a project made before the kill is still there. Then SIGKILL
// of an edge and a restart: its sandboxes are re-attached and answer, and
// the listing sees them all.
func TestDaemonsSurviveKill9(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "busybox")
	dir := t.TempDir()
	// The drill takes over two minutes (Ctx's bound).
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	dc := startDaemonCluster(t, ctx, dir, newDaemons(t, dir))
	d, pkiDir, iamAddrs, cl, key := dc.d, dc.pkiDir, dc.iamAddrs, dc.cl, dc.key
	waitAPI := func(a string) { dc.waitAPI(t, ctx, a) }
	e1, e2, a1, a2, wa := dc.edges["edge-1"], dc.edges["edge-2"], dc.apis["api-1"], dc.apis["api-2"], dc.watcher
	run := d.run
	// Every component port takes only the cluster CA's certificates of
	// the roles that call it.
	other := filepath.Join(dir, "other-pki")
	run("ca", "init", "--dir", other)
	run("ca", "issue", "--dir", other, "--role", "apiserver", "--host", "127.0.0.1", "api-x")
	if _, err := pki.LoadIdentity(filepath.Join(pkiDir, "ca.crt"), filepath.Join(other, "api-x.crt"), filepath.Join(other, "api-x.key")); err == nil {
		t.Fatal("an identity whose certificate another CA signed was loaded")
	}
	foreignTLS := func() *tls.Config {
		cert, err := tls.LoadX509KeyPair(filepath.Join(other, "api-x.crt"), filepath.Join(other, "api-x.key"))
		if err != nil {
			t.Fatal(err)
		}
		cfg := mustIdentity(t, pkiDir, "api-1").ClientConfig()
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }
		return cfg
	}()
	refused := func(port, who string, cfg *tls.Config) {
		t.Helper()
		c, err := tls.Dial("tcp", port, cfg)
		if err == nil {
			c.SetDeadline(time.Now().Add(5 * time.Second)) //nolint:errcheck // a test
			_, err = c.Read(make([]byte, 1))               // TLS 1.3 reports a refused client certificate here
			c.Close()
		}
		// A TLS alert, or a reset when the server's close wins the race;
		// the same port answers the right certificates all along.
		if err == nil {
			t.Errorf("%s at %s: not refused", who, port)
		}
	}
	for _, port := range []string{e1, e2} {
		refused(port, "an IAM certificate at an edge", mustIdentity(t, pkiDir, "iam-1").ClientConfig())
		refused(port, "an apiserver certificate of another CA at an edge", foreignTLS)
		// Another edge's certificate connects (edges pull exported
		// snapshots from each other) and reaches nothing else: not the
		// edge's API, not a snapshot without its export's token.
		peer := &http.Client{Transport: &http.Transport{TLSClientConfig: mustIdentity(t, pkiDir, "edge-2").ClientConfig(), ForceAttemptHTTP2: true}}
		for _, path := range []string{"/opendsec.edge.v1.EdgeService/ListSandboxes", "/opendsec.agent.v1.ProcessService/Start", "/dsec-snapshots/snap-x/manifest"} {
			method := http.MethodPost
			if strings.HasPrefix(path, "/dsec-snapshots/") {
				method = http.MethodGet
			}
			req, _ := http.NewRequest(method, "https://"+port+path, strings.NewReader("{}"))
			req.Header.Set("Content-Type", "application/json")
			resp, err := peer.Do(req)
			if err != nil {
				t.Fatalf("an edge certificate at an edge, %s: %v", path, err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusForbidden {
				t.Errorf("an edge certificate at an edge, %s %s: HTTP %d, want 403", method, path, resp.StatusCode)
			}
		}
	}
	refused(iamAddrs["iam-2"], "an edge certificate at an IAM replica", mustIdentity(t, pkiDir, "edge-1").ClientConfig())
	refused(iamAddrs["iam-2"], "another CA's certificate at an IAM replica", foreignTLS)
	refused(wa, "an edge certificate at the watcher", mustIdentity(t, pkiDir, "edge-1").ClientConfig())
	refused(wa, "another CA's certificate at the watcher", foreignTLS)
	noCert := &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13} //nolint:gosec // a client without a certificate, refused
	for _, port := range []string{e1, wa, iamAddrs["iam-1"]} {
		refused(port, "a client without a certificate", noCert)
	}

	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64, DiskMb: 256}}
	var made []*client.Sandbox
	t.Cleanup(func() {
		for _, sb := range made {
			sb.Stop(e2e.Ctx(t)) //nolint:errcheck // best effort
		}
	})
	create := func(n int) {
		t.Helper()
		for range n {
			sb, err := cl.Create(ctx, spec)
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			made = append(made, sb)
		}
	}
	execAll := func(what string) {
		t.Helper()
		for _, sb := range made {
			r, err := sb.Shell(ctx, "echo alive")
			if err != nil || strings.TrimSpace(string(r.GetStdout())) != "alive" {
				t.Fatalf("%s: exec in %s: %v, %v", what, sb.ID, r, err)
			}
		}
	}
	create(6)
	nodes := map[string]int{}
	for _, sb := range made {
		_, node, _ := sandboxid.Parse(sb.ID)
		nodes[string(node)]++
	}
	if len(nodes) != 2 {
		t.Fatalf("6 sandboxes over 2 edges: %v", nodes)
	}

	// kill -9 of the IAM leader: writes (each create's quota reservation)
	// wait for the new leader; nothing acknowledged is lost.
	if _, err := cl.IAM.CreateProject(ctx, connect.NewRequest(&iamv1.CreateProjectRequest{Parent: "root", Name: "before-kill"})); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.IAM.SetQuota(ctx, connect.NewRequest(&iamv1.SetQuotaRequest{Path: "root/before-kill", Quota: &iamv1.Quota{MaxSandboxes: 7}})); err != nil {
		t.Fatal(err)
	}
	keyResp, err := cl.IAM.CreateAPIKey(ctx, connect.NewRequest(&iamv1.CreateAPIKeyRequest{Project: "root/before-kill", Name: "kept"}))
	if err != nil {
		t.Fatal(err)
	}
	st, err := iam.RemoteStatus(ctx, iamAddrs["iam-2"], mustIdentity(t, pkiDir, "iam-2").ClientConfig())
	if err != nil || st.LeaderID == "" {
		t.Fatalf("IAM status: %+v, %v", st, err)
	}
	// A load of creates and execs runs through the client while each of the
	// IAM leader, an apiserver and the watcher is killed.
	phase := func(what string, allowCut bool, kill func()) {
		t.Helper()
		l := startLoad(ctx, cl, spec, made)
		kill()
		time.Sleep(3 * time.Second)
		res := l.stop()
		made = append(made, res.made...)
		var failed []error
		cut := 0
		for _, err := range res.errs {
			if allowCut && cutInFlight(err) {
				cut++
				continue
			}
			failed = append(failed, err)
		}
		t.Logf("%s: load of %d creates and %d execs, %d calls cut in flight", what, res.creates, res.execs, cut)
		if len(failed) > 0 || res.creates < 3 || cut > 3 {
			t.Fatalf("%s: %d creates, %d cut, errors %v", what, res.creates, cut, failed)
		}
		execAll("after " + what)
	}
	phase("kill -9 of the IAM leader", false, func() { d.kill(st.LeaderID) })
	// The project, its quota and its key, made before the leader died.
	p, err := cl.IAM.GetProject(ctx, connect.NewRequest(&iamv1.GetProjectRequest{Path: "root/before-kill"}))
	if err != nil || p.Msg.Project.Quota.GetMaxSandboxes() != 7 {
		t.Fatalf("a project and quota made before the IAM leader died: %v, %v", p, err)
	}
	kept, err := client.New("http://"+a1+",http://"+a2, keyResp.Msg.Secret)
	if err != nil {
		t.Fatal(err)
	}
	if who, err := kept.IAM.WhoAmI(ctx, connect.NewRequest(&iamv1.WhoAmIRequest{})); err != nil || who.Msg.Key.GetProject() != "root/before-kill" {
		t.Fatalf("a key made before the IAM leader died: %v, %v", who, err)
	}
	// The client goes on with the other apiserver. Commands in flight
	// through the one that died fail with the connection (at most one per
	// worker; a command may have run, so it is not sent again); creates are
	// sent again with their key and answer.
	phase("kill -9 of an apiserver", true, func() { d.kill("api-1") })
	// The apiserver polls the edges itself until the watcher is back, then
	// reads it again.
	phase("kill -9 and restart of the watcher", false, func() {
		d.kill("watcher")
		time.Sleep(4 * time.Second)
		d.restart("watcher")
	})
	apiLog, _ := os.ReadFile(filepath.Join(dir, "api-2.log"))
	if n := strings.Count(string(apiLog), "reading the view from a watcher"); n < 2 || !strings.Contains(string(apiLog), "polling the edges directly") {
		t.Fatalf("the apiserver did not fall back to the edges and return to the restarted watcher (%d reads):\n%s", n, apiLog)
	}

	// A create in flight on an apiserver that dies: the client sends it
	// again, with its key, to the other, which takes the dead one's
	// reservation over: it answers with the sandbox that create made, or
	// makes one if none was; one sandbox, counted once.
	d.restart("api-1")
	waitAPI(a1)
	first, err := client.New("http://"+a1+",http://"+a2, strings.TrimSpace(string(key)))
	if err != nil {
		t.Fatal(err)
	}
	type created struct {
		sb  *client.Sandbox
		err error
	}
	got := make(chan created, 1)
	go func() {
		sb, err := first.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.25, MemoryMb: 256}})
		got <- created{sb, err}
	}()
	time.Sleep(300 * time.Millisecond) // the gVisor sandbox takes about a second to start
	d.kill("api-1")
	c := <-got
	if c.err != nil {
		t.Fatalf("create whose apiserver died: %v", c.err)
	}
	made = append(made, c.sb)
	apiLog, _ = os.ReadFile(filepath.Join(dir, "api-2.log"))
	// Either the create had reached the edge (its sandbox is answered) or
	// the edge dropped it with the dead apiserver's connection (a new one is
	// made): a takeover either way.
	if !strings.Contains(string(apiLog), "took over the create of a departed apiserver") {
		t.Fatalf("the create did not go through a takeover:\n%s", apiLog)
	}
	list, err := cl.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Msg.Sandboxes) != len(made) {
		t.Fatalf("after the takeover: %d sandboxes listed, want %d", len(list.Msg.Sandboxes), len(made))
	}
	root, err := cl.IAM.GetProject(ctx, connect.NewRequest(&iamv1.GetProjectRequest{Path: "root"}))
	if err != nil {
		t.Fatal(err)
	}
	if got := root.Msg.Project.Usage.GetSandboxes(); got != int64(len(made)) {
		t.Fatalf("quota usage after the takeover: %d sandboxes, want %d", got, len(made))
	}

	// kill -9 of an edge: its sandboxes keep running; started again, it
	// re-attaches them, and the apiservers' view and listing see them.
	// A load runs from the kill through the restart: creates go to the
	// other edge (the dead one refuses connections), commands run in the
	// other edge's sandboxes; none fails.
	edge1, _ := os.ReadFile(filepath.Join(dir, "edge-1", "node-id"))
	var onEdge2 []*client.Sandbox
	for _, sb := range made {
		if _, node, _ := sandboxid.Parse(sb.ID); string(node) != strings.TrimSpace(string(edge1)) {
			onEdge2 = append(onEdge2, sb)
		}
	}
	d.kill("edge-1")
	l := startLoad(ctx, cl, spec, onEdge2)
	time.Sleep(3 * time.Second)
	d.restart("edge-1")
	time.Sleep(2 * time.Second)
	res := l.stop()
	made = append(made, res.made...)
	t.Logf("kill -9 and restart of an edge: load of %d creates and %d execs", res.creates, res.execs)
	if len(res.errs) > 0 || res.creates < 3 {
		t.Fatalf("load during kill -9 of an edge: %d creates, errors %v", res.creates, res.errs)
	}
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		list, err := cl.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
		if err == nil && len(list.Msg.Sandboxes) == len(made) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("listing after the edge restarted: %v, %v; want %d sandboxes", list, err, len(made))
		}
	}
	execAll("after kill -9 and restart of an edge")
	// The watcher sees every sandbox on the edges again.
	wc := watcherv1connect.NewWatcherServiceClient(&http.Client{Transport: &http.Transport{TLSClientConfig: mustIdentity(t, pkiDir, "api-2").ClientConfig(), ForceAttemptHTTP2: true}}, "https://"+wa, connect.WithGRPC())
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		v, err := wc.GetView(ctx, connect.NewRequest(&watcherv1.GetViewRequest{}))
		var held int64
		healthy := 0
		var nodes []*watcherv1.NodeView
		if err == nil {
			nodes = v.Msg.Nodes
		}
		for _, n := range nodes {
			held += n.Status.GetAllocated().GetSandboxes()
			if n.Healthy {
				healthy++
			}
		}
		if err == nil && healthy == 2 && held == int64(len(made)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the watcher's view: %d healthy edges holding %d sandboxes, want 2 and %d (%v)", healthy, held, len(made), err)
		}
	}
}

// cutInFlight reports a command whose apiserver died while it ran: its
// connection broke (a create is sent again with its key instead).
func cutInFlight(err error) bool {
	msg := err.Error()
	return strings.HasPrefix(msg, "exec in ") && strings.Contains(msg, "unexpected EOF")
}

// gvisorSpec is the load's gVisor sandbox.
var gvisorSpec = &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 128, DiskMb: 64}}

// load creates sandboxes (8 per goroutine at most, the first 2 of one
// goroutine on gVisor) and runs commands in
// them and in the sandboxes made before it from 3 goroutines until stop, which lets each finish the
// call it is in (a create cut short could leave a sandbox nobody counts).
type load struct {
	stopping atomic.Bool
	wg       sync.WaitGroup
	mu       sync.Mutex
	res      loadResult
}

type loadResult struct {
	creates, execs int
	errs           []error
	made           []*client.Sandbox
}

func startLoad(ctx context.Context, cl *client.Client, spec *sandboxv1.SandboxSpec, existing []*client.Sandbox) *load {
	l := &load{}
	for w := range 3 {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			var mine []*client.Sandbox
			for i := 0; !l.stopping.Load(); i++ {
				// A create every other round, 8 at most each: the rest of
				// the time, execs.
				if i%2 == 0 && len(mine) < 8 {
					s := spec
					if w == 0 && len(mine) < 2 {
						s = gvisorSpec // both backends under load
					}
					cctx, cancel := context.WithTimeout(ctx, time.Minute)
					sb, err := cl.Create(cctx, s)
					cancel()
					if err != nil {
						l.add(func(r *loadResult) { r.errs = append(r.errs, fmt.Errorf("create: %w", err)) })
						time.Sleep(200 * time.Millisecond)
						continue
					}
					mine = append(mine, sb)
					l.add(func(r *loadResult) { r.creates++; r.made = append(r.made, sb) })
				}
				targets := []*client.Sandbox{existing[(w+i)%len(existing)]}
				if len(mine) > 0 {
					targets = append(targets, mine[i%len(mine)])
				}
				for _, target := range targets {
					cctx, cancel := context.WithTimeout(ctx, time.Minute)
					out, err := target.Shell(cctx, "echo alive")
					cancel()
					if err != nil || strings.TrimSpace(string(out.GetStdout())) != "alive" {
						l.add(func(r *loadResult) { r.errs = append(r.errs, fmt.Errorf("exec in %s: %v, %v", target.ID, out, err)) })
						continue
					}
					l.add(func(r *loadResult) { r.execs++ })
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	return l
}

func (l *load) add(f func(*loadResult)) {
	l.mu.Lock()
	f(&l.res)
	l.mu.Unlock()
}

func (l *load) stop() loadResult {
	l.stopping.Store(true)
	l.wg.Wait()
	return l.res
}
