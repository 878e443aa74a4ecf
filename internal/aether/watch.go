package aether

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unsafe"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// maxWatches bounds the directories one WatchDir call watches.
const maxWatches = 8192

const watchMask = unix.IN_CREATE | unix.IN_MODIFY | unix.IN_CLOSE_WRITE | unix.IN_DELETE | unix.IN_DELETE_SELF |
	unix.IN_MOVED_FROM | unix.IN_MOVED_TO | unix.IN_ATTRIB

// watcher follows one directory tree with inotify.
type watcher struct {
	root      string
	recursive bool
	f         *os.File // the inotify descriptor, non-blocking, in the poller

	mu    sync.Mutex
	paths map[int32]string // guarded by mu: watch descriptor -> directory
}

func newWatcher(root string, recursive bool) (*watcher, error) {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, errdefs.Wrap(errdefs.ErrUnavailable, err, "watch %s: inotify", root)
	}
	w := &watcher{root: root, recursive: recursive, f: os.NewFile(uintptr(fd), "inotify"), paths: map[int32]string{}}
	if err := w.add(root); err != nil {
		w.f.Close()
		return nil, err
	}
	if recursive {
		filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error { //nolint:errcheck // unreadable parts are skipped
			if err == nil && d.IsDir() && p != root {
				w.add(p) //nolint:errcheck // best effort below the root
			}
			return nil
		})
	}
	return w, nil
}

func (w *watcher) add(dir string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.paths) >= maxWatches {
		return errdefs.ResourceExhausted("watch %s: more than %d directories", w.root, maxWatches)
	}
	wd, err := unix.InotifyAddWatch(int(w.f.Fd()), dir, watchMask)
	if err != nil {
		return fsError("watch", dir, err)
	}
	w.paths[int32(wd)] = dir
	return nil
}

func eventType(mask uint32) agentv1.FileEventType {
	switch {
	case mask&unix.IN_CREATE != 0:
		return agentv1.FileEventType_FILE_EVENT_TYPE_CREATE
	case mask&(unix.IN_DELETE|unix.IN_DELETE_SELF) != 0:
		return agentv1.FileEventType_FILE_EVENT_TYPE_REMOVE
	case mask&(unix.IN_MOVED_FROM|unix.IN_MOVED_TO) != 0:
		return agentv1.FileEventType_FILE_EVENT_TYPE_RENAME
	case mask&unix.IN_ATTRIB != 0:
		return agentv1.FileEventType_FILE_EVENT_TYPE_CHMOD
	case mask&(unix.IN_MODIFY|unix.IN_CLOSE_WRITE) != 0:
		return agentv1.FileEventType_FILE_EVENT_TYPE_WRITE
	}
	return agentv1.FileEventType_FILE_EVENT_TYPE_UNSPECIFIED
}

// run sends events until ctx ends or the root goes away.
func (w *watcher) run(ctx context.Context, send func(*agentv1.FileEvent) error) error {
	go func() {
		<-ctx.Done()
		w.f.SetReadDeadline(time.Now()) //nolint:errcheck // unblocks the read below
	}()
	buf := make([]byte, 64*1024)
	for {
		n, err := w.f.Read(buf)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded) {
				return nil
			}
			return err
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			nameBytes := buf[off+unix.SizeofInotifyEvent : off+unix.SizeofInotifyEvent+int(ev.Len)]
			off += unix.SizeofInotifyEvent + int(ev.Len)
			name := strings.TrimRight(string(nameBytes), "\x00")
			w.mu.Lock()
			dir, ok := w.paths[ev.Wd]
			w.mu.Unlock()
			if !ok || ev.Mask&unix.IN_IGNORED != 0 {
				continue
			}
			full := filepath.Join(dir, name)
			if ev.Mask&unix.IN_DELETE_SELF != 0 && dir == w.root {
				return nil // the watched directory itself is gone
			}
			if w.recursive && ev.Mask&unix.IN_ISDIR != 0 && ev.Mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0 {
				w.add(full) //nolint:errcheck // a full watcher keeps reporting what it has
			}
			if ev.Mask&unix.IN_DELETE_SELF != 0 {
				continue // a subdirectory's own removal was reported by its parent
			}
			rel, _ := filepath.Rel(w.root, full)
			if err := send(&agentv1.FileEvent{Name: rel, Type: eventType(ev.Mask)}); err != nil {
				return err
			}
		}
	}
}

func (s *fileService) WatchDir(ctx context.Context, req *connect.Request[agentv1.WatchDirRequest], stream *connect.ServerStream[agentv1.WatchDirResponse]) error {
	root, err := resolvePath("path", req.Msg.Path)
	if err != nil {
		return err
	}
	if fi, err := os.Stat(root); err != nil {
		return fsError("watch", root, err)
	} else if !fi.IsDir() {
		return errdefs.FailedPrecondition("watch %s: not a directory", root)
	}
	w, err := newWatcher(root, req.Msg.Recursive)
	if err != nil {
		return err
	}
	defer w.f.Close()
	if err := stream.Send(&agentv1.WatchDirResponse{Started: true}); err != nil {
		return err
	}
	return w.run(ctx, func(ev *agentv1.FileEvent) error {
		return stream.Send(&agentv1.WatchDirResponse{Event: ev})
	})
}
