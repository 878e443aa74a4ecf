package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
)

// fakeFirecracker records the calls made to it and answers as
// Firecracker's API does: 204 to a change, 400 with a fault message to a
// path named in refuse.
type fakeFirecracker struct {
	mu     sync.Mutex
	calls  []string // "METHOD PATH BODY"
	refuse map[string]string
}

func (f *fakeFirecracker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	f.mu.Lock()
	f.calls = append(f.calls, r.Method+" "+r.URL.Path+" "+string(body))
	fault, refused := f.refuse[r.URL.Path]
	f.mu.Unlock()
	switch {
	case refused:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]string{"fault_message": fault})
	case r.Method == http.MethodGet && r.URL.Path == "/":
		json.NewEncoder(w).Encode(fcInstanceInfo{ID: "x", State: "Not started", VMMVersion: "1.12.1", AppName: "Firecracker"})
	case r.Header.Get("Content-Type") != "application/json":
		w.WriteHeader(http.StatusUnsupportedMediaType)
	default:
		w.WriteHeader(http.StatusNoContent)
	}
}

func serveFake(t *testing.T, f *fakeFirecracker) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fc.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: f}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return sock
}

// The calls a sandbox's start, pause, resume, snapshot and restore make,
// in order and with the bodies Firecracker's API documents.
func TestFirecrackerCallsAsDocumented(t *testing.T) {
	fake := &fakeFirecracker{}
	api := newFCAPI(serveFake(t, fake))
	ctx := context.Background()
	if i, err := api.info(ctx); err != nil || i.State != "Not started" || i.VMMVersion != "1.12.1" {
		t.Fatalf("info: %+v %v", i, err)
	}
	f := &Firecracker{Kernel: "/k/vmlinux"}
	g := Guest{MemoryMB: 256, SMP: 2, Initrd: "/vm/initrd.cpio", RootDisk: "/vm/root.ext4", WritableDisk: "/vm/rw.ext4", AgentSocket: "/run/x/edge.sock"}
	if err := f.configure(ctx, api, g); err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{
		api.pause(ctx),
		api.createSnapshot(ctx, fcSnapshotCreate{SnapshotType: "Full", SnapshotPath: "/s/state", MemFilePath: "/s/mem"}),
		api.resume(ctx),
		api.loadSnapshot(ctx, fcSnapshotLoad{SnapshotPath: "/s/state", MemBackend: fcMemoryBackend{BackendType: "File", BackendPath: "/s/mem"}, ResumeVM: true}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	want := []string{
		`GET / `,
		`PUT /boot-source {"kernel_image_path":"/k/vmlinux","boot_args":"` + f.KernelArgs() + `","initrd_path":"/vm/initrd.cpio"}`,
		`PUT /machine-config {"vcpu_count":2,"mem_size_mib":256}`,
		`PUT /drives/root {"drive_id":"root","path_on_host":"root.ext4","is_root_device":false,"is_read_only":true}`,
		`PUT /drives/rw {"drive_id":"rw","path_on_host":"rw.ext4","is_root_device":false,"is_read_only":false}`,
		`PUT /vsock {"guest_cid":3,"uds_path":"v.sock"}`,
		`PUT /actions {"action_type":"InstanceStart"}`,
		`PATCH /vm {"state":"Paused"}`,
		`PUT /snapshot/create {"snapshot_type":"Full","snapshot_path":"/s/state","mem_file_path":"/s/mem"}`,
		`PATCH /vm {"state":"Resumed"}`,
		`PUT /snapshot/load {"snapshot_path":"/s/state","mem_backend":{"backend_type":"File","backend_path":"/s/mem"},"resume_vm":true}`,
	}
	if !reflect.DeepEqual(fake.calls, want) {
		t.Fatalf("calls:\n%s\nwant:\n%s", strings.Join(fake.calls, "\n"), strings.Join(want, "\n"))
	}
}

// A refused call's error carries Firecracker's fault message, the call
// and the status; a dead socket names the call.
func TestFirecrackerErrors(t *testing.T) {
	fake := &fakeFirecracker{refuse: map[string]string{"/machine-config": "The vCPU number is invalid!"}}
	api := newFCAPI(serveFake(t, fake))
	err := api.setMachine(context.Background(), fcMachineConfig{VCPUCount: 0, MemSizeMiB: 128})
	var fe *fcError
	if !errors.As(err, &fe) || fe.Status != 400 || fe.Fault != "The vCPU number is invalid!" || !strings.Contains(err.Error(), "PUT /machine-config") {
		t.Fatalf("refused call: %v", err)
	}
	dead := newFCAPI(filepath.Join(t.TempDir(), "none.sock"))
	if err := dead.pause(context.Background()); err == nil || !strings.Contains(err.Error(), "PATCH /vm") {
		t.Fatalf("dead socket: %v", err)
	}
}

func TestFirecrackerIDs(t *testing.T) {
	for in, want := range map[string]string{"abc-123": "abc-123", "a_b.c": "a-b-c", strings.Repeat("x", 70): strings.Repeat("x", 64)} {
		if got := fcID(in); got != want {
			t.Errorf("fcID(%q) = %q, want %q", in, got, want)
		}
	}
}
