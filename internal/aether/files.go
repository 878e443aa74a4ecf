package aether

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/filemeta"
	"github.com/opendsec/opendsec/internal/sysuser"
)

// MaxFileChunk is the most ReadFile returns and WriteFile takes in one call.
const MaxFileChunk = 16 << 20

// maxListEntries bounds one ListDir answer.
const maxListEntries = 100000

type fileService struct {
	users   sysuser.DB
	watches *watchSet
}

var _ agentv1connect.FilesystemServiceHandler = (*fileService)(nil)

// resolvePath makes p absolute (relative paths start at root's home) and
// clean. The sandbox is the boundary, so any path inside it is allowed.
func resolvePath(field, p string) (string, error) {
	if p == "" {
		return "", errdefs.InvalidArgument("%s: empty path", field)
	}
	if strings.ContainsRune(p, 0) {
		return "", errdefs.InvalidArgument("%s: path contains a NUL byte", field)
	}
	if len(p) > 4096 {
		return "", errdefs.InvalidArgument("%s: path longer than 4096 bytes", field)
	}
	if !filepath.IsAbs(p) {
		p = filepath.Join(sysuser.Root.Home, p)
	}
	return filepath.Clean(p), nil
}

// fsError classifies an os error on path for the client.
func fsError(op, path string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errdefs.NotFound("%s %s: no such file or directory", op, path)
	case errors.Is(err, syscall.ENOTEMPTY):
		return errdefs.FailedPrecondition("%s %s: directory not empty (use recursive)", op, path)
	case errors.Is(err, fs.ErrExist):
		return errdefs.AlreadyExists("%s %s: already exists", op, path)
	case errors.Is(err, fs.ErrPermission):
		return errdefs.PermissionDenied("%s %s: permission denied", op, path)
	case errors.Is(err, syscall.ENOTDIR):
		return errdefs.FailedPrecondition("%s %s: a parent is not a directory", op, path)
	case errors.Is(err, syscall.EISDIR):
		return errdefs.FailedPrecondition("%s %s: is a directory", op, path)
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return errdefs.ResourceExhausted("%s %s: no space left", op, path)
	}
	return errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "%s %s", op, path)
}

func (s *fileService) entry(path string) (*agentv1.EntryInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, fsError("stat", path, err)
	}
	return s.entryFrom(path, fi), nil
}

func (s *fileService) entryFrom(path string, fi fs.FileInfo) *agentv1.EntryInfo {
	e := &agentv1.EntryInfo{
		Name:       fi.Name(),
		Path:       path,
		Size:       fi.Size(),
		Mode:       uint32(fi.Mode().Perm()),
		ModifiedAt: timestamppb.New(fi.ModTime()),
	}
	switch {
	case fi.Mode().IsRegular():
		e.Type = agentv1.FileType_FILE_TYPE_FILE
	case fi.IsDir():
		e.Type = agentv1.FileType_FILE_TYPE_DIRECTORY
	case fi.Mode()&fs.ModeSymlink != 0:
		e.Type = agentv1.FileType_FILE_TYPE_SYMLINK
		e.SymlinkTarget, _ = os.Readlink(path)
	default:
		e.Type = agentv1.FileType_FILE_TYPE_OTHER
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		e.Owner = s.users.NameOf(st.Uid)
		e.Group = s.users.GroupNameOf(st.Gid)
	}
	if e.Type != agentv1.FileType_FILE_TYPE_SYMLINK {
		// What the caller may not read of it (its rights) it goes without.
		e.Metadata, _ = filemeta.Read(path)
	}
	return e
}

func (s *fileService) Stat(ctx context.Context, req *connect.Request[agentv1.StatRequest]) (*connect.Response[agentv1.StatResponse], error) {
	p, err := resolvePath("path", req.Msg.Path)
	if err != nil {
		return nil, err
	}
	u, err := s.users.Lookup(req.Msg.User)
	if err != nil {
		return nil, err
	}
	return asUser(u, func() (*connect.Response[agentv1.StatResponse], error) {
		e, err := s.entry(p)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&agentv1.StatResponse{Entry: e}), nil
	})
}

func (s *fileService) ListDir(ctx context.Context, req *connect.Request[agentv1.ListDirRequest]) (*connect.Response[agentv1.ListDirResponse], error) {
	root, err := resolvePath("path", req.Msg.Path)
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.Depth)
	if depth == 0 {
		depth = 1
	}
	u, err := s.users.Lookup(req.Msg.User)
	if err != nil {
		return nil, err
	}
	return asUser(u, func() (*connect.Response[agentv1.ListDirResponse], error) { return s.list(root, depth) })
}

func (s *fileService) list(root string, depth int) (*connect.Response[agentv1.ListDirResponse], error) {
	if fi, err := os.Stat(root); err != nil {
		return nil, fsError("list", root, err)
	} else if !fi.IsDir() {
		return nil, errdefs.FailedPrecondition("list %s: not a directory", root)
	}
	out := &agentv1.ListDirResponse{}
	var walk func(dir string, level int) error
	walk = func(dir string, level int) error {
		ents, err := os.ReadDir(dir)
		if err != nil {
			if dir == root {
				return fsError("list", dir, err)
			}
			return nil // unreadable subdirectory: list what can be listed
		}
		for _, de := range ents {
			if len(out.Entries) >= maxListEntries {
				return errdefs.ResourceExhausted("list %s: more than %d entries; list with a smaller depth", root, maxListEntries)
			}
			p := filepath.Join(dir, de.Name())
			fi, err := de.Info()
			if err != nil {
				continue // removed meanwhile
			}
			out.Entries = append(out.Entries, s.entryFrom(p, fi))
			if de.IsDir() && level < depth {
				if err := walk(p, level+1); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(root, 1); err != nil {
		return nil, err
	}
	return connect.NewResponse(out), nil
}

// mkdirAllOwned creates dir and missing parents, giving new ones to u.
// Run as u (asUser), it creates only what u may, and they are u's already.
func mkdirAllOwned(dir string, u sysuser.User) (created bool, err error) {
	fi, err := os.Stat(dir)
	if err == nil {
		if !fi.IsDir() {
			return false, errdefs.FailedPrecondition("make dir %s: a file is in the way", dir)
		}
		return false, nil
	}
	if parent := filepath.Dir(dir); parent != dir {
		if _, err := mkdirAllOwned(parent, u); err != nil {
			return false, err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return false, fsError("make dir", dir, err)
	}
	if u.UID == 0 && u.GID != 0 {
		if err := os.Lchown(dir, int(u.UID), int(u.GID)); err != nil {
			return true, fsError("chown", dir, err)
		}
	}
	return true, nil
}

func (s *fileService) MakeDir(ctx context.Context, req *connect.Request[agentv1.MakeDirRequest]) (*connect.Response[agentv1.MakeDirResponse], error) {
	defer s.watches.sync() // the events it caused are sent before it answers
	p, err := resolvePath("path", req.Msg.Path)
	if err != nil {
		return nil, err
	}
	u, err := s.users.Lookup(req.Msg.User)
	if err != nil {
		return nil, err
	}
	return asUser(u, func() (*connect.Response[agentv1.MakeDirResponse], error) {
		created, err := mkdirAllOwned(p, u)
		if err != nil {
			return nil, err
		}
		e, err := s.entry(p)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&agentv1.MakeDirResponse{Entry: e, Created: created}), nil
	})
}

func (s *fileService) Remove(ctx context.Context, req *connect.Request[agentv1.RemoveRequest]) (*connect.Response[agentv1.RemoveResponse], error) {
	defer s.watches.sync() // the events it caused are sent before it answers
	p, err := resolvePath("path", req.Msg.Path)
	if err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, errdefs.InvalidArgument("path: refusing to remove /")
	}
	u, err := s.users.Lookup(req.Msg.User)
	if err != nil {
		return nil, err
	}
	return asUser(u, func() (*connect.Response[agentv1.RemoveResponse], error) {
		if _, err := os.Lstat(p); err != nil {
			return nil, fsError("remove", p, err)
		}
		if req.Msg.Recursive {
			err = os.RemoveAll(p)
		} else {
			err = os.Remove(p)
		}
		if err != nil {
			return nil, fsError("remove", p, err)
		}
		return connect.NewResponse(&agentv1.RemoveResponse{}), nil
	})
}

func (s *fileService) Move(ctx context.Context, req *connect.Request[agentv1.MoveRequest]) (*connect.Response[agentv1.MoveResponse], error) {
	defer s.watches.sync() // the events it caused are sent before it answers
	src, err := resolvePath("source", req.Msg.Source)
	if err != nil {
		return nil, err
	}
	dst, err := resolvePath("destination", req.Msg.Destination)
	if err != nil {
		return nil, err
	}
	u, err := s.users.Lookup(req.Msg.User)
	if err != nil {
		return nil, err
	}
	return asUser(u, func() (*connect.Response[agentv1.MoveResponse], error) {
		if err := os.Rename(src, dst); err != nil {
			if errors.Is(err, syscall.EXDEV) {
				return nil, errdefs.FailedPrecondition("move %s to %s: different file systems", src, dst)
			}
			return nil, fsError("move", src, err)
		}
		e, err := s.entry(dst)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&agentv1.MoveResponse{Entry: e}), nil
	})
}

func (s *fileService) ReadFile(ctx context.Context, req *connect.Request[agentv1.ReadFileRequest]) (*connect.Response[agentv1.ReadFileResponse], error) {
	p, err := resolvePath("path", req.Msg.Path)
	if err != nil {
		return nil, err
	}
	if req.Msg.Offset < 0 || req.Msg.Limit < 0 {
		return nil, errdefs.InvalidArgument("offset and limit must not be negative")
	}
	limit := req.Msg.Limit
	if limit == 0 || limit > MaxFileChunk {
		limit = MaxFileChunk
	}
	u, err := s.users.Lookup(req.Msg.User)
	if err != nil {
		return nil, err
	}
	// Opened with the user's rights; read as any file once open.
	f, err := asUser(u, func() (*os.File, error) { return openCompat(p) })
	if err != nil {
		return nil, fsError("read", p, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fsError("read", p, err)
	}
	if fi.IsDir() {
		return nil, errdefs.FailedPrecondition("read %s: is a directory", p)
	}
	buf := make([]byte, limit)
	n, err := f.ReadAt(buf, req.Msg.Offset)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fsError("read", p, err)
	}
	eof := errors.Is(err, io.EOF) || req.Msg.Offset+int64(n) >= fi.Size()
	return connect.NewResponse(&agentv1.ReadFileResponse{Data: buf[:n], Eof: eof, Size: fi.Size()}), nil
}

func (s *fileService) WriteFile(ctx context.Context, req *connect.Request[agentv1.WriteFileRequest]) (*connect.Response[agentv1.WriteFileResponse], error) {
	defer s.watches.sync() // the events it caused are sent before it answers
	m := req.Msg
	p, err := resolvePath("path", m.Path)
	if err != nil {
		return nil, err
	}
	if len(m.Data) > MaxFileChunk {
		return nil, errdefs.InvalidArgument("data: %d bytes, at most %d a call; write in pieces with APPEND", len(m.Data), MaxFileChunk)
	}
	if m.Offset < 0 {
		return nil, errdefs.InvalidArgument("offset must not be negative")
	}
	if err := filemeta.Validate(m.Metadata); err != nil {
		return nil, errdefs.InvalidArgument("%v", err)
	}
	if len(m.Metadata) > 0 && !m.ReplaceMetadata {
		return nil, errdefs.InvalidArgument("metadata: given without replace_metadata, which it needs to be stored")
	}
	perm := fs.FileMode(m.Perm & 0o7777)
	if perm == 0 {
		perm = 0o644
	}
	u, err := s.users.Lookup(m.User)
	if err != nil {
		return nil, err
	}
	// A user's write opens, creates and follows links with the user's
	// rights, never root's.
	return asUser(u, func() (*connect.Response[agentv1.WriteFileResponse], error) { return s.write(p, perm, u, m) })
}

func (s *fileService) write(p string, perm fs.FileMode, u sysuser.User, m *agentv1.WriteFileRequest) (*connect.Response[agentv1.WriteFileResponse], error) {
	if _, err := mkdirAllOwned(filepath.Dir(p), u); err != nil {
		return nil, err
	}
	flags := os.O_WRONLY | os.O_CREATE
	switch m.Mode {
	case agentv1.WriteMode_WRITE_MODE_UNSPECIFIED:
		flags |= os.O_TRUNC
	case agentv1.WriteMode_WRITE_MODE_APPEND:
		flags |= os.O_APPEND
	case agentv1.WriteMode_WRITE_MODE_AT_OFFSET:
	case agentv1.WriteMode_WRITE_MODE_REPLACE:
		return s.replace(p, m, perm, u)
	default:
		return nil, errdefs.InvalidArgument("mode %d: want UNSPECIFIED (truncate), APPEND, AT_OFFSET or REPLACE", m.Mode)
	}
	_, statErr := os.Lstat(p)
	isNew := errors.Is(statErr, fs.ErrNotExist)
	if !isNew && m.Mode == agentv1.WriteMode_WRITE_MODE_UNSPECIFIED {
		chownLikeEnvd(func() error { return os.Chown(p, int(u.UID), int(u.GID)) })
	}
	f, err := os.OpenFile(p, flags, perm)
	if err != nil {
		return nil, fsError("write", p, err)
	}
	if isNew && m.Mode == agentv1.WriteMode_WRITE_MODE_UNSPECIFIED {
		chownLikeEnvd(func() error { return f.Chown(int(u.UID), int(u.GID)) })
	}
	if m.Mode == agentv1.WriteMode_WRITE_MODE_AT_OFFSET {
		_, err = f.WriteAt(m.Data, m.Offset)
	} else {
		_, err = f.Write(m.Data)
	}
	if err == nil {
		err = setMetadata(f, m)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fsError("write", p, err)
	}
	if isNew && u.UID == 0 && u.GID != 0 {
		if err := os.Chown(p, int(u.UID), int(u.GID)); err != nil {
			return nil, fsError("chown", p, err)
		}
	}
	e, err := s.entry(p)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&agentv1.WriteFileResponse{Entry: e}), nil
}

// setMetadata gives the open file f the metadata m asks for, if it asks.
func setMetadata(f *os.File, m *agentv1.WriteFileRequest) error {
	if !m.ReplaceMetadata {
		return nil
	}
	err := filemeta.Replace(int(f.Fd()), m.Metadata)
	if errors.Is(err, syscall.ENOTSUP) {
		return errdefs.FailedPrecondition("metadata: the file system of %s keeps no extended attributes", m.Path)
	}
	return err
}

// chownLikeEnvd gives a file written whole to its writer, as envd's upload
// does (a chown of an existing file before it is truncated, of a new one
// once created), so that a directory watch sees the same events as on
// E2B: CREATE, CHMOD and WRITE for a new file, CHMOD and WRITE for an
// overwrite. The file is already the writer's unless the writer may only
// write to it; then the chown is refused and nothing changes, as intended.
func chownLikeEnvd(chown func() error) {
	_ = chown() //nolint:errcheck // refused for a file of another owner: it stays theirs
}

// bootIDPath is where programs read the kernel's boot id; Debian's runsc
// has none, and the gvisor backend mounts the sandbox's own at
// compatBootID, which the compat library (compat/gvisor) reads instead.
// The agent, a static program, reads it there itself.
const (
	bootIDPath   = "/proc/sys/kernel/random/boot_id"
	compatBootID = "/.dsec/boot_id"
)

// openCompat opens p for reading, as the sandbox's programs see it.
func openCompat(p string) (*os.File, error) {
	f, err := os.Open(p)
	if err != nil && p == bootIDPath && errors.Is(err, fs.ErrNotExist) {
		if g, gerr := os.Open(compatBootID); gerr == nil {
			return g, nil
		}
	}
	return f, err
}
