package oci

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Runtime is an OCI runtime's command line (crun, runc, runsc) [ours]: the
// verbs the container and gvisor backends share, with one reading of its
// "no such container" answers. Starting a container (run, restore) stays
// with each backend: how its stdio and session are set differs.
type Runtime struct {
	Binary string
	// Flags come before the verb on every call: --root DIR, and runsc's
	// platform, network and log flags.
	Flags []string
	// Detail, if set, gives the reason of a failed call when it can say
	// more than the call's output (runsc's log file); "" leaves the output.
	Detail func() string
}

// ContainerState is what `state` reports.
type ContainerState struct {
	// Status is the runtime's word: created, running, paused or stopped.
	Status string `json:"status"`
	Pid    int    `json:"pid"`
}

// Run runs the runtime with args after its flags and returns its combined
// output; a failure names the binary and verb and carries the output (or
// Detail).
func (r Runtime) Run(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, r.Binary, append(append([]string(nil), r.Flags...), args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		detail := string(bytes.TrimSpace(out))
		if r.Detail != nil {
			if d := r.Detail(); d != "" {
				detail = d
			}
		}
		verb := ""
		if len(args) > 0 {
			verb = args[0]
		}
		return out, &runtimeError{msg: fmt.Sprintf("%s %s: %v: %s", r.Binary, verb, err, detail), gone: NotExist(out) || NotExist([]byte(detail))}
	}
	return out, nil
}

// State reports the container id; errdefs.ErrNotFound when the runtime
// does not know it.
func (r Runtime) State(ctx context.Context, id string) (ContainerState, error) {
	out, err := r.Run(ctx, "state", id)
	if err != nil {
		if Gone(err) {
			return ContainerState{}, errdefs.Wrap(errdefs.ErrNotFound, err, "container %s", id)
		}
		return ContainerState{}, err
	}
	var st ContainerState
	if err := json.Unmarshal(out, &st); err != nil {
		return ContainerState{}, fmt.Errorf("%s state %s: %w", r.Binary, id, err)
	}
	return st, nil
}

// Kill sends signal to the container's init, or with all to every process
// of it; a container the runtime does not know is not an error.
func (r Runtime) Kill(ctx context.Context, id, signal string, all bool) error {
	args := []string{"kill"}
	if all {
		args = append(args, "--all")
	}
	_, err := r.Run(ctx, append(args, id, signal)...)
	if Gone(err) {
		return nil
	}
	return err
}

// Delete removes the container, killing what runs of it; a container the
// runtime does not know is not an error.
func (r Runtime) Delete(ctx context.Context, id string) error {
	_, err := r.Run(ctx, "delete", "--force", id)
	if Gone(err) {
		return nil
	}
	return err
}

// runtimeError is a failed runtime call; gone says its output named a
// container the runtime does not know.
type runtimeError struct {
	msg  string
	gone bool
}

func (e *runtimeError) Error() string { return e.msg }

// Gone reports whether err is a runtime call's answer that the container
// does not exist.
func Gone(err error) bool {
	var re *runtimeError
	return errors.As(err, &re) && re.gone
}

// NotExist reports whether a runtime's output says the container does not
// exist: crun and runc say "does not exist" or "No such file", runsc
// "no such file or directory" or "not found".
func NotExist(out []byte) bool {
	s := strings.ToLower(string(out))
	return strings.Contains(s, "does not exist") || strings.Contains(s, "no such file") || strings.Contains(s, "not found")
}
