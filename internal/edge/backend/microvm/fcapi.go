package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// fcAPI speaks Firecracker's API (its swagger, v1.x) on the process's
// Unix socket: the guest is configured with PUT calls before
// InstanceStart, paused and resumed with PATCH /vm, and snapshotted and
// restored with /snapshot/create and /snapshot/load.
type fcAPI struct {
	sock string
	hc   *http.Client
}

func newFCAPI(sock string) *fcAPI {
	return &fcAPI{sock: sock, hc: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
		DisableKeepAlives: true,
	}}}
}

// fcBootSource is PUT /boot-source.
type fcBootSource struct {
	KernelImagePath string `json:"kernel_image_path"`
	BootArgs        string `json:"boot_args,omitempty"`
	InitrdPath      string `json:"initrd_path,omitempty"`
}

// fcMachineConfig is PUT /machine-config.
type fcMachineConfig struct {
	VCPUCount       int  `json:"vcpu_count"`
	MemSizeMiB      int  `json:"mem_size_mib"`
	TrackDirtyPages bool `json:"track_dirty_pages,omitempty"`
}

// fcDrive is PUT /drives/{drive_id}.
type fcDrive struct {
	DriveID      string `json:"drive_id"`
	PathOnHost   string `json:"path_on_host"`
	IsRootDevice bool   `json:"is_root_device"`
	IsReadOnly   bool   `json:"is_read_only"`
}

// fcVsock is PUT /vsock: the guest's connections to the host's CID 2
// port P reach the Unix socket UDSPath + "_P" on the host.
type fcVsock struct {
	GuestCID int    `json:"guest_cid"`
	UDSPath  string `json:"uds_path"`
}

// fcNIC is PUT /network-interfaces/{iface_id}: a TAP (by name, in the
// VMM's network namespace) as the guest's virtio-net NIC.
type fcNIC struct {
	IfaceID     string `json:"iface_id"`
	HostDevName string `json:"host_dev_name"`
	GuestMAC    string `json:"guest_mac,omitempty"`
}

// fcSnapshotCreate is PUT /snapshot/create (the guest must be paused).
type fcSnapshotCreate struct {
	SnapshotType string `json:"snapshot_type"` // "Full" or "Diff"
	SnapshotPath string `json:"snapshot_path"`
	MemFilePath  string `json:"mem_file_path"`
}

// fcSnapshotLoad is PUT /snapshot/load, on a Firecracker that has not
// been configured. A File memory backend is mapped privately: copies
// loaded from one memory file share it copy-on-write.
type fcSnapshotLoad struct {
	SnapshotPath string          `json:"snapshot_path"`
	MemBackend   fcMemoryBackend `json:"mem_backend"`
	ResumeVM     bool            `json:"resume_vm"`
}

type fcMemoryBackend struct {
	BackendType string `json:"backend_type"` // "File" or "Uffd"
	BackendPath string `json:"backend_path"`
}

// fcInstanceInfo is GET /.
type fcInstanceInfo struct {
	ID         string `json:"id"`
	State      string `json:"state"` // "Not started", "Running", "Paused"
	VMMVersion string `json:"vmm_version"`
	AppName    string `json:"app_name"`
}

// fcError is an answer of Firecracker's other than 2xx.
type fcError struct {
	Method, Path string
	Status       int
	Fault        string
}

func (e *fcError) Error() string {
	return fmt.Sprintf("firecracker: %s %s: %d: %s", e.Method, e.Path, e.Status, e.Fault)
}

// call sends body (JSON, if not nil) and decodes a JSON answer into out
// (if not nil). Firecracker answers 204 to a successful change and
// {"fault_message": ...} to a refused one.
func (c *fcAPI) call(ctx context.Context, method, path string, body, out any) error {
	var rd io.Reader
	if body != nil {
		data, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://localhost"+path, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("firecracker: %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("firecracker: %s %s: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		var f struct {
			FaultMessage string `json:"fault_message"`
		}
		if json.Unmarshal(data, &f) != nil || f.FaultMessage == "" {
			f.FaultMessage = strings.TrimSpace(string(data))
		}
		return &fcError{Method: method, Path: path, Status: resp.StatusCode, Fault: f.FaultMessage}
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return fmt.Errorf("firecracker: %s %s: the answer: %w", method, path, err)
		}
	}
	return nil
}

func (c *fcAPI) info(ctx context.Context) (fcInstanceInfo, error) {
	var i fcInstanceInfo
	err := c.call(ctx, http.MethodGet, "/", nil, &i)
	return i, err
}

func (c *fcAPI) setBootSource(ctx context.Context, b fcBootSource) error {
	return c.call(ctx, http.MethodPut, "/boot-source", b, nil)
}

func (c *fcAPI) setMachine(ctx context.Context, m fcMachineConfig) error {
	return c.call(ctx, http.MethodPut, "/machine-config", m, nil)
}

func (c *fcAPI) setDrive(ctx context.Context, d fcDrive) error {
	return c.call(ctx, http.MethodPut, "/drives/"+d.DriveID, d, nil)
}

func (c *fcAPI) setVsock(ctx context.Context, v fcVsock) error {
	return c.call(ctx, http.MethodPut, "/vsock", v, nil)
}

func (c *fcAPI) setNIC(ctx context.Context, n fcNIC) error {
	return c.call(ctx, http.MethodPut, "/network-interfaces/"+n.IfaceID, n, nil)
}

func (c *fcAPI) start(ctx context.Context) error {
	return c.call(ctx, http.MethodPut, "/actions", map[string]string{"action_type": "InstanceStart"}, nil)
}

func (c *fcAPI) setState(ctx context.Context, state string) error {
	return c.call(ctx, http.MethodPatch, "/vm", map[string]string{"state": state}, nil)
}

func (c *fcAPI) pause(ctx context.Context) error  { return c.setState(ctx, "Paused") }
func (c *fcAPI) resume(ctx context.Context) error { return c.setState(ctx, "Resumed") }

func (c *fcAPI) createSnapshot(ctx context.Context, s fcSnapshotCreate) error {
	return c.call(ctx, http.MethodPut, "/snapshot/create", s, nil)
}

func (c *fcAPI) loadSnapshot(ctx context.Context, s fcSnapshotLoad) error {
	return c.call(ctx, http.MethodPut, "/snapshot/load", s, nil)
}

// waitAPI waits until the API socket answers (Firecracker creates it
// early in its start), or the process ended (exited is closed).
func (c *fcAPI) waitAPI(ctx context.Context, exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for {
		if _, err := c.info(ctx); err == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("firecracker: the process ended before its API answered")
		case <-ctx.Done():
			return fmt.Errorf("firecracker: its API at %s did not answer: %w", c.sock, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}
