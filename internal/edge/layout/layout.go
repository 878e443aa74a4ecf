// Package layout reads what the edge writes for a later run of itself,
// or another release, to read: sandbox records and snapshot descriptions
// carry a layout number, so that a release reads its predecessors' files
// and refuses, rather than misreads, its successors'.
package layout

import (
	"encoding/json"
	"fmt"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Upgrade turns a decoded object of one layout into the next layout's.
type Upgrade func(map[string]json.RawMessage) error

// Read decodes data, a JSON object with a "layout" number (none is
// layout 0), into v after upgrading it with upgrades[layout:]: upgrades[v]
// turns layout v into v+1, and len(upgrades) is the current layout. A
// newer layout, or one that is not a number, is refused by name.
func Read(what string, data []byte, upgrades []Upgrade, v any) error {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &obj); err != nil {
		return errdefs.FailedPrecondition("%s: not a JSON object: %v", what, err)
	}
	layout, current := 0, len(upgrades)
	if raw, ok := obj["layout"]; ok {
		if err := json.Unmarshal(raw, &layout); err != nil || layout < 0 {
			return errdefs.FailedPrecondition("%s: layout %s: want a whole number from 0", what, raw)
		}
	}
	if layout > current {
		return errdefs.FailedPrecondition("%s: layout %d was written by a newer release; this one reads layouts 0 to %d", what, layout, current)
	}
	for l := layout; l < current; l++ {
		if err := upgrades[l](obj); err != nil {
			return errdefs.FailedPrecondition("%s: upgrade from layout %d: %v", what, l, err)
		}
	}
	obj["layout"] = json.RawMessage(fmt.Sprint(current))
	data, err := json.Marshal(obj)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(data, v); err != nil {
		return errdefs.FailedPrecondition("%s: %v", what, err)
	}
	return nil
}
