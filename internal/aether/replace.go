package aether

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/sysuser"
)

// replace writes data to a new file beside p and renames it over p, so p
// is never seen half written. An existing file keeps its mode and owner;
// a new one gets perm and user u.
func (s *fileService) replace(p string, m *agentv1.WriteFileRequest, perm fs.FileMode, u sysuser.User) (*connect.Response[agentv1.WriteFileResponse], error) {
	uid, gid := int(u.UID), int(u.GID)
	if fi, err := os.Stat(p); err == nil {
		if fi.IsDir() {
			return nil, fsError("write", p, syscall.EISDIR)
		}
		perm = fi.Mode().Perm()
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			uid, gid = int(st.Uid), int(st.Gid)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fsError("write", p, err)
	}
	var suffix [6]byte
	rand.Read(suffix[:]) //nolint:errcheck // crypto/rand does not fail
	tmp := filepath.Join(filepath.Dir(p), "."+filepath.Base(p)+".tmp-"+hex.EncodeToString(suffix[:]))
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return nil, fsError("write", p, err)
	}
	_, err = f.Write(m.Data)
	if err == nil {
		err = setMetadata(f, m)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp, perm) // the umask may have narrowed it
	}
	if err == nil && (uid != 0 || gid != 0) {
		err = os.Chown(tmp, uid, gid)
	}
	if err == nil {
		err = os.Rename(tmp, p)
	}
	if err != nil {
		os.Remove(tmp)
		return nil, fsError("write", p, err)
	}
	e, err := s.entry(p)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&agentv1.WriteFileResponse{Entry: e}), nil
}
