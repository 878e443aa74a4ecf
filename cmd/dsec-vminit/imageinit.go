package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The image's own init [ours; the vm backend]. Asked to by the kernel
// command line (imageInitArg), and once the image's root is "/", this
// init hands the guest to the image's systemd instead of becoming the
// agent: the agent is then a unit of that systemd, written to
// /run/systemd/system (a tmpfs this init mounts, which systemd keeps, as
// it keeps an initramfs's), started early (before sysinit.target, after
// the local file systems) and restarted if it ends. The guest's hostname
// and machine id go to /etc, where systemd reads them. An image without
// systemd gets the agent as its init, as a microVM does.

// imageInitArg is microvm.ImageInitArg.
const imageInitArg = "dsec.init=image"

// agentUnit is the agent's unit under the image's systemd.
const agentUnit = "dsec-agent.service"

// systemdInit is the path of the image's init when cmdline asks for the
// image's init and the image's is systemd, else "".
func systemdInit(cmdline string) string {
	if !hasWord(cmdline, imageInitArg) {
		return ""
	}
	for _, p := range []string{"/sbin/init", "/usr/lib/systemd/systemd", "/lib/systemd/systemd"} {
		target, err := filepath.EvalSymlinks(p)
		if err != nil {
			continue
		}
		if fi, err := os.Stat(target); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 && filepath.Base(target) == "systemd" {
			return p
		}
	}
	return ""
}

func hasWord(s, w string) bool {
	for _, f := range strings.Fields(s) {
		if f == w {
			return true
		}
	}
	return false
}

// handOver writes the agent's unit (argv, its environment env and
// directory dir) and the guest's identity, and execs the image's init.
// It returns only on an error, before the exec or of it.
func handOver(init string, argv, env []string, dir string, c *config) error {
	if err := unix.Mount("tmpfs", "/run", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
		return fmt.Errorf("mount /run: %w", err)
	}
	units := "/run/systemd/system"
	if err := os.MkdirAll(filepath.Join(units, "sysinit.target.wants"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(units, agentUnit), []byte(unitFile(argv, env, dir, c.NoFile)), 0o644); err != nil {
		return err
	}
	if err := os.Symlink("../"+agentUnit, filepath.Join(units, "sysinit.target.wants", agentUnit)); err != nil {
		return err
	}
	var errs []error
	if plainDir(dir) {
		errs = append(errs, os.MkdirAll(dir, 0o755)) // as docker makes a missing WORKDIR
	}
	if c.Hostname != "" {
		errs = append(errs, os.WriteFile("/etc/hostname", []byte(c.Hostname+"\n"), 0o644))
	}
	if c.MachineID != "" {
		errs = append(errs, os.WriteFile("/etc/machine-id", []byte(c.MachineID+"\n"), 0o444))
	}
	if err := errors.Join(errs...); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-vminit: the guest's identity for systemd:", err)
	}
	return unix.Exec(init, []string{init}, nil)
}

// unitFile is the agent's systemd unit; nofile, if set, is its open files
// limit, which the sandbox's processes inherit (systemd gives a service
// its own otherwise, not its PID 1's).
func unitFile(argv, env []string, dir string, nofile int64) string {
	var b strings.Builder
	b.WriteString(`[Unit]
Description=OpenDsec sandbox agent
DefaultDependencies=no
After=local-fs.target
Before=sysinit.target

[Service]
Type=simple
`)
	fmt.Fprintf(&b, "ExecStart=%s\n", quoteArgs(argv))
	for _, kv := range env {
		fmt.Fprintf(&b, "Environment=%s\n", specifiers(strconv.Quote(kv)))
	}
	if plainDir(dir) {
		fmt.Fprintf(&b, "WorkingDirectory=%s\n", specifiers(dir))
	}
	if nofile > 0 {
		fmt.Fprintf(&b, "LimitNOFILE=%d\n", nofile)
	}
	// The sandbox's processes run in their own cgroup (-spawn-cgroup), not
	// the unit's; the agent keeps serving when the guest's memory runs out.
	b.WriteString(`Restart=always
RestartSec=100ms
OOMScoreAdjust=-1000
KillMode=process
StandardOutput=journal+console
StandardError=journal+console
`)
	return b.String()
}

// quoteArgs is argv as systemd's ExecStart= reads it: each word in double
// quotes, with C-style escapes, "%" (a specifier) doubled and "$" (a
// variable) too.
func quoteArgs(argv []string) string {
	out := make([]string, len(argv))
	for i, a := range argv {
		out[i] = strings.ReplaceAll(specifiers(strconv.Quote(a)), "$", "$$")
	}
	return strings.Join(out, " ")
}

// plainDir says dir can be a WorkingDirectory= as it is: absolute (as
// the image's WORKDIR is taken), and without a control character or a
// backslash, which systemd's line reading would end or join a line at.
// Another directory leaves the agent in /.
func plainDir(dir string) bool {
	return strings.HasPrefix(dir, "/") && !strings.ContainsFunc(dir, func(r rune) bool { return r < 0x20 || r == 0x7f || r == '\\' })
}

// specifiers has systemd read every "%" of s as itself.
func specifiers(s string) string { return strings.ReplaceAll(s, "%", "%%") }
