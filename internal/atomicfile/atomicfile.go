// Package atomicfile replaces files whole: a reader sees the old content
// or the new, never part of the new one (a script waiting for dsec up's
// client.env, a component re-reading its certificate).
package atomicfile

import "os"

// Write writes data to path.tmp and renames it over path.
func Write(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}
