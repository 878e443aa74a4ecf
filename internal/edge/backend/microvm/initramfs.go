package microvm

import (
	"fmt"
	"io"
	"path"
	"sort"
	"strings"
)

// InitFile is one entry of an initramfs.
type InitFile struct {
	Path string // absolute, inside the guest
	Mode uint32 // permission bits
	Data []byte
}

// cpio "newc" entry types.
const (
	typeDir  = 0o040000
	typeFile = 0o100000
	typeChar = 0o020000
)

// WriteInitramfs writes an uncompressed newc cpio archive, which the
// kernel unpacks as its initramfs: the files, the directories above them,
// and /dev/console (the kernel opens it for init's output before init
// runs).
func WriteInitramfs(w io.Writer, files []InitFile) error {
	dirs := map[string]bool{"/dev": true}
	for _, f := range files {
		if !path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || f.Path == "/" {
			return fmt.Errorf("initramfs: path %q: want a clean absolute path", f.Path)
		}
		for d := path.Dir(f.Path); d != "/"; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	names := make([]string, 0, len(dirs))
	for d := range dirs {
		names = append(names, d)
	}
	sort.Strings(names) // parents first
	ino := uint32(1)
	put := func(name string, mode uint32, data []byte, rmaj, rmin uint32) error {
		name = strings.TrimPrefix(name, "/")
		hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
			ino, mode, 0, 0, 1, 0, len(data), 0, 0, rmaj, rmin, len(name)+1, 0)
		ino++
		if _, err := io.WriteString(w, hdr+name+"\x00"+pad(len(hdr)+len(name)+1)); err != nil {
			return err
		}
		if _, err := w.Write(data); err != nil {
			return err
		}
		_, err := io.WriteString(w, pad(len(data)))
		return err
	}
	for _, d := range names {
		if err := put(d, typeDir|0o755, nil, 0, 0); err != nil {
			return err
		}
	}
	if err := put("/dev/console", typeChar|0o600, nil, 5, 1); err != nil {
		return err
	}
	for _, f := range files {
		if err := put(f.Path, typeFile|(f.Mode&0o7777), f.Data, 0, 0); err != nil {
			return err
		}
	}
	return put("TRAILER!!!", 0, nil, 0, 0)
}

// pad is the NULs that bring n bytes to a multiple of 4.
func pad(n int) string { return strings.Repeat("\x00", (4-n%4)%4) }
