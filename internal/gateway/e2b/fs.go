package e2b

import (
	"context"
	"errors"
	"path"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	envdfs "github.com/opendsec/opendsec/api/gen/e2b/filesystem"
	"github.com/opendsec/opendsec/api/gen/e2b/filesystem/envdfsconnect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// fsService is envd's filesystem.Filesystem on top of our FilesystemService.
type fsService struct{ g *Gateway }

var _ envdfsconnect.FilesystemHandler = (*fsService)(nil)

// permissions renders mode bits the way `ls -l` does.
func permissions(t agentv1.FileType, mode uint32) string {
	b := []byte("-rwxrwxrwx")
	switch t {
	case agentv1.FileType_FILE_TYPE_DIRECTORY:
		b[0] = 'd'
	case agentv1.FileType_FILE_TYPE_SYMLINK:
		b[0] = 'l'
	}
	for i := 0; i < 9; i++ {
		if mode&(1<<uint(8-i)) == 0 {
			b[i+1] = '-'
		}
	}
	return string(b)
}

func entry(e *agentv1.EntryInfo) *envdfs.EntryInfo {
	out := &envdfs.EntryInfo{
		Name: e.Name, Path: e.Path, Size: e.Size, Mode: e.Mode, Permissions: permissions(e.Type, e.Mode),
		Owner: e.Owner, Group: e.Group, ModifiedTime: e.ModifiedAt, Metadata: e.Metadata,
	}
	switch e.Type {
	case agentv1.FileType_FILE_TYPE_FILE:
		out.Type = envdfs.FileType_FILE_TYPE_FILE
	case agentv1.FileType_FILE_TYPE_DIRECTORY:
		out.Type = envdfs.FileType_FILE_TYPE_DIRECTORY
	case agentv1.FileType_FILE_TYPE_SYMLINK:
		out.Type = envdfs.FileType_FILE_TYPE_SYMLINK
		out.IsSymlink = true
		target := e.SymlinkTarget
		out.SymlinkTarget = &target
	}
	if out.ModifiedTime == nil {
		out.ModifiedTime = timestamppb.New(time.Time{})
	}
	return out
}

// maxLinks bounds a symlink chain, as the kernel's MAXSYMLINKS does.
const maxLinks = 40

// withTarget gives a symlink's entry what envd reports for one: the type
// of what it finally points to and that path, absolute. A broken link or
// a loop keeps type symlink and the absolute form of its own target.
func (s *fsService) withTarget(ctx context.Context, e *agentv1.EntryInfo) *envdfs.EntryInfo {
	out := entry(e)
	if e.Type != agentv1.FileType_FILE_TYPE_SYMLINK {
		return out
	}
	target := absTarget(e.Path, e.SymlinkTarget)
	out.SymlinkTarget = &target
	for cur, i := target, 0; i < maxLinks; i++ {
		resp, err := s.g.files.Stat(ctx, connect.NewRequest(&agentv1.StatRequest{Path: cur, User: callOf(ctx).user}))
		if err != nil {
			return out
		}
		t := resp.Msg.Entry
		if t.Type != agentv1.FileType_FILE_TYPE_SYMLINK {
			resolved := cur
			out.SymlinkTarget = &resolved
			switch t.Type {
			case agentv1.FileType_FILE_TYPE_FILE:
				out.Type = envdfs.FileType_FILE_TYPE_FILE
			case agentv1.FileType_FILE_TYPE_DIRECTORY:
				out.Type = envdfs.FileType_FILE_TYPE_DIRECTORY
			}
			return out
		}
		cur = absTarget(cur, t.SymlinkTarget)
	}
	return out
}

// absTarget is link's target as an absolute, clean path.
func absTarget(link, target string) string {
	if path.IsAbs(target) {
		return path.Clean(target)
	}
	return path.Join(path.Dir(link), target)
}

func (s *fsService) Stat(ctx context.Context, req *connect.Request[envdfs.StatRequest]) (*connect.Response[envdfs.StatResponse], error) {
	resp, err := s.g.files.Stat(ctx, connect.NewRequest(&agentv1.StatRequest{Path: resolve(callOf(ctx).user, req.Msg.Path), User: callOf(ctx).user}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&envdfs.StatResponse{Entry: s.withTarget(ctx, resp.Msg.Entry)}), nil
}

func (s *fsService) ListDir(ctx context.Context, req *connect.Request[envdfs.ListDirRequest]) (*connect.Response[envdfs.ListDirResponse], error) {
	resp, err := s.g.files.ListDir(ctx, connect.NewRequest(&agentv1.ListDirRequest{Path: resolve(callOf(ctx).user, req.Msg.Path), Depth: req.Msg.Depth, User: callOf(ctx).user}))
	if err != nil {
		return nil, err
	}
	out := &envdfs.ListDirResponse{}
	for _, e := range resp.Msg.Entries {
		out.Entries = append(out.Entries, s.withTarget(ctx, e))
	}
	return connect.NewResponse(out), nil
}

// MakeDir answers AlreadyExists for an existing directory; E2B's SDKs read
// that as "not created".
func (s *fsService) MakeDir(ctx context.Context, req *connect.Request[envdfs.MakeDirRequest]) (*connect.Response[envdfs.MakeDirResponse], error) {
	call := callOf(ctx)
	p := resolve(call.user, req.Msg.Path)
	resp, err := s.g.files.MakeDir(ctx, connect.NewRequest(&agentv1.MakeDirRequest{Path: p, User: call.user}))
	if err != nil {
		return nil, err
	}
	if !resp.Msg.Created {
		return nil, connect.NewError(connect.CodeAlreadyExists, errors.New("directory "+p+" already exists"))
	}
	return connect.NewResponse(&envdfs.MakeDirResponse{Entry: entry(resp.Msg.Entry)}), nil
}

func (s *fsService) Move(ctx context.Context, req *connect.Request[envdfs.MoveRequest]) (*connect.Response[envdfs.MoveResponse], error) {
	user := callOf(ctx).user
	resp, err := s.g.files.Move(ctx, connect.NewRequest(&agentv1.MoveRequest{Source: resolve(user, req.Msg.Source), Destination: resolve(user, req.Msg.Destination), User: user}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&envdfs.MoveResponse{Entry: entry(resp.Msg.Entry)}), nil
}

func (s *fsService) Remove(ctx context.Context, req *connect.Request[envdfs.RemoveRequest]) (*connect.Response[envdfs.RemoveResponse], error) {
	// envd's remove of a path that is not there succeeds.
	if _, err := s.g.files.Remove(ctx, connect.NewRequest(&agentv1.RemoveRequest{Path: resolve(callOf(ctx).user, req.Msg.Path), Recursive: true, User: callOf(ctx).user})); err != nil && connect.CodeOf(err) != connect.CodeNotFound {
		return nil, err
	}
	return connect.NewResponse(&envdfs.RemoveResponse{}), nil
}

func eventTypeOf(t agentv1.FileEventType) envdfs.EventType {
	switch t {
	case agentv1.FileEventType_FILE_EVENT_TYPE_CREATE:
		return envdfs.EventType_EVENT_TYPE_CREATE
	case agentv1.FileEventType_FILE_EVENT_TYPE_WRITE:
		return envdfs.EventType_EVENT_TYPE_WRITE
	case agentv1.FileEventType_FILE_EVENT_TYPE_REMOVE:
		return envdfs.EventType_EVENT_TYPE_REMOVE
	case agentv1.FileEventType_FILE_EVENT_TYPE_RENAME:
		return envdfs.EventType_EVENT_TYPE_RENAME
	case agentv1.FileEventType_FILE_EVENT_TYPE_CHMOD:
		return envdfs.EventType_EVENT_TYPE_CHMOD
	}
	return envdfs.EventType_EVENT_TYPE_UNSPECIFIED
}

// watch opens our WatchDir stream and waits for its start. The agent
// watches any directory, on a network mount too, so envd's
// allow_network_mounts (0.6.4) is taken and needs nothing more.
func (s *fsService) watch(ctx context.Context, p string, recursive, entries bool) (*connect.ServerStreamForClient[agentv1.WatchDirResponse], error) {
	in, err := s.g.files.WatchDir(ctx, connect.NewRequest(&agentv1.WatchDirRequest{Path: resolve(callOf(ctx).user, p), Recursive: recursive, IncludeEntry: entries, User: callOf(ctx).user}))
	if err != nil {
		return nil, err
	}
	if !in.Receive() {
		in.Close()
		if err := in.Err(); err != nil {
			return nil, err
		}
		return nil, errdefs.ToConnect(errdefs.Unavailable("watch %s: the sandbox closed the watch", p))
	}
	return in, nil
}

// eventOf is an event as envd sends it, with the entry the agent read
// when it sent the event (include_entry, envd 0.6.3).
func (s *fsService) eventOf(ctx context.Context, ev *agentv1.FileEvent) *envdfs.FilesystemEvent {
	out := &envdfs.FilesystemEvent{Name: ev.Name, Type: eventTypeOf(ev.Type)}
	if ev.Entry != nil {
		out.Entry = s.withTarget(ctx, ev.Entry)
	}
	return out
}

func (s *fsService) WatchDir(ctx context.Context, req *connect.Request[envdfs.WatchDirRequest], stream *connect.ServerStream[envdfs.WatchDirResponse]) error {
	m := req.Msg
	in, err := s.watch(ctx, m.Path, m.Recursive, m.IncludeEntry)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := stream.Send(&envdfs.WatchDirResponse{Event: &envdfs.WatchDirResponse_Start{Start: &envdfs.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	for in.Receive() {
		ev := in.Msg().Event
		if ev == nil {
			continue
		}
		out := &envdfs.WatchDirResponse{Event: &envdfs.WatchDirResponse_Filesystem{Filesystem: s.eventOf(ctx, ev)}}
		if err := stream.Send(out); err != nil {
			return err
		}
	}
	return in.Err()
}

// watchers hold the polling watchers (CreateWatcher / GetWatcherEvents):
// the gateway collects their events until the client fetches them.
type watchers struct {
	mu   sync.Mutex
	next int
	byID map[string]*pollWatcher // guarded by mu
}

type pollWatcher struct {
	sandbox string
	cancel  context.CancelFunc

	mu     sync.Mutex
	events []*envdfs.FilesystemEvent // guarded by mu
	err    error                     // guarded by mu
}

// maxBufferedEvents bounds one polling watcher's backlog.
const maxBufferedEvents = 10000

func newWatchers() *watchers { return &watchers{byID: map[string]*pollWatcher{}} }

func (ws *watchers) closeAll() {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	for id, w := range ws.byID {
		w.cancel()
		delete(ws.byID, id)
	}
}

func (s *fsService) CreateWatcher(ctx context.Context, req *connect.Request[envdfs.CreateWatcherRequest]) (*connect.Response[envdfs.CreateWatcherResponse], error) {
	m := req.Msg
	call := callOf(ctx)
	// The watch outlives this request.
	wctx, cancel := context.WithCancel(context.WithValue(inSandbox(context.Background(), call.sandbox), envdKey{}, call))
	in, err := s.watch(wctx, m.Path, m.Recursive, m.IncludeEntry)
	if err != nil {
		cancel()
		return nil, err
	}
	w := &pollWatcher{sandbox: call.sandbox, cancel: cancel}
	ws := s.g.watchers
	ws.mu.Lock()
	ws.next++
	id := "w" + path.Base(call.sandbox) + "-" + strconv.Itoa(ws.next)
	ws.byID[id] = w
	ws.mu.Unlock()
	go func() {
		defer in.Close()
		for in.Receive() {
			ev := in.Msg().Event
			if ev == nil {
				continue
			}
			out := s.eventOf(wctx, ev)
			w.mu.Lock()
			if len(w.events) < maxBufferedEvents {
				w.events = append(w.events, out)
			}
			w.mu.Unlock()
		}
		w.mu.Lock()
		w.err = in.Err()
		w.mu.Unlock()
	}()
	return connect.NewResponse(&envdfs.CreateWatcherResponse{WatcherId: id}), nil
}

func (s *fsService) lookupWatcher(ctx context.Context, id string) (*pollWatcher, error) {
	ws := s.g.watchers
	ws.mu.Lock()
	defer ws.mu.Unlock()
	w, ok := ws.byID[id]
	if !ok || w.sandbox != callOf(ctx).sandbox {
		return nil, connect.NewError(connect.CodeNotFound, errors.New("watcher "+id+" not found"))
	}
	return w, nil
}

func (s *fsService) GetWatcherEvents(ctx context.Context, req *connect.Request[envdfs.GetWatcherEventsRequest]) (*connect.Response[envdfs.GetWatcherEventsResponse], error) {
	w, err := s.lookupWatcher(ctx, req.Msg.WatcherId)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	events, werr := w.events, w.err
	w.events = nil
	w.mu.Unlock()
	if len(events) == 0 && werr != nil && !errors.Is(werr, context.Canceled) {
		return nil, werr
	}
	return connect.NewResponse(&envdfs.GetWatcherEventsResponse{Events: events}), nil
}

func (s *fsService) RemoveWatcher(ctx context.Context, req *connect.Request[envdfs.RemoveWatcherRequest]) (*connect.Response[envdfs.RemoveWatcherResponse], error) {
	w, err := s.lookupWatcher(ctx, req.Msg.WatcherId)
	if err != nil {
		return nil, err
	}
	w.cancel()
	ws := s.g.watchers
	ws.mu.Lock()
	delete(ws.byID, req.Msg.WatcherId)
	ws.mu.Unlock()
	return connect.NewResponse(&envdfs.RemoveWatcherResponse{}), nil
}
