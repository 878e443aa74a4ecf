package microvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sparsefile"
	"github.com/opendsec/opendsec/internal/testutil"
)

// Only a template's own fault has it removed: a state that did not load, a
// file that is gone; not a QEMU that did not start or a limit refused.
func TestTemplateFault(t *testing.T) {
	_, missing := os.Open(filepath.Join(t.TempDir(), "mem"))
	for _, c := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("restore: %w", &loadError{errors.New("microvm: migration failed: load of migration failed: Invalid argument")}), true},
		{fmt.Errorf("copy: %w", missing), true},
		{errors.New("microvm: qemu exited: Could not allocate memory"), false},
		{errdefs.ResourceExhausted("cpu limit"), false},
		{context.Canceled, false},
	} {
		if got := templateFault(c.err); got != c.want {
			t.Errorf("templateFault(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

// Warm builds a shape's template ahead of its first create, once; the
// create then restores it.
func TestWarmBuildsTheTemplateOnce(t *testing.T) {
	b, state, env := templatesBackend(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for i, want := range []bool{true, false} {
		prepared, err := b.(backend.Warmer).Warm(ctx, backendtest.NewSpec(t, env, "n1"), false)
		if err != nil || prepared != want {
			t.Fatalf("warm %d: prepared %v (%v), want %v", i+1, prepared, err, want)
		}
	}
	ready, _ := filepath.Glob(filepath.Join(state, "templates", "*", "ready"))
	if len(ready) != 1 {
		t.Fatalf("templates after warming: %v", ready)
	}
	if sb := backendtest.Start(t, b, env); !sb.Handle.Restored {
		t.Fatal("the first create after a warm booted")
	}
	if again, _ := filepath.Glob(filepath.Join(state, "templates", "*", "ready")); len(again) != 1 {
		t.Fatalf("the create made another template: %v", again)
	}
}

// Every field of a shape names another template.
func TestTemplateKeyCoversTheShape(t *testing.T) {
	base := templateShape{Format: templateFormat, Root: "/r.ext4", MemoryMB: 256, SMP: 1, DiskMB: 1024, Accel: "tcg",
		Files: []stamp{{Path: "/usr/bin/qemu", Size: 1, MTime: 2}}}
	changes := map[string]func(*templateShape){
		"format":    func(s *templateShape) { s.Format++ },
		"root":      func(s *templateShape) { s.Root = "/other.ext4" },
		"memory":    func(s *templateShape) { s.MemoryMB = 512 },
		"vCPUs":     func(s *templateShape) { s.SMP = 2 },
		"disk":      func(s *templateShape) { s.DiskMB = 2048 },
		"pids":      func(s *templateShape) { s.Pids = 64 },
		"nofile":    func(s *templateShape) { s.NoFile = 1024 },
		"accel":     func(s *templateShape) { s.Accel = "kvm" },
		"cpu model": func(s *templateShape) { s.CPU = "host" },
		"a binary":  func(s *templateShape) { s.Files[0].MTime++ },
	}
	seen := map[string]string{base.key(): "base"}
	for name, change := range changes {
		s := base
		s.Files = append([]stamp(nil), base.Files...)
		change(&s)
		if other, ok := seen[s.key()]; ok {
			t.Errorf("%s: same key as %s", name, other)
		}
		seen[s.key()] = name
	}
}

func TestTemplatesOption(t *testing.T) {
	for v, want := range map[string]bool{"": true, "on": true, "off": false} {
		if got, err := templatesOption(v); err != nil || got != want {
			t.Errorf("templates=%q: %v, %v; want %v", v, got, err, want)
		}
	}
	if _, err := templatesOption("yes"); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "want on or off") {
		t.Errorf("templates=yes: %v", err)
	}
}

// Guests on Firecracker, or on a backend with templates off, boot; a guest
// with a NIC has templates of its own.
func TestTemplateShapeOnlyForQEMU(t *testing.T) {
	dir := t.TempDir()
	file := func(name string) string {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(name), 0o755) //nolint:errcheck // the stat says it
		return p
	}
	b := &Backend{templatesOn: true, qemu: &QEMU{Binary: file("qemu"), Kernel: file("vmlinux"), Modules: dir, Init: file("init")}}
	spec := &backend.Spec{AgentPath: file("aether"), Resources: backend.Resources{MemoryMB: 256}}
	g := Guest{MemoryMB: 256, SMP: 1, Accel: "tcg"}
	root := file("root.ext4")
	plain, ok := b.templateShapeOf(spec, root, g, 1024)
	if !ok {
		t.Fatal("a QEMU guest without a network has no template shape")
	}
	withNet := *spec
	withNet.NetNS = "/run/netns/x"
	if s, ok := b.templateShapeOf(&withNet, root, g, 1024); !ok || !s.Net || s.key() == plain.key() {
		t.Fatalf("a QEMU guest with a network: shape %+v, %v; want one of its own", s, ok)
	}
	fc := g
	fc.VMM = vmmFirecracker
	off := &Backend{qemu: b.qemu}
	for name, ok := range map[string]bool{
		"on Firecracker": func() bool { _, ok := b.templateShapeOf(spec, root, fc, 1024); return ok }(),
		"templates off":  func() bool { _, ok := off.templateShapeOf(spec, root, g, 1024); return ok }(),
		"agent missing": func() bool {
			s := *spec
			s.AgentPath = filepath.Join(dir, "none")
			_, ok := b.templateShapeOf(&s, root, g, 1024)
			return ok
		}(),
	} {
		if ok {
			t.Errorf("%s: has a template", name)
		}
	}
}

// A build a crash cut is removed when the backend starts; prune removes
// templates unused within its grace, and only those.
func TestTemplatesUnfinishedAndPrune(t *testing.T) {
	dir := t.TempDir()
	build := filepath.Join(dir, ".build-abc")
	os.MkdirAll(filepath.Join(build, "boot"), 0o700)        //nolint:errcheck // checked below
	os.WriteFile(buildMemFile(build), []byte("ram"), 0o600) //nolint:errcheck // checked below
	for _, name := range []string{"old", "fresh"} {
		os.MkdirAll(filepath.Join(dir, name), 0o700)                             //nolint:errcheck // checked below
		os.WriteFile(filepath.Join(dir, name, "mem"), make([]byte, 8192), 0o600) //nolint:errcheck // checked below
		os.WriteFile(filepath.Join(dir, name, "ready"), nil, 0o600)              //nolint:errcheck // checked below
	}
	old := time.Now().Add(-2 * time.Hour)
	os.Chtimes(filepath.Join(dir, "old", "ready"), old, old) //nolint:errcheck // checked below
	tpl, err := newTemplates(dir, &QEMU{}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(build); !os.IsNotExist(err) {
		t.Fatalf("an unfinished build is left: %v", err)
	}
	if _, err := os.Stat(buildMemFile(build)); !os.IsNotExist(err) {
		t.Fatalf("an unfinished build's RAM is left: %v", err)
	}
	freed, err := tpl.prune(time.Hour)
	if err != nil || freed < 8192 {
		t.Fatalf("prune: freed %d, %v", freed, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "old")); !os.IsNotExist(err) {
		t.Fatal("a template unused for 2 h survived a prune with 1 h of grace")
	}
	if _, err := os.Stat(filepath.Join(dir, "fresh", "ready")); err != nil {
		t.Fatalf("a template used now was pruned: %v", err)
	}
}

// On real QEMU: sandboxes made from one template each have their own
// identity, settings and files; a template copy boots again after a stop;
// a template that does not restore is removed, its sandbox boots and the
// next create builds the template again.
func TestTemplateCopies(t *testing.T) {
	b, state, env := templatesBackend(t)
	start := func(workDir string) *backendtest.Sandbox {
		spec := backendtest.NewSpec(t, env, "n1")
		spec.WorkDir = workDir
		spec.Env = append(spec.Env, "MINE="+string(spec.ID))
		return backendtest.StartSpec(t, b, spec)
	}
	a, c := start("/srv/a"), start("")
	for _, sb := range []*backendtest.Sandbox{a, c} {
		if !sb.Handle.Restored {
			t.Fatalf("sandbox %s was booted, not made from the template", sb.ID)
		}
	}
	// The template's RAM file holds no block of zeros, which every copy
	// would copy and hold.
	mems, _ := filepath.Glob(filepath.Join(state, "templates", "*", "mem"))
	if len(mems) != 1 {
		t.Fatalf("template RAM files: %v", mems)
	}
	if freed, err := sparsefile.PunchZeros(context.Background(), mems[0]); err != nil || freed != 0 {
		t.Fatalf("the template's RAM file had %d bytes of zero blocks left (%v)", freed, err)
	}
	// Copies of one snapshot reseed their CRNG with their identity: the
	// boot id each draws on its first read differs.
	if a, c := a.Sh(t, "cat /proc/sys/kernel/random/boot_id"), c.Sh(t, "cat /proc/sys/kernel/random/boot_id"); a == c {
		t.Fatalf("two copies drew the same boot id %s", a)
	}
	ids := map[string]bool{}
	for _, sb := range []*backendtest.Sandbox{a, c} {
		got := strings.Fields(sb.Sh(t, `echo "$(hostname) $MINE $(cat /etc/machine-id) $(pwd)"; grep -c `+string(sb.ID)+` /etc/hosts`))
		want := string(sb.ID)
		if len(got) != 5 || got[0] != want || got[1] != want || got[4] != "1" {
			t.Fatalf("sandbox %s: hostname, $MINE, machine id, directory, hosts lines = %q", sb.ID, got)
		}
		if ids[got[2]] {
			t.Fatalf("two copies share machine id %s", got[2])
		}
		ids[got[2]] = true
	}
	if wd := strings.TrimSpace(a.Sh(t, "pwd")); wd != "/srv/a" {
		t.Fatalf("the working directory is %q, want /srv/a", wd)
	}
	a.Sh(t, "echo mine > /root/a; sync") // a stop ends QEMU: unsynced writes are lost, as on any VM
	if got := c.Sh(t, "cat /root/a 2>/dev/null || echo absent"); got != "absent\n" {
		t.Fatalf("a copy sees another's file: %q", got)
	}

	// Stopped and started, a copy boots from its own disk and initramfs.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	bootsAsItself(ctx, t, b, a, "a copy")

	// A copy of a snapshot of it, stopped and started, boots as itself:
	// its own settings over its source's initramfs.
	sn := b.(backend.Snapshotter)
	ref := backend.SnapshotRef{ID: sandboxid.NewSnapshot("n1"), Dir: filepath.Join(t.TempDir(), "snap")}
	if err := os.MkdirAll(ref.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := a.Link.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := sn.Snapshot(ctx, a.ID, ref); err != nil {
		t.Fatal(err)
	}
	spec := backendtest.NewSpec(t, env, "n1")
	spec.Env = append(spec.Env, "MINE="+string(spec.ID))
	f := backendtest.Attach(t, b, spec)
	t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
	h, err := sn.Restore(ctx, ref, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := backendtest.WaitCopy(ctx, f.Link, spec, h); err != nil {
		t.Fatalf("a copy of a copy: %v", err)
	}
	bootsAsItself(ctx, t, b, f, "a snapshot's copy")

	// A corrupt template is removed and its sandbox boots.
	tpls, _ := filepath.Glob(filepath.Join(state, "templates", "*", "state"))
	if len(tpls) != 1 {
		t.Fatalf("templates: %v", tpls)
	}
	if err := os.WriteFile(tpls[0], []byte("not a migration stream"), 0o600); err != nil {
		t.Fatal(err)
	}
	booted := start("")
	if got := strings.TrimSpace(booted.Sh(t, "hostname")); got != string(booted.ID) {
		t.Fatalf("the sandbox of a corrupt template: hostname %q", got)
	}
	if _, err := os.Stat(filepath.Dir(tpls[0])); !os.IsNotExist(err) {
		t.Fatalf("a template that did not restore is kept: %v", err)
	}
	if again := start(""); !again.Handle.Restored {
		t.Fatal("the next create did not build the template again")
	}
}

// bootsAsItself stops sb and starts it again (a boot, not a restore):
// its hostname and $MINE are its own id, and /root/a, which its source
// wrote before its snapshot or it before the stop, reads "mine".
func bootsAsItself(ctx context.Context, t *testing.T, b backend.Backend, sb *backendtest.Sandbox, who string) {
	t.Helper()
	if err := b.Stop(ctx, sb.ID, time.Second); err != nil {
		t.Fatal(err)
	}
	if err := b.Start(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if err := backendtest.WaitAgent(ctx, b, sb.Link); err != nil {
		t.Fatalf("%s started again: %v", who, err)
	}
	if got := strings.Fields(sb.Sh(t, `echo "$(hostname) $MINE $(cat /root/a)"`)); len(got) != 3 || got[0] != string(sb.ID) || got[1] != string(sb.ID) || got[2] != "mine" {
		t.Fatalf("%s booted again: hostname, $MINE, /root/a = %q", who, got)
	}
}

// templatesBackend is a QEMU backend (templates on) in a state directory
// of its own, and the busybox image's environment.
func templatesBackend(t *testing.T) (backend.Backend, string, backendtest.Env) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	q := testQEMU(t)
	state := t.TempDir()
	return factory(q)(t, state), state, backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
}
