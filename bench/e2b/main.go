// Command e2b measures the E2B gateway's overhead: the same operations on
// the same gVisor sandboxes through E2B's wire protocol (REST create,
// envd's process.Start stream, a /files upload) and through our native API
// (CreateSandbox, ProcessService.Run, FilesystemService.WriteFile), in one
// run, over HTTP/2 as the SDKs speak it. It prints p50/p99 side by side
// with the ratio e2b/native. Needs root, runsc and the store `make images`
// fills (root/py:3.11, E2B's "base").
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"time"

	"connectrpc.com/connect"

	envdprocess "github.com/opendsec/opendsec/api/gen/e2b/process"
	"github.com/opendsec/opendsec/api/gen/e2b/process/envdprocessconnect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/gateway/e2b"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with root/py:3.11")
	agent := flag.String("agent", "bin/aether", "aether binary")
	creates := flag.Int("creates", 5, "sandboxes created on each path")
	n := flag.Int("n", 50, "iterations of exec and file write")
	flag.Parse()
	if err := run(context.Background(), *store, *agent, *creates, *n); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

const image = "root/py:3.11"

func run(ctx context.Context, storeDir, agent string, creates, n int) error {
	c, err := benchcluster.Start(ctx, storeDir, agent, benchcluster.Backend{Name: gvisor.Name, Factory: gvisor.New}, func(cfg *embed.Config) {
		cfg.GatewayListen, cfg.Gateway = "127.0.0.1:0", e2b.Config{BaseImage: image, Backend: gvisor.Name}
	})
	if err != nil {
		return err
	}
	defer func() {
		c.Edge.DestroyAll(context.Background(), "root")
		c.Close()
	}()
	native, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	gw := &gatewayClient{url: c.GatewayURL, key: benchstat.EnvValue(c.ClientEnv, "E2B_API_KEY"), http: h2c()}
	spec := func() *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: "gvisor", Image: image, TimeoutSeconds: 600}
	}

	// Warm-up on both paths: layers unpacked, connections open.
	if sb, err := native.Create(ctx, spec()); err != nil {
		return err
	} else {
		sb.Stop(ctx)
	}
	if sb, err := gw.create(); err != nil {
		return err
	} else {
		gw.kill(sb.SandboxID)
	}

	var nativeCreate, e2bCreate []time.Duration
	for i := 0; i < creates; i++ {
		t0 := time.Now()
		sb, err := native.Create(ctx, spec())
		if err != nil {
			return err
		}
		nativeCreate = append(nativeCreate, time.Since(t0))
		sb.Stop(ctx)

		t0 = time.Now()
		e, err := gw.create()
		if err != nil {
			return err
		}
		e2bCreate = append(e2bCreate, time.Since(t0))
		gw.kill(e.SandboxID)
	}

	// One sandbox for exec and files, reached both ways.
	e, err := gw.create()
	if err != nil {
		return err
	}
	defer gw.kill(e.SandboxID)
	sb := native.Sandbox(e.SandboxID)
	envd := envdprocessconnect.NewProcessClient(&http.Client{Transport: envdHeaders{h2c(), e.SandboxID, e.EnvdAccessToken}}, c.GatewayURL)

	var nativeExec, e2bExec []time.Duration
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if _, err := sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"/bin/true"}}); err != nil {
			return err
		}
		nativeExec = append(nativeExec, time.Since(t0))

		t0 = time.Now()
		if err := startAndWait(ctx, envd); err != nil {
			return err
		}
		e2bExec = append(e2bExec, time.Since(t0))
	}

	mb := bytes.Repeat([]byte("x"), 1<<20)
	var nativeWrite, e2bWrite []time.Duration
	for i := 0; i < n; i++ {
		t0 := time.Now()
		if _, err := sb.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: "/tmp/native.bin", Data: mb})); err != nil {
			return err
		}
		nativeWrite = append(nativeWrite, time.Since(t0))

		t0 = time.Now()
		if err := gw.upload(e, "/tmp/e2b.bin", mb); err != nil {
			return err
		}
		e2bWrite = append(e2bWrite, time.Since(t0))
	}

	// A login shell's first prompt in a PTY, idle and with the node's two
	// cores kept busy (E2B's PTY tests give it about 300 ms).
	var nativePty, e2bPty, nativePtyLoaded, e2bPtyLoaded []time.Duration
	for _, loaded := range []bool{false, true} {
		stop := func() {}
		if loaded {
			stop = busyHost(2)
		}
		for i := 0; i < n; i++ {
			d, err := nativePrompt(ctx, sb)
			if err != nil {
				stop()
				return err
			}
			e, err := e2bPrompt(ctx, envd)
			if err != nil {
				stop()
				return err
			}
			if loaded {
				nativePtyLoaded, e2bPtyLoaded = append(nativePtyLoaded, d), append(e2bPtyLoaded, e)
			} else {
				nativePty, e2bPty = append(nativePty, d), append(e2bPty, e)
			}
		}
		stop()
	}

	fmt.Printf("E2B gateway vs native API (gvisor, %s, %d creates, %d execs, writes and PTYs, %s)\n\n", image, creates, n, time.Now().Format(time.RFC3339))
	fmt.Printf("%-22s %11s %11s %11s %11s   %s\n", "measurement", "native p50", "native p99", "e2b p50", "e2b p99", "overhead (p50)")
	row := func(name string, nat, gw []time.Duration, decimals int) {
		fmt.Printf("%-22s %11s %11s %11s %11s   e2b/native = %.2fx\n", name,
			benchstat.Ms(benchstat.Pct(nat, 50), decimals), benchstat.Ms(benchstat.Pct(nat, 99), decimals),
			benchstat.Ms(benchstat.Pct(gw, 50), decimals), benchstat.Ms(benchstat.Pct(gw, 99), decimals),
			float64(benchstat.Pct(gw, 50))/float64(benchstat.Pct(nat, 50)))
	}
	row("create", nativeCreate, e2bCreate, 0)
	row("exec round trip", nativeExec, e2bExec, 2)
	row("write 1 MiB file", nativeWrite, e2bWrite, 2)
	row("PTY first prompt", nativePty, e2bPty, 1)
	row("  2 cores busy", nativePtyLoaded, e2bPtyLoaded, 1)
	fmt.Println("\nexec: /bin/true, native ProcessService.Run vs envd process.Start streamed to its end event;")
	fmt.Println("write: native WriteFile vs POST /files (octet-stream; written in place in 4 MiB agent writes, as envd does).")
	fmt.Println("PTY: bash -i -l as user in a 24x80 PTY, from the start call to the prompt's \"$ \"; busy: two host processes spinning.")
	return nil
}

// h2c is an HTTP/2 client over plain TCP, as E2B's SDKs use for http URLs.
func h2c() *http.Transport {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Transport{
		Protocols:   &p,
		DialContext: (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
		// Unused with unencrypted HTTP/2; set so no TLS default applies.
		TLSClientConfig: &tls.Config{},
	}
}

type envdHeaders struct {
	next      http.RoundTripper
	id, token string
}

func (e envdHeaders) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", e.id)
	r.Header.Set("E2b-Sandbox-Port", "49983")
	r.Header.Set("X-Access-Token", e.token)
	return e.next.RoundTrip(r)
}

func startAndWait(ctx context.Context, envd envdprocessconnect.ProcessClient) error {
	stream, err := envd.Start(ctx, connect.NewRequest(&envdprocess.StartRequest{Process: &envdprocess.ProcessConfig{Cmd: "/bin/true"}}))
	if err != nil {
		return err
	}
	defer stream.Close()
	for stream.Receive() {
		if end := stream.Msg().Event.GetEnd(); end != nil {
			if end.ExitCode != 0 {
				return fmt.Errorf("envd start: exit %d", end.ExitCode)
			}
			return nil
		}
	}
	if err := stream.Err(); err != nil {
		return err
	}
	return fmt.Errorf("envd start: stream ended without an end event")
}

type gatewayClient struct {
	url, key string
	http     *http.Transport
}

type sandboxJSON struct {
	SandboxID       string `json:"sandboxID"`
	EnvdAccessToken string `json:"envdAccessToken"`
}

func (g *gatewayClient) do(req *http.Request, want int) ([]byte, error) {
	resp, err := (&http.Client{Transport: g.http}).Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		return nil, fmt.Errorf("%s %s: %d %s", req.Method, req.URL.Path, resp.StatusCode, body)
	}
	return body, nil
}

func (g *gatewayClient) create() (sandboxJSON, error) {
	req, _ := http.NewRequest("POST", g.url+"/v2/sandboxes", strings.NewReader(`{"templateID":"base","timeout":600}`))
	req.Header.Set("X-API-Key", g.key)
	req.Header.Set("Content-Type", "application/json")
	body, err := g.do(req, http.StatusCreated)
	if err != nil {
		return sandboxJSON{}, err
	}
	var sb sandboxJSON
	return sb, json.Unmarshal(body, &sb)
}

func (g *gatewayClient) kill(id string) {
	req, _ := http.NewRequest("DELETE", g.url+"/sandboxes/"+id, nil)
	req.Header.Set("X-API-Key", g.key)
	g.do(req, http.StatusNoContent) //nolint:errcheck // best effort between rounds
}

func (g *gatewayClient) upload(sb sandboxJSON, path string, data []byte) error {
	req, _ := http.NewRequest("POST", g.url+"/files?path="+path, bytes.NewReader(data))
	req.Header.Set("E2b-Sandbox-Id", sb.SandboxID)
	req.Header.Set("X-Access-Token", sb.EnvdAccessToken)
	req.Header.Set("Content-Type", "application/octet-stream")
	_, err := g.do(req, http.StatusOK)
	return err
}

// busyHost keeps n host processes spinning until the returned function.
func busyHost(n int) func() {
	var cmds []*exec.Cmd
	for i := 0; i < n; i++ {
		c := exec.Command("sh", "-c", "while :; do :; done")
		if c.Start() == nil {
			cmds = append(cmds, c)
		}
	}
	return func() {
		for _, c := range cmds {
			c.Process.Kill() //nolint:errcheck // waited for below
			c.Wait()         //nolint:errcheck // killed
		}
	}
}

// promptSeen is how a login shell's prompt ends.
var promptSeen = []byte("$ ")

// untilPrompt reads a PTY's events with next (its output and, once, the
// shell's pid) until the prompt shows; it answers when that was after t0.
func untilPrompt(t0 time.Time, next func() (data []byte, pid uint32, ok bool)) (time.Duration, uint32, []byte, bool) {
	var out []byte
	var shell uint32
	for {
		data, pid, ok := next()
		if !ok {
			return 0, shell, out, false
		}
		if pid != 0 {
			shell = pid
		}
		if out = append(out, data...); bytes.Contains(out, promptSeen) {
			return time.Since(t0), shell, out, true
		}
	}
}

// nativePrompt starts a login shell in a PTY through our API and times
// its prompt; it then exits it.
func nativePrompt(ctx context.Context, sb *client.Sandbox) (time.Duration, error) {
	t0 := time.Now()
	stream, err := sb.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{
		Args: []string{"/bin/bash", "-i", "-l"}, User: "user", Pty: &agentv1.PtySize{Rows: 24, Cols: 80},
	}}))
	if err != nil {
		return 0, err
	}
	defer stream.Close()
	d, pid, out, ok := untilPrompt(t0, func() ([]byte, uint32, bool) {
		if !stream.Receive() {
			return nil, 0, false
		}
		ev := stream.Msg().Event
		return ev.GetOutput().GetData(), ev.GetStarted().GetPid(), true
	})
	if !ok {
		return 0, fmt.Errorf("native PTY: no prompt in %q: %v", out, stream.Err())
	}
	_, err = sb.Process.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{
		Process: &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Pid{Pid: pid}}, Data: []byte("exit\n"),
	}))
	return d, err
}

// e2bPrompt does the same through envd's protocol, as the SDKs' pty.create.
func e2bPrompt(ctx context.Context, envd envdprocessconnect.ProcessClient) (time.Duration, error) {
	t0 := time.Now()
	stream, err := envd.Start(ctx, connect.NewRequest(&envdprocess.StartRequest{
		Process: &envdprocess.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-i", "-l"}},
		Pty:     &envdprocess.PTY{Size: &envdprocess.PTY_Size{Rows: 24, Cols: 80}},
	}))
	if err != nil {
		return 0, err
	}
	defer stream.Close()
	d, pid, out, ok := untilPrompt(t0, func() ([]byte, uint32, bool) {
		if !stream.Receive() {
			return nil, 0, false
		}
		ev := stream.Msg().Event
		return ev.GetData().GetPty(), ev.GetStart().GetPid(), true
	})
	if !ok {
		return 0, fmt.Errorf("e2b PTY: no prompt in %q: %v", out, stream.Err())
	}
	_, err = envd.SendInput(ctx, connect.NewRequest(&envdprocess.SendInputRequest{
		Process: &envdprocess.ProcessSelector{Selector: &envdprocess.ProcessSelector_Pid{Pid: pid}},
		Input:   &envdprocess.ProcessInput{Input: &envdprocess.ProcessInput_Pty{Pty: []byte("exit\n")}},
	}))
	return d, err
}
