package microvm

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"

	"github.com/opendsec/opendsec/internal/sparsefile"
)

// A guest made from a template or restored from a snapshot runs from that
// template's or snapshot's initramfs, whose /dsec/config.json holds the
// template's neutral settings or the source's. Its own settings reach its
// agent in the first request; it needs an initramfs of its own only if it
// boots later (stopped and started, or a template that did not restore).
// So its create writes only its settings, as a small archive of its own,
// and links the initramfs it runs from: the kernel unpacks archives
// joined one after the other in order, a later file replacing an earlier
// one, and a boot joins the two. Writing the whole initramfs (the agent,
// init and modules, 12 MiB) cost a template's create 18-35 ms of its
// 400 (machine "vm", TCG).

// bootInitrdLater gives g, a new guest in dir, an initramfs of its own
// made at its first boot: runs (the initramfs it runs from, linked into
// dir) with config, its /dsec/config.json, over it. g.Initrd is then the
// link.
func bootInitrdLater(ctx context.Context, g *Guest, dir, runs string, config []byte) error {
	base, own := filepath.Join(dir, "initrd-runs.cpio"), filepath.Join(dir, "initrd-own.cpio")
	if err := sparsefile.LinkOrCopy(ctx, runs, base); err != nil {
		return err
	}
	var buf bytes.Buffer
	if err := WriteInitramfs(&buf, []InitFile{{Path: "/dsec/config.json", Mode: 0o600, Data: config}}); err != nil {
		return err
	}
	if err := os.WriteFile(own, buf.Bytes(), 0o600); err != nil {
		return err
	}
	g.Initrd, g.BootInitrd = base, []string{base, own}
	return nil
}

// bootInitrd readies g's own initramfs for a boot: the parts of
// BootInitrd joined into dir's initrd.cpio, which g then names (saved
// by the caller). A g without parts is ready.
func bootInitrd(g Guest, dir string) (Guest, error) {
	if len(g.BootInitrd) == 0 {
		return g, nil
	}
	joined := filepath.Join(dir, "initrd.cpio")
	tmp, err := os.CreateTemp(dir, "initrd.cpio.*")
	if err != nil {
		return g, err
	}
	defer os.Remove(tmp.Name())
	for _, part := range g.BootInitrd {
		if err := appendFile(tmp, part); err != nil {
			tmp.Close()
			return g, err
		}
	}
	if err := tmp.Close(); err != nil {
		return g, err
	}
	if err := os.Rename(tmp.Name(), joined); err != nil {
		return g, err
	}
	g.Initrd, g.BootInitrd = joined, nil
	return g, nil
}

// appendFile writes the file at path to the end of w (in the kernel,
// where it can).
func appendFile(w *os.File, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(w, f)
	return err
}
