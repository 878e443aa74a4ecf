package e2b

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
)

// LoadOrCreateSecret reads the token secret (hex, at least 16 bytes) from
// path, creating a random 32-byte one on first use. Every gateway replica
// in front of one apiserver must share it: each must accept the access
// tokens the others hand out.
func LoadOrCreateSecret(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err == nil {
		b, err := hex.DecodeString(strings.TrimSpace(string(data)))
		if err != nil || len(b) < 16 {
			return nil, fmt.Errorf("%s: not a hex secret of at least 16 bytes; delete it to make a new one", path)
		}
		return b, nil
	}
	if !os.IsNotExist(err) {
		return nil, err
	}
	b := make([]byte, 32)
	rand.Read(b) //nolint:errcheck // crypto/rand does not fail
	return b, os.WriteFile(path, []byte(hex.EncodeToString(b)+"\n"), 0o600)
}
