package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/guestnet"
)

// configPath is the sandbox's settings in the initramfs, written by the
// microvm backend (microvm.GuestConfig).
const configPath = "/dsec/config.json"

// config is what a sandbox's guest is set up with before the agent runs.
type config struct {
	Hostname string   `json:"hostname"`
	Env      []string `json:"env"`
	// WorkDir is where the agent starts (the image's WORKDIR), made if
	// missing; processes that name no directory start there.
	WorkDir    string `json:"work_dir,omitempty"`
	MachineID  string `json:"machine_id,omitempty"`
	Hosts      string `json:"hosts,omitempty"`
	ResolvConf string `json:"resolv_conf,omitempty"`
	// Net is the guest's network interface, when the sandbox has one.
	Net *guestnet.Config `json:"net,omitempty"`
	// Pids and NoFile are the sandbox's limits on processes and threads
	// and on open files per process (limits.go); 0: none.
	Pids   int64 `json:"pids,omitempty"`
	NoFile int64 `json:"nofile,omitempty"`
}

func readConfig() (*config, error) {
	var c config
	data, err := os.ReadFile(configPath)
	if errors.Is(err, os.ErrNotExist) {
		return &c, nil
	}
	if err != nil {
		return &c, err
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return &c, fmt.Errorf("%s: %w", configPath, err)
	}
	return &c, nil
}

// apply sets the hostname, writes /etc/hosts and /etc/resolv.conf in
// the (new) root, brings loopback up and configures the network interface.
func (c *config) apply() error {
	errs := []error{guestnet.UpLoopback()}
	if c.Net != nil {
		errs = append(errs, c.Net.Apply())
	}
	if c.Hostname != "" {
		errs = append(errs, unix.Sethostname([]byte(c.Hostname)))
	}
	os.MkdirAll("/etc", 0o755)
	if c.Hosts != "" {
		errs = append(errs, os.WriteFile("/etc/hosts", []byte(c.Hosts), 0o644))
	}
	if c.ResolvConf != "" {
		errs = append(errs, os.WriteFile("/etc/resolv.conf", []byte(c.ResolvConf), 0o644))
	}
	return errors.Join(errs...)
}

// environ is the agent's environment: the sandbox's, with a PATH.
func (c *config) environ() []string {
	for _, kv := range c.Env {
		if len(kv) > 5 && kv[:5] == "PATH=" {
			return c.Env
		}
	}
	return append(c.Env, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
}

// enterWorkDir makes the image's WORKDIR the agent's directory (made if
// missing, as docker does); "/" stays otherwise.
func (c *config) enterWorkDir() {
	if c.WorkDir == "" || c.WorkDir[0] != '/' {
		return
	}
	if err := os.MkdirAll(c.WorkDir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-vminit: WORKDIR:", err)
		return
	}
	if err := unix.Chdir(c.WorkDir); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-vminit: WORKDIR:", err)
	}
}
