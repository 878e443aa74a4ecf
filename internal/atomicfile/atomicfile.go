// Package atomicfile replaces files whole: a reader sees the old content
// or the new, never part of the new one (a script waiting for dsec up's
// client.env, a component re-reading its certificate), and a power loss
// leaves one of the two, not an empty file.
package atomicfile

import "os"

// Write writes data to path.tmp, syncs it and renames it over path.
func Write(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}
