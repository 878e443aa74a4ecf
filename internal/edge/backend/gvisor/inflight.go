package gvisor

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// checkpointWait bounds how long Recover waits for a checkpoint that an
// edge before it started and did not live to see end.
const checkpointWait = 2 * time.Minute

// waitCheckpoint returns once no `runsc checkpoint` of runscID runs. A
// checkpoint outlives the edge that started it (an edge killed during a
// snapshot or a fork); Debian's runsc ends the sandbox when it is done, so
// Recover must see the sandbox as the checkpoint leaves it, not as it was
// a moment before.
func waitCheckpoint(ctx context.Context, runscID string) {
	deadline := time.Now().Add(checkpointWait)
	for checkpointRunning(runscID) && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// checkpointRunning reports whether a runsc process checkpoints runscID.
func checkpointRunning(runscID string) bool {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		data, err := os.ReadFile(p)
		if err != nil || len(data) == 0 {
			continue
		}
		if isCheckpointOf(bytes.Split(bytes.TrimRight(data, "\x00"), []byte{0}), runscID) {
			return true
		}
	}
	return false
}

// isCheckpointOf reports whether argv is `runsc ... checkpoint ... ID`.
func isCheckpointOf(argv [][]byte, runscID string) bool {
	if len(argv) < 3 || !strings.HasPrefix(filepath.Base(string(argv[0])), "runsc") || string(argv[len(argv)-1]) != runscID {
		return false
	}
	for _, a := range argv[1 : len(argv)-1] {
		if string(a) == "checkpoint" {
			return true
		}
	}
	return false
}
