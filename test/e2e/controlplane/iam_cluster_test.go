package controlplane

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestIAMReplicasAsDaemons runs three `dsec iam` processes with
// certificates from `dsec ca`, kills the leader with SIGKILL, and checks
// that the others elect a new one, that the killed replica comes back with
// its state and follows, that a replica can be removed, and that the port
// refuses a certificate of another role.
func TestIAMReplicasAsDaemons(t *testing.T) {
	bin := e2e.DsecBinary(t)
	dir := t.TempDir()
	pkiDir := filepath.Join(dir, "pki")
	run := func(args ...string) (string, error) {
		t.Helper()
		out, err := exec.Command(bin, args...).CombinedOutput()
		return string(out), err
	}
	if out, err := run("ca", "init", "--dir", pkiDir); err != nil {
		t.Fatalf("ca init: %v\n%s", err, out)
	}
	if out, err := run("ca", "init", "--dir", pkiDir); err == nil || !strings.Contains(out, "already holds a CA") {
		t.Fatalf("second ca init: %v\n%s", err, out)
	}
	if out, err := run("ca", "issue", "--dir", pkiDir, "--role", "boss", "x"); err == nil || !strings.Contains(out, `role "boss"`) {
		t.Fatalf("issue with an unknown role: %v\n%s", err, out)
	}
	ids := []string{"iam-1", "iam-2", "iam-3"}
	for _, id := range append(ids, "edge-1") {
		role := "iam"
		if id == "edge-1" {
			role = "edge"
		}
		if out, err := run("ca", "issue", "--dir", pkiDir, "--role", role, "--host", "127.0.0.1", id); err != nil {
			t.Fatalf("ca issue %s: %v\n%s", id, err, out)
		}
	}
	tlsFlags := func(id string) []string {
		return []string{"--ca", filepath.Join(pkiDir, "ca.crt"), "--cert", filepath.Join(pkiDir, id+".crt"), "--key", filepath.Join(pkiDir, id+".key")}
	}
	addrs := map[string]string{}
	for _, id := range ids {
		addrs[id] = freeAddr(t)
	}
	procs := map[string]*exec.Cmd{}
	start := func(id string, extra ...string) {
		t.Helper()
		args := append([]string{"iam", "--id", id, "--dir", filepath.Join(dir, id), "--bind", addrs[id]}, tlsFlags(id)...)
		cmd := exec.Command(bin, append(args, extra...)...)
		logf, err := os.OpenFile(filepath.Join(dir, id+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		defer logf.Close()
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs[id] = cmd
	}
	t.Cleanup(func() {
		for _, p := range procs {
			p.Process.Kill() //nolint:errcheck // may be gone
			p.Wait()         //nolint:errcheck // killed
		}
		if t.Failed() {
			for _, id := range ids {
				log, _ := os.ReadFile(filepath.Join(dir, id+".log"))
				t.Logf("%s log:\n%s", id, log)
			}
		}
	})
	status := func(asker, peer string) (iam.Status, error) {
		var st iam.Status
		out, err := exec.Command(bin, append([]string{"iam", "status", "--json", "--peer", addrs[peer]}, tlsFlags(asker)...)...).Output()
		if err != nil {
			return st, err
		}
		return st, json.Unmarshal(out, &st)
	}
	waitStatus := func(peer, what string, ok func(iam.Status) bool) iam.Status {
		t.Helper()
		var st iam.Status
		var err error
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			if st, err = status(peer, peer); err == nil && ok(st) {
				return st
			}
		}
		t.Fatalf("%s: not %s within 60 s: last status %+v, %v", peer, what, st, err)
		return st
	}

	start("iam-1", "--bootstrap")
	waitStatus("iam-1", "leader", func(s iam.Status) bool { return s.State == "Leader" })
	start("iam-2", "--join", addrs["iam-1"])
	// iam-3 names a dead address first: the join goes on to the next one.
	start("iam-3", "--join", freeAddr(t)+","+addrs["iam-2"])
	full := func(s iam.Status) bool { return len(s.Members) == 3 && s.LeaderID != "" }
	before := waitStatus("iam-3", "in a 3-replica cluster", full)

	// kill -9 of the leader: the others elect a new one.
	old := before.LeaderID
	if err := procs[old].Process.Kill(); err != nil {
		t.Fatal(err)
	}
	procs[old].Wait() //nolint:errcheck // killed
	var survivor string
	for _, id := range ids {
		if id != old {
			survivor = id
		}
	}
	after := waitStatus(survivor, "following a new leader", func(s iam.Status) bool { return s.LeaderID != "" && s.LeaderID != old })
	if after.Term <= before.Term {
		t.Fatalf("new leader %s in term %d, not after term %d", after.LeaderID, after.Term, before.Term)
	}
	// The killed replica comes back with its log and follows the new leader.
	start(old)
	back := waitStatus(old, "back as a follower", func(s iam.Status) bool {
		return s.State == "Follower" && s.LeaderID == after.LeaderID && s.AppliedIndex >= before.AppliedIndex
	})
	t.Logf("leader %s killed at term %d (applied %d); %s leads in term %d; %s back at applied index %d",
		old, before.Term, before.AppliedIndex, after.LeaderID, after.Term, old, back.AppliedIndex)

	// Removal through any replica.
	if out, err := run(append([]string{"iam", "remove", "--peer", addrs[old], "--id", old}, tlsFlags(survivor)...)...); err != nil {
		t.Fatalf("iam remove %s: %v\n%s", old, err, out)
	}
	waitStatus(survivor, "down to 2 members", func(s iam.Status) bool { return len(s.Members) == 2 })

	// A certificate of another role is refused on the port (a TLS alert,
	// or a reset or broken pipe when the server's close wins the race).
	out, err := run(append([]string{"iam", "status", "--peer", addrs[survivor]}, tlsFlags("edge-1")...)...)
	if err == nil || strings.Contains(out, "leader") {
		t.Fatalf("iam status with an edge certificate: %v\n%s", err, out)
	}
	t.Logf("iam status with an edge certificate: %s", strings.TrimSpace(out))
}

// freeAddr returns a loopback address with a port nothing listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	return fmt.Sprintf("127.0.0.1:%d", e2e.FreePort(t))
}
