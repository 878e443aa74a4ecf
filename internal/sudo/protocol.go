// Package sudo lets `sudo` work in sandboxes whose runtime ignores setuid
// bits [ours]. gVisor (the release Debian ships) starts every process with
// no_new_privs and never honours a setuid binary, so the image's real sudo
// can only refuse. There, the gvisor backend mounts the agent binary over
// /usr/bin/sudo: called as "sudo" it is the client in this package, which
// hands its arguments, environment, working directory and standard streams
// (as file descriptors) to the broker the agent runs on a Unix socket. The
// broker checks the caller's uid against the image's sudoers NOPASSWD
// rules, starts the command as the target user
// with sudo's environment rules, relays signals, and reports the exit
// status, which the client exits with.
//
// The caller's uid cannot come from the socket there: that runsc answers
// SO_PEERCRED with the broker's own credentials and SCM_CREDENTIALS with
// the overflow uid. So the client proves it instead: it creates a file
// named by a fresh random challenge in a directory everyone may write but
// no one may list, and the kernel makes it the file's owner.
//
// Inside a sandbox this grants nothing its owner lacks: the API can already
// run anything as root there. The sandbox boundary is gVisor's.
package sudo

import (
	"encoding/json"
	"errors"
	"fmt"
)

// Dir is the broker's directory inside the sandbox: its socket, and the
// directory where clients prove who they are.
const Dir = "/run/opendsec-sudo"

func socketIn(dir string) string { return dir + "/sock" }
func proofsIn(dir string) string { return dir + "/proof" }

// maxRequest bounds the first message (arguments and environment).
const maxRequest = 1 << 20

// Request is what the client sends, with its stdin, stdout and stderr as
// SCM_RIGHTS in the same message.
type Request struct {
	// Args is the command; empty with Validate.
	Args []string `json:"args"`
	// Env is the caller's environment, "K=V".
	Env []string `json:"env"`
	Cwd string   `json:"cwd"`
	// User is the target user; empty means root.
	User string `json:"user"`
	// PreserveEnv is -E: keep the caller's environment.
	PreserveEnv bool `json:"preserve_env"`
	// Login is -i: the target's login shell, in its home.
	Login bool `json:"login"`
	// Shell is -s: the target's shell.
	Shell bool `json:"shell"`
	// Validate only checks that the caller may use sudo (-v, -l).
	Validate bool `json:"validate"`
}

// Message is what travels after the request, one JSON object per line.
// The broker first sends a Challenge, which the client answers with Proved
// once it has created the file of that name in the proof directory; then
// the client may send Signals; the broker ends with Exit, Signal or Error.
type Message struct {
	Challenge string `json:"challenge,omitempty"`
	Proved    bool   `json:"proved,omitempty"`
	Signal    int    `json:"signal,omitempty"`
	Exit      *int   `json:"exit,omitempty"`
	Error     string `json:"error,omitempty"`
}

// decodeRequest parses and checks a request.
func decodeRequest(data []byte) (Request, error) {
	var r Request
	if err := json.Unmarshal(data, &r); err != nil {
		return r, fmt.Errorf("request: %v", err)
	}
	if !r.Validate && len(r.Args) == 0 && !r.Login && !r.Shell {
		return r, errors.New("request: no command")
	}
	return r, nil
}
