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

// watchMask is fsnotify's (which envd uses): a write is IN_MODIFY alone,
// not also IN_CLOSE_WRITE, so one write is one WRITE event.
const watchMask = unix.IN_CREATE | unix.IN_MODIFY | unix.IN_DELETE | unix.IN_DELETE_SELF |
	unix.IN_MOVED_FROM | unix.IN_MOVED_TO | unix.IN_ATTRIB

// watcher follows one directory tree with inotify.
type watcher struct {
	root      string
	recursive bool
	f         *os.File // the inotify descriptor, non-blocking, in the poller

	// entry, when set, reads the entry an event names as it is sent.
	entry func(path string) (*agentv1.EntryInfo, error)

	mu    sync.Mutex
	paths map[int32]string // guarded by mu: watch descriptor -> directory
	syncs []chan struct{}  // guarded by mu: closed once the events queued before them are sent
}

// watchSet is the agent's running watchers, so a file call can wait for
// the events it caused to go out before it answers [ours]: a client that
// polls a watcher right after a write then sees that write, as with envd.
type watchSet struct {
	mu  sync.Mutex
	all map[*watcher]struct{} // guarded by mu
}

// syncWait bounds how long a file call waits for the watchers.
const syncWait = 100 * time.Millisecond

func (ws *watchSet) add(w *watcher) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.all == nil {
		ws.all = map[*watcher]struct{}{}
	}
	ws.all[w] = struct{}{}
}

func (ws *watchSet) remove(w *watcher) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	delete(ws.all, w)
}

// sync returns once every watcher has sent the events queued so far, or
// after syncWait.
func (ws *watchSet) sync() {
	ws.mu.Lock()
	var waits []chan struct{}
	for w := range ws.all {
		ch := make(chan struct{})
		w.mu.Lock()
		w.syncs = append(w.syncs, ch)
		w.mu.Unlock()
		w.f.SetReadDeadline(time.Now()) //nolint:errcheck // wakes its reader, which checks syncs
		waits = append(waits, ch)
	}
	ws.mu.Unlock()
	timeout := time.NewTimer(syncWait)
	defer timeout.Stop()
	for _, ch := range waits {
		select {
		case <-ch:
		case <-timeout.C:
			return
		}
	}
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
	case mask&unix.IN_MODIFY != 0:
		return agentv1.FileEventType_FILE_EVENT_TYPE_WRITE
	}
	return agentv1.FileEventType_FILE_EVENT_TYPE_UNSPECIFIED
}

// run sends events until ctx ends or the root goes away.
// coalesceWindow is how long events are held for a repeat to merge with:
// a truncate and the write after it (an overwrite) are one WRITE, as the
// kernel merges identical events still queued.
const coalesceWindow = 10 * time.Millisecond

func (w *watcher) run(ctx context.Context, send func(*agentv1.FileEvent) error) error {
	go func() {
		<-ctx.Done()
		w.f.SetReadDeadline(time.Now()) //nolint:errcheck // unblocks the read below
	}()
	buf := make([]byte, 64*1024)
	var pending []*agentv1.FileEvent
	var flushAt time.Time // when the first held event is due
	flush := func() error {
		for _, ev := range pending {
			if w.entry != nil && ev.Type != agentv1.FileEventType_FILE_EVENT_TYPE_REMOVE {
				ev.Entry, _ = w.entry(filepath.Join(w.root, ev.Name)) // gone by now: none
			}
			if err := send(ev); err != nil {
				return err
			}
		}
		pending, flushAt = pending[:0], time.Time{}
		return nil
	}
	for {
		// Held events go out one window after the first of them, however
		// many follow, or when a file call asks (syncs). The context and
		// syncs are checked after the deadline is set, so the deadline a
		// cancel or a sync sets is never overwritten unseen.
		w.f.SetReadDeadline(flushAt) //nolint:errcheck // an inotify file in the poller
		if ctx.Err() != nil {
			return nil
		}
		if syncs := w.takeSyncs(); len(syncs) > 0 {
			if err := w.drain(buf, &pending, &flushAt); err != nil {
				return err
			}
			err := flush()
			for _, ch := range syncs {
				close(ch)
			}
			if err != nil {
				return err
			}
			continue
		}
		n, err := w.f.Read(buf)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				return err
			}
			if !flushAt.IsZero() && !time.Now().Before(flushAt) {
				if err := flush(); err != nil {
					return err
				}
			}
			continue // a sync's wake-up is handled at the top
		}
		if gone := w.parse(buf[:n], &pending, &flushAt); gone {
			return flush()
		}
	}
}

func (w *watcher) takeSyncs() []chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.syncs
	w.syncs = nil
	return s
}

// drain reads what the inotify queue holds without waiting.
func (w *watcher) drain(buf []byte, pending *[]*agentv1.FileEvent, flushAt *time.Time) error {
	for {
		n, err := unix.Read(int(w.f.Fd()), buf)
		if err == unix.EAGAIN || n <= 0 {
			return nil
		}
		if err != nil {
			return err
		}
		if w.parse(buf[:n], pending, flushAt) {
			return nil
		}
	}
}

// parse adds buf's events to pending, a repeat of the event before it
// merged into it; it reports whether the watched directory is gone.
func (w *watcher) parse(buf []byte, pending *[]*agentv1.FileEvent, flushAt *time.Time) bool {
	for off := 0; off+unix.SizeofInotifyEvent <= len(buf); {
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
			return true
		}
		if w.recursive && ev.Mask&unix.IN_ISDIR != 0 && ev.Mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0 {
			w.add(full) //nolint:errcheck // a full watcher keeps reporting what it has
		}
		if ev.Mask&unix.IN_DELETE_SELF != 0 {
			continue // a subdirectory's own removal was reported by its parent
		}
		rel, _ := filepath.Rel(w.root, full)
		fe := &agentv1.FileEvent{Name: rel, Type: eventType(ev.Mask)}
		if k := len(*pending); k > 0 && (*pending)[k-1].Name == fe.Name && (*pending)[k-1].Type == fe.Type {
			continue // the same as the one before it
		}
		if len(*pending) == 0 {
			*flushAt = time.Now().Add(coalesceWindow)
		}
		*pending = append(*pending, fe)
	}
	return false
}

func (s *fileService) WatchDir(ctx context.Context, req *connect.Request[agentv1.WatchDirRequest], stream *connect.ServerStream[agentv1.WatchDirResponse]) error {
	root, err := resolvePath("path", req.Msg.Path)
	if err != nil {
		return err
	}
	u, err := s.users.Lookup(req.Msg.User)
	if err != nil {
		return err
	}
	// The directory (and those below it, when recursive) is opened for
	// watching with the user's rights; directories made later are added as
	// they come.
	w, err := asUser(u, func() (*watcher, error) {
		if fi, err := os.Stat(root); err != nil {
			return nil, fsError("watch", root, err)
		} else if !fi.IsDir() {
			return nil, errdefs.FailedPrecondition("watch %s: not a directory", root)
		}
		return newWatcher(root, req.Msg.Recursive)
	})
	if err != nil {
		return err
	}
	if req.Msg.IncludeEntry {
		w.entry = s.entry
	}
	defer w.f.Close()
	defer func() { // a sync that came as the watch ended waits no more
		for _, ch := range w.takeSyncs() {
			close(ch)
		}
	}()
	s.watches.add(w)
	defer s.watches.remove(w)
	if err := stream.Send(&agentv1.WatchDirResponse{Started: true}); err != nil {
		return err
	}
	return w.run(ctx, func(ev *agentv1.FileEvent) error {
		return stream.Send(&agentv1.WatchDirResponse{Event: ev})
	})
}
