// Package sandboxid defines the ids of nodes, sandboxes and snapshots. A
// sandbox id starts with the id of the edge that owns it, so any stateless
// apiserver can route a request without a lookup table [paper]. Every id of
// one kind has the same length, because runsc matches container ids by
// prefix.
package sandboxid

import (
	"crypto/rand"
	"encoding/base32"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// NodeID names an edge: 8 characters of a-z and 2-7.
type NodeID string

// ID names a sandbox: "<node>-<16 random characters>".
type ID string

// SnapshotID names a snapshot: "snap-<node>-<16 random characters>".
type SnapshotID string

const (
	nodeLen     = 8
	randLen     = 16
	idLen       = nodeLen + 1 + randLen
	snapPrefix  = "snap-"
	alphabet    = "abcdefghijklmnopqrstuvwxyz234567"
	describeID  = "an id like \"k7f2m9qa-3jd8f0a9xk2m4n7p\" (8 and 16 characters of a-z and 2-7)"
	describeSID = "an id like \"snap-k7f2m9qa-3jd8f0a9xk2m4n7p\""
)

var encoding = base32.NewEncoding(alphabet).WithPadding(base32.NoPadding)

func random(n int) string {
	b := make([]byte, (n*5+7)/8)
	if _, err := rand.Read(b); err != nil {
		panic("sandboxid: crypto/rand failed: " + err.Error())
	}
	return encoding.EncodeToString(b)[:n]
}

// NewNodeID returns a fresh random node id.
func NewNodeID() NodeID { return NodeID(random(nodeLen)) }

// New returns a fresh sandbox id owned by node.
func New(node NodeID) ID { return ID(string(node) + "-" + random(randLen)) }

// NewSnapshot returns a fresh snapshot id held by node.
func NewSnapshot(node NodeID) SnapshotID {
	return SnapshotID(snapPrefix + string(node) + "-" + random(randLen))
}

func validChars(s string) bool {
	for i := 0; i < len(s); i++ {
		if !strings.ContainsRune(alphabet, rune(s[i])) {
			return false
		}
	}
	return true
}

// ValidateNode checks a node id.
func ValidateNode(s string) (NodeID, error) {
	if len(s) != nodeLen || !validChars(s) {
		return "", errdefs.InvalidArgument("node id %q: want 8 characters of a-z and 2-7", truncate(s))
	}
	return NodeID(s), nil
}

// Parse checks a sandbox id and returns it with its owning node.
func Parse(s string) (ID, NodeID, error) {
	if len(s) != idLen || s[nodeLen] != '-' || !validChars(s[:nodeLen]) || !validChars(s[nodeLen+1:]) {
		return "", "", errdefs.InvalidArgument("sandbox_id %q: want %s", truncate(s), describeID)
	}
	return ID(s), NodeID(s[:nodeLen]), nil
}

// ParseSnapshot checks a snapshot id and returns it with its holding node.
func ParseSnapshot(s string) (SnapshotID, NodeID, error) {
	rest, ok := strings.CutPrefix(s, snapPrefix)
	if !ok {
		return "", "", errdefs.InvalidArgument("snapshot_id %q: want %s", truncate(s), describeSID)
	}
	if _, node, err := Parse(rest); err == nil {
		return SnapshotID(s), node, nil
	}
	return "", "", errdefs.InvalidArgument("snapshot_id %q: want %s", truncate(s), describeSID)
}

// IsSnapshot says whether s has the form of a snapshot id (a snapshot's
// name may start with "snap-" but never has this form).
func IsSnapshot(s string) bool {
	_, _, err := ParseSnapshot(s)
	return err == nil
}

// Node returns the node that owns the sandbox. The id must be valid.
func (id ID) Node() NodeID { return NodeID(string(id)[:nodeLen]) }

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
