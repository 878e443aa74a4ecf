package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/image/baseimage"
	"github.com/opendsec/opendsec/internal/testutil"
)

// BusyboxStore makes an image store under dir holding root/busybox:latest
// and returns its path, for clusters of separate processes.
func BusyboxStore(t *testing.T, dir string) string {
	t.Helper()
	storeDir := filepath.Join(dir, "images")
	store, err := image.OpenStore(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := image.ParseRef("root/busybox:latest")
	if _, err := baseimage.Build(context.Background(), store, "busybox", ref, baseimage.Options{}); err != nil {
		t.Fatal(err)
	}
	return storeDir
}

// APIClients returns a client of every apiserver of c, with key.
func APIClients(t *testing.T, c *Cluster, key string) []*client.Client {
	t.Helper()
	var out []*client.Client
	for _, u := range c.APIURLs {
		cl, err := client.New(u, key)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, cl)
	}
	return out
}

var (
	dsecOnce sync.Once
	dsecBin  string
	dsecErr  error
)

// DsecBinary builds cmd/dsec once per test process.
func DsecBinary(t *testing.T) string {
	dsecOnce.Do(func() {
		dir, err := testutil.ProcessDir("dsec-cli")
		if err != nil {
			dsecErr = err
			return
		}
		dsecBin = filepath.Join(dir, "dsec")
		cmd := exec.Command("go", "build", "-o", dsecBin, "./cmd/dsec")
		cmd.Dir = testutil.RepoRoot(t)
		if out, err := cmd.CombinedOutput(); err != nil {
			dsecErr = err
			t.Logf("%s", out)
		}
	})
	if dsecErr != nil {
		t.Fatal(dsecErr)
	}
	return dsecBin
}

// UpProcess is a `dsec up` of the test's own, run as a separate process so
// it can be killed with SIGKILL.
type UpProcess struct {
	Cmd    *exec.Cmd
	Client *client.Client
	Node   string
}

// FreePort finds a free port below the kernel's ephemeral range
// (ip_local_port_range starts at 32768 by default). A port the kernel
// handed out (":0") and the test closed could be handed out again to one of
// dsec up's own ":0" listeners before dsec up binds its API to it: that
// once failed a restart with "address already in use".
// It never hands out a port twice (a test's daemons take theirs later),
// and each e2e package draws from a slice of its own, so packages run side
// by side never hand out the same port.
func FreePort(t *testing.T) int {
	handedMu.Lock()
	defer handedMu.Unlock()
	lo := portSlice(filepath.Base(os.Args[0]))
	for i := 0; i < 100; i++ {
		port := lo + rand.IntN(portSliceLen)
		if handed[port] {
			continue
		}
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
			l.Close()
			handed[port] = true
			return port
		}
	}
	t.Fatalf("no free port in %d-%d", lo, lo+portSliceLen-1)
	return 0
}

// The e2e packages' port slices: 20000-31899 cut in seven.
const portSliceLen = 1700

var e2ePackages = []string{"controlplane", "crash", "hostile", "images", "network", "sandboxes"}

// portSlice is the first port of the slice of the test binary named bin
// ("crash.test"); any other binary takes the last slice.
func portSlice(bin string) int {
	name := strings.TrimSuffix(bin, ".test")
	for i, p := range e2ePackages {
		if p == name {
			return 20000 + i*portSliceLen
		}
	}
	return 20000 + len(e2ePackages)*portSliceLen
}

var (
	handedMu sync.Mutex
	handed   = map[int]bool{} // guarded by handedMu
)

// UpNode is a state directory, and an image store with root/busybox, for
// dsec up processes of a test's own, which it may kill and start again on
// the same state.
type UpNode struct{ Bin, State, Store string }

func NewUpNode(t *testing.T) UpNode {
	t.Helper()
	dir := t.TempDir()
	n := UpNode{Bin: DsecBinary(t), State: filepath.Join(dir, "state"), Store: filepath.Join(dir, "images")}
	if out, err := exec.Command(n.Bin, "image", "build", "busybox", "--store", n.Store).CombinedOutput(); err != nil {
		t.Fatalf("build busybox: %v: %s", err, out)
	}
	os.MkdirAll(n.State, 0o700)
	return n
}

// Start runs dsec up on the node's state (StartUp).
func (n UpNode) Start(t *testing.T, extra ...string) *UpProcess {
	return StartUp(t, n.Bin, n.State, n.Store, extra...)
}

// StartUp runs dsec up on state and waits until it serves; extra flags
// come last, so they override the defaults (--backends container,gvisor).
func StartUp(t *testing.T, bin, state, store string, extra ...string) *UpProcess {
	t.Helper()
	os.Remove(filepath.Join(state, "client.env"))
	logf, err := os.OpenFile(filepath.Join(state, "dsec.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(bin, "up", "--state-dir", state, "--listen", fmt.Sprintf("127.0.0.1:%d", FreePort(t)), "--e2b-listen", "",
		"--image-store", store, "--agent", testutil.AgentBinary(t), "--backends", "container,gvisor")
	cmd.Args = append(cmd.Args, extra...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	env := filepath.Join(state, "client.env")
	for i := 0; ; i++ {
		if _, err := os.Stat(env); err == nil {
			break
		}
		if i == 600 {
			cmd.Process.Kill()
			t.Fatalf("dsec up did not start; log: %s", TailFile(filepath.Join(state, "dsec.log")))
		}
		time.Sleep(50 * time.Millisecond)
	}
	data, _ := os.ReadFile(env)
	cl, err := client.New(EnvValue(string(data), "DSEC_API_URL"), EnvValue(string(data), "DSEC_API_KEY"))
	if err != nil {
		t.Fatal(err)
	}
	node, _ := os.ReadFile(filepath.Join(state, "edge", "node-id"))
	return &UpProcess{Cmd: cmd, Client: cl, Node: strings.TrimSpace(string(node))}
}

func TailFile(p string) string {
	data, _ := os.ReadFile(p)
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return string(data)
}

// MicrovmUpFlags are dsec up's flags for the microvm backend alone, or the
// test skips (fails, strict) where the node cannot run it.
func MicrovmUpFlags(t *testing.T) []string {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "qemu-system-x86_64")
	testutil.RequireBinary(t, "mkfs.ext4")
	return []string{"--backends", "microvm", "--microvm-guest", testutil.GuestKernelDir(t), "--microvm-init", testutil.VMInitBinary(t)}
}

// RunCLI runs the dsec binary bin with env added to this process's, stdin
// as its input, and returns its stdout, stderr and exit code.
func RunCLI(t *testing.T, bin string, env []string, stdin string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}
