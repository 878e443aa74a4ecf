package sudo

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/spawn"
	"github.com/opendsec/opendsec/internal/sysuser"
	"github.com/opendsec/opendsec/internal/testutil"
)

func TestParseArgs(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want Request
		help bool
	}{
		{[]string{"apt-get", "install", "-y", "x"}, Request{Args: []string{"apt-get", "install", "-y", "x"}}, false},
		{[]string{"-nE", "-u", "postgres", "psql", "-c", "select 1"}, Request{Args: []string{"psql", "-c", "select 1"}, User: "postgres", PreserveEnv: true}, false},
		{[]string{"-upostgres", "--", "-weird"}, Request{Args: []string{"-weird"}, User: "postgres"}, false},
		{[]string{"--user=www", "--preserve-env", "id"}, Request{Args: []string{"id"}, User: "www", PreserveEnv: true}, false},
		{[]string{"-i"}, Request{Args: []string{}, Login: true}, false},
		{[]string{"-s", "echo", "$HOME"}, Request{Args: []string{"echo", "$HOME"}, Shell: true}, false},
		{[]string{"-S", "-p", "pw:", "true"}, Request{Args: []string{"true"}}, false},
		{nil, Request{}, true},
	} {
		o, err := parseArgs(tc.args)
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if !reflect.DeepEqual(o.req, tc.want) || o.help != tc.help {
			t.Errorf("%v: got %+v help=%v, want %+v help=%v", tc.args, o.req, o.help, tc.want, tc.help)
		}
	}
	for _, bad := range [][]string{{"-b", "x"}, {"-g", "wheel", "x"}, {"-u"}, {"--frobnicate"}, {"--list=x"}} {
		if _, err := parseArgs(bad); err == nil {
			t.Errorf("%v: accepted", bad)
		}
	}
}

// sandboxRoot writes passwd, group and sudoers files below a new root.
func sandboxRoot(t *testing.T, sudoers map[string]string) string {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "etc", "sudoers.d"), 0o755)
	os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte(
		"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\nops:x:1001:1001::/home/ops:/bin/sh\nguest:x:1002:1002::/home/guest:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc", "group"), []byte("root:x:0:\nuser:x:1000:\nops:x:1001:\nguest:x:1002:\nadmins:x:50:ops\n"), 0o644)
	for name, text := range sudoers {
		os.WriteFile(filepath.Join(root, "etc", name), []byte(text), 0o440)
	}
	return root
}

func TestPolicyHonoursNopasswdRulesOnly(t *testing.T) {
	root := sandboxRoot(t, map[string]string{
		"sudoers":             "Defaults env_reset\n# user ALL=(ALL) NOPASSWD:ALL\n%sudo ALL=(ALL:ALL) ALL\n#includedir /etc/sudoers.d\n",
		"sudoers.d/user":      "user ALL=(ALL) NOPASSWD:ALL\n",
		"sudoers.d/admins":    "%admins ALL=(ALL) \\\n   NOPASSWD: ALL\n",
		"sudoers.d/guest.bak": "guest ALL=(ALL) NOPASSWD:ALL\n", // names with a dot are skipped, as sudo does
	})
	db := sysuser.DB{Root: root}
	p := LoadPolicy(root)
	for name, want := range map[string]bool{"root": true, "user": true, "ops": true, "guest": false} {
		u, err := db.Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		if got := p.Allows(db, u); got != want {
			t.Errorf("%s: allowed=%v, want %v", name, got, want)
		}
	}
}

// startBroker serves a broker in a temporary directory. With uid >= 0 the
// caller appears as uid; with -1 it proves who it is (root, in tests).
func startBroker(t *testing.T, root string, uid int) string {
	testutil.RequireRoot(t)
	dir := filepath.Join(t.TempDir(), "sudo")
	ln, err := Listen(dir)
	if err != nil {
		t.Fatal(err)
	}
	b := NewBroker(dir, &spawn.Spawner{Users: sysuser.DB{Root: root}}, testutil.Logger(t))
	if uid >= 0 {
		b.identify = func(c net.Conn, in *bufio.Reader) (uint32, error) { return uint32(uid), nil }
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go b.Serve(ctx, ln)
	return dir
}

// runCaptured runs req through the broker with stdout and stderr in files.
func runCaptured(t *testing.T, sock string, req Request) (int, syscall.Signal, string, error) {
	dir := t.TempDir()
	in, _ := os.Open(os.DevNull)
	out, _ := os.Create(filepath.Join(dir, "out"))
	defer in.Close()
	defer out.Close()
	code, sig, err := run(sock, req, [3]*os.File{in, out, out})
	data, _ := os.ReadFile(filepath.Join(dir, "out"))
	return code, sig, string(data), err
}

func TestBrokerRunsAsTargetWithSudoEnvironment(t *testing.T) {
	sock := startBroker(t, "/", -1)
	code, _, out, err := runCaptured(t, sock, Request{
		Args: []string{"/bin/sh", "-c", `echo "$(id -u) $PATH $SUDO_USER $HOME [$SECRET] $TERM"; exit 3`},
		Env:  []string{"SECRET=kept-only-with-E", "TERM=xterm", "PATH=/evil"}, Cwd: "/",
	})
	if err != nil || code != 3 {
		t.Fatalf("code %d, err %v", code, err)
	}
	if want := "0 " + securePath + " root /root [] xterm\n"; out != want {
		t.Fatalf("output %q, want %q", out, want)
	}
	_, _, out, _ = runCaptured(t, sock, Request{Args: []string{"/bin/sh", "-c", `echo "[$SECRET]"`}, Env: []string{"SECRET=s"}, Cwd: "/", PreserveEnv: true})
	if out != "[s]\n" {
		t.Fatalf("-E output %q", out)
	}
	if _, _, _, err := runCaptured(t, sock, Request{Args: []string{"no-such-program-x"}, Cwd: "/"}); err == nil || !strings.Contains(err.Error(), "command not found") {
		t.Fatalf("missing program: %v", err)
	}
}

func TestBrokerRefusesCallersWithoutNopasswd(t *testing.T) {
	root := sandboxRoot(t, map[string]string{"sudoers.d/user": "user ALL=(ALL) NOPASSWD:ALL\n"})
	refused := startBroker(t, root, 1002)
	_, _, _, err := runCaptured(t, refused, Request{Args: []string{"/bin/true"}, Cwd: "/"})
	if err == nil || !strings.Contains(err.Error(), "guest may not run commands as root") {
		t.Fatalf("guest: %v", err)
	}
	allowed := startBroker(t, root, 1000)
	if code, _, _, err := runCaptured(t, allowed, Request{Validate: true}); err != nil || code != 0 {
		t.Fatalf("user -v: %d %v", code, err)
	}
}

// rawRequest opens a connection and sends req with /dev/null as stdio.
func rawRequest(t *testing.T, sock string, req Request) *net.UnixConn {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: socketIn(sock), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	null, _ := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	defer null.Close()
	body, _ := json.Marshal(req)
	msg := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	fd := int(null.Fd())
	if _, _, err := c.WriteMsgUnix(msg, syscall.UnixRights(fd, fd, fd), nil); err != nil {
		t.Fatal(err)
	}
	c.Write(body)
	return c
}

func TestBrokerForwardsSignalsAndKillsWhenTheClientGoes(t *testing.T) {
	sock := startBroker(t, "/", 0)
	noProof := func(string) error { return nil }
	// The command says when it runs: a signal relayed before the broker
	// started it would be lost, and the test would wait on sleep 600.
	started := filepath.Join(t.TempDir(), "started")
	c := rawRequest(t, sock, Request{Args: []string{"/bin/sh", "-c", "touch " + started + "; exec sleep 600"}, Cwd: "/"})
	c.SetReadDeadline(time.Now().Add(60 * time.Second)) // a lost signal fails the test, not CI's timeout
	waitFile(t, started)
	data, _ := json.Marshal(Message{Signal: int(syscall.SIGTERM)})
	c.Write(append(data, '\n'))
	code, sig, err := readResult(c, noProof)
	c.Close()
	if err != nil || sig != syscall.SIGTERM {
		t.Fatalf("after SIGTERM: code %d sig %v err %v", code, sig, err)
	}

	pidFile := filepath.Join(t.TempDir(), "pid")
	c = rawRequest(t, sock, Request{Args: []string{"/bin/sh", "-c", "echo $$ > " + pidFile + "; exec sleep 600"}, Cwd: "/"})
	var pid int
	for i := 0; i < 100 && pid == 0; i++ {
		time.Sleep(50 * time.Millisecond)
		data, _ := os.ReadFile(pidFile)
		pid, _ = strconv.Atoi(strings.TrimSpace(string(data)))
	}
	if pid == 0 {
		t.Fatal("command did not start")
	}
	c.Close()
	for i := 0; i < 100; i++ {
		if syscall.Kill(pid, 0) != nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("pid %d outlived its sudo client", pid)
}

func TestBrokerRejectsMalformedRequests(t *testing.T) {
	sock := startBroker(t, "/", 0)
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: socketIn(sock), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := []byte(`{"args":["true"]}`)
	c.Write(append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)) // no descriptors
	if _, _, err := readResult(c, func(string) error { return nil }); err == nil || !strings.Contains(err.Error(), "descriptors") {
		t.Fatalf("request without descriptors: %v", err)
	}
}

func FuzzParseArgs(f *testing.F) {
	f.Add("-nEu\x00root\x00--\x00ls")
	f.Add("--user\x00")
	f.Fuzz(func(t *testing.T, joined string) {
		o, err := parseArgs(strings.Split(joined, "\x00"))
		if err == nil && o.req.Args == nil && !o.help {
			t.Fatalf("%q: no command and no help", joined)
		}
	})
}

func FuzzPolicyAndRequest(f *testing.F) {
	f.Add([]byte("user ALL=(ALL) NOPASSWD:ALL\n%g,bob ALL=NOPASSWD: /bin/ls \\\n"), []byte(`{"args":["x"],"env":["A=1","=","B"]}`))
	f.Fuzz(func(t *testing.T, sudoers, request []byte) {
		p := Policy{users: map[string]bool{}, groups: map[string]bool{}}
		p.add(sudoers)
		p.Allows(sysuser.DB{Root: t.TempDir()}, sysuser.User{Name: "user", UID: 1000, GID: 1000})
		if r, err := decodeRequest(request); err == nil {
			env := commandEnv(r, "user", 1000, 1000, "/bin/sh", r.Args)
			if env["PATH"] != securePath {
				t.Fatalf("PATH %q", env["PATH"])
			}
		}
	})
}

// The identity proof: the owner of the file the client creates is who it
// is; a link to someone else's file proves nothing.
func TestChallengeReadsTheProofFilesOwner(t *testing.T) {
	testutil.RequireRoot(t)
	dir := filepath.Join(t.TempDir(), "sudo")
	ln, err := Listen(dir)
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	if fi, _ := os.Stat(proofsIn(dir)); fi.Mode()&os.ModeSticky == 0 || fi.Mode().Perm() != 0o733 {
		t.Fatalf("proof directory mode %v", fi.Mode())
	}
	b := NewBroker(dir, &spawn.Spawner{Users: sysuser.DB{Root: "/"}}, nil)
	victim := filepath.Join(t.TempDir(), "root-owned")
	os.WriteFile(victim, nil, 0o600)
	for name, tc := range map[string]struct {
		make    func(p string) error
		wantUID uint32
		wantErr string
	}{
		"own file": {func(p string) error {
			if err := os.WriteFile(p, nil, 0o600); err != nil {
				return err
			}
			return os.Chown(p, 1000, 1000) // as if user 1000 had created it
		}, 1000, ""},
		"hard link": {func(p string) error { return os.Link(victim, p) }, 0, "not a new plain file"},
		"symlink":   {func(p string) error { return os.Symlink(victim, p) }, 0, "not a new plain file"},
		"no file":   {func(string) error { return nil }, 0, "identity proof"},
	} {
		client, server := net.Pipe()
		errc := make(chan error, 1)
		go func() {
			_, _, err := readResult(client, func(nonce string) error {
				if err := tc.make(filepath.Join(proofsIn(dir), nonce)); err != nil {
					return err
				}
				data, _ := json.Marshal(Message{Proved: true})
				_, err := client.Write(append(data, '\n'))
				return err
			})
			errc <- err
		}()
		uid, err := b.challenge(server, bufio.NewReader(server))
		server.Close()
		<-errc
		if tc.wantErr == "" && (err != nil || uid != tc.wantUID) || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
			t.Errorf("%s: uid %d, err %v", name, uid, err)
		}
		if ents, _ := os.ReadDir(proofsIn(dir)); len(ents) != 0 {
			t.Errorf("%s: proof left behind: %v", name, ents)
		}
	}
}

// waitFile waits until path exists.
func waitFile(t *testing.T, path string) {
	t.Helper()
	for i := 0; i < 3000; i++ {
		if _, err := os.Stat(path); err == nil {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s did not appear within 30s", path)
}
