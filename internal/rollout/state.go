package rollout

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/opendsec/opendsec/internal/atomicfile"
)

// Phases of a rollout, as its state file records them.
const (
	PhaseRolling     = "rolling"
	PhaseDone        = "done"
	PhaseRollingBack = "rolling-back"
	PhaseRolledBack  = "rolled-back"
)

// State is a rollout's record, written before each step it takes, so that
// a rollout cut short is resumed or rolled back from it.
type State struct {
	Version string `json:"version"` // the new build's
	Phase   string `json:"phase"`
	// Backups maps each binary path replaced to the copy of what it held
	// before (the previous build), which a rollback puts back.
	Backups map[string]string `json:"backups"`
	// Before is each component's version before the rollout touched it.
	Before map[string]string `json:"before"`
	// Replaced lists the components restarted on the new build, in order.
	Replaced []string `json:"replaced"`
	// Failure says which gate failed, when one did.
	Failure string `json:"failure,omitempty"`
}

// LoadState reads the state file; a missing one is (nil, nil).
func LoadState(path string) (*State, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var st State
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, fmt.Errorf("rollout state %s: %w", path, err)
	}
	return &st, nil
}

func (st *State) save(path string) error {
	data, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(path, append(data, '\n'), 0o600)
}

func (st *State) replaced(name string) bool {
	for _, n := range st.Replaced {
		if n == name {
			return true
		}
	}
	return false
}

// copyFile writes src's content to dst (executable) by a rename, so a
// process starting dst sees the old or the new binary, never a part.
func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dst), "."+filepath.Base(dst)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, in); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o755); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}
