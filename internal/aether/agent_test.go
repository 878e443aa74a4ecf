package aether

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/chronus"
	"github.com/opendsec/opendsec/internal/testutil"
)

type clients struct {
	proc    agentv1connect.ProcessServiceClient
	fs      agentv1connect.FilesystemServiceClient
	session agentv1connect.SessionServiceClient
	agent   agentv1connect.AgentServiceClient
}

// startAgent runs an agent in-process, connected through a real agentlink.
func startAgent(t testing.TB) clients {
	t.Helper()
	testutil.RequireRootUser(t)
	dir := t.TempDir()
	link, err := agentlink.Listen(filepath.Join(dir, "edge.sock"), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	a := New(Config{EdgeSocket: link.Path(), Env: map[string]string{"DSEC_TEST": "1", "PATH": os.Getenv("PATH")}, Root: "/"}, nil)
	done := make(chan struct{})
	go func() { a.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); link.Close(); <-done })
	hc := &http.Client{Transport: link}
	const base = "http://agent"
	return clients{
		proc:    agentv1connect.NewProcessServiceClient(hc, base),
		fs:      agentv1connect.NewFilesystemServiceClient(hc, base),
		session: agentv1connect.NewSessionServiceClient(hc, base),
		agent:   agentv1connect.NewAgentServiceClient(hc, base),
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func run(t *testing.T, c clients, cfg *agentv1.ProcessConfig, capBytes uint64) *agentv1.RunResponse {
	t.Helper()
	resp, err := c.proc.Run(ctxT(t), connect.NewRequest(&agentv1.RunRequest{Process: cfg, MaxOutputBytes: capBytes}))
	if err != nil {
		t.Fatalf("Run(%v): %v", cfg.Args, err)
	}
	return resp.Msg
}

func TestRunCapturesOutputAndExitCode(t *testing.T) {
	c := startAgent(t)
	r := run(t, c, &agentv1.ProcessConfig{
		Args: []string{"sh", "-c", `echo out; echo err >&2; echo "$DSEC_TEST $EXTRA $(pwd)"; exit 3`},
		Env:  map[string]string{"EXTRA": "x"}, Cwd: "/tmp",
	}, 0)
	if string(r.Stdout) != "out\n1 x /tmp\n" || string(r.Stderr) != "err\n" || r.ExitCode != 3 {
		t.Fatalf("got stdout %q stderr %q code %d", r.Stdout, r.Stderr, r.ExitCode)
	}
}

func TestRunMissingCommandIs127(t *testing.T) {
	c := startAgent(t)
	r := run(t, c, &agentv1.ProcessConfig{Args: []string{"no-such-program-xyz"}}, 0)
	if r.ExitCode != 127 || !strings.Contains(string(r.Stderr), "no-such-program-xyz: command not found") {
		t.Fatalf("got code %d stderr %q", r.ExitCode, r.Stderr)
	}
	r = run(t, c, &agentv1.ProcessConfig{Args: []string{"sh", "-c", "no-such-program-xyz"}}, 0)
	if r.ExitCode != 127 || len(r.Stderr) == 0 {
		t.Fatalf("through sh: code %d stderr %q", r.ExitCode, r.Stderr)
	}
}

func TestRunStdinTimeoutAndCap(t *testing.T) {
	c := startAgent(t)
	r := run(t, c, &agentv1.ProcessConfig{Args: []string{"cat"}, Stdin: []byte("hello stdin")}, 0)
	if string(r.Stdout) != "hello stdin" {
		t.Fatalf("cat stdin: %q", r.Stdout)
	}
	r = run(t, c, &agentv1.ProcessConfig{Args: []string{"sleep", "30"}, TimeoutMs: 200}, 0)
	if !r.TimedOut || r.Signal != 9 || r.ExitCode != 137 {
		t.Fatalf("timeout: %+v", r)
	}
	// An endless writer is capped: the agent keeps the first bytes, counts
	// the rest and the process runs until its timeout.
	r = run(t, c, &agentv1.ProcessConfig{Args: []string{"yes"}, TimeoutMs: 500}, 4096)
	if len(r.Stdout) != 4096 || r.StdoutDropped == 0 || !r.TimedOut {
		t.Fatalf("yes: kept %d dropped %d timedOut %v", len(r.Stdout), r.StdoutDropped, r.TimedOut)
	}
}

func TestRunRejectsBadInput(t *testing.T) {
	c := startAgent(t)
	for name, cfg := range map[string]*agentv1.ProcessConfig{
		"no args":    {},
		"bad cwd":    {Args: []string{"true"}, Cwd: "/no/such/dir"},
		"bad user":   {Args: []string{"true"}, User: "no-such-user-xyz"},
		"bad env":    {Args: []string{"true"}, Env: map[string]string{"A=B": "c"}},
		"pty in run": {Args: []string{"true"}, Pty: &agentv1.PtySize{Cols: 80, Rows: 24}},
	} {
		_, err := c.proc.Run(ctxT(t), connect.NewRequest(&agentv1.RunRequest{Process: cfg}))
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("%s: err = %v, want invalid_argument", name, err)
		}
	}
}

func TestStartStreamsAndTakesInput(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	stream, err := c.proc.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{
		Args:          []string{"sh", "-c", `echo ready; read line; echo "got $line"; read more; echo "then $more"`},
		KeepStdinOpen: true, Tag: "reader",
	}}))
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	var pid uint32
	var exit *agentv1.ProcessEvent_Exited
	sentFirst := false
	for stream.Receive() {
		ev := stream.Msg().Event
		switch {
		case ev.GetStarted() != nil:
			pid = ev.GetStarted().Pid
		case ev.GetOutput() != nil:
			out.Write(ev.GetOutput().Data)
			if !sentFirst && strings.Contains(out.String(), "ready") {
				sentFirst = true
				sel := &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Tag{Tag: "reader"}}
				if _, err := c.proc.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{Process: sel, Data: []byte("one\n")})); err != nil {
					t.Fatal(err)
				}
				byPID := &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Pid{Pid: pid}}
				if _, err := c.proc.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{Process: byPID, Data: []byte("two\n")})); err != nil {
					t.Fatal(err)
				}
			}
		case ev.GetExited() != nil:
			exit = ev.GetExited()
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if pid == 0 || exit == nil || exit.ExitCode != 0 || out.String() != "ready\ngot one\nthen two\n" {
		t.Fatalf("pid %d exit %v output %q", pid, exit, out.String())
	}
}

func TestSignalAndConnect(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	stream, err := c.proc.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{
		Args: []string{"sleep", "60"}, Tag: "sleeper",
	}}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() || stream.Msg().Event.GetStarted() == nil {
		t.Fatalf("no started event: %v", stream.Err())
	}
	pid := stream.Msg().Event.GetStarted().Pid
	list, err := c.proc.List(ctx, connect.NewRequest(&agentv1.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range list.Msg.Processes {
		if p.Pid == pid && p.Managed && p.Tag == "sleeper" && len(p.Cmdline) == 2 && p.Cmdline[0] == "sleep" {
			found = true
		}
	}
	if !found {
		t.Fatalf("process %d not listed as managed sleeper", pid)
	}
	sel := &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Tag{Tag: "sleeper"}}
	conn, err := c.proc.Connect(ctx, connect.NewRequest(&agentv1.ConnectRequest{Process: sel}))
	if err != nil {
		t.Fatal(err)
	}
	if !conn.Receive() || conn.Msg().Event.GetStarted().GetPid() != pid {
		t.Fatalf("connect: first event %v, %v", conn.Msg(), conn.Err())
	}
	if _, err := c.proc.SendSignal(ctx, connect.NewRequest(&agentv1.SendSignalRequest{Process: sel, Signal: 15})); err != nil {
		t.Fatal(err)
	}
	var exited *agentv1.ProcessEvent_Exited
	for conn.Receive() {
		if e := conn.Msg().Event.GetExited(); e != nil {
			exited = e
		}
	}
	if exited == nil || exited.Signal != 15 || exited.ExitCode != 143 {
		t.Fatalf("connect saw exit %v (err %v)", exited, conn.Err())
	}
	_, err = c.proc.SendSignal(ctx, connect.NewRequest(&agentv1.SendSignalRequest{Process: sel, Signal: 99}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("signal 99: %v", err)
	}
}

func TestPTYResizeAndInput(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	stream, err := c.proc.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{
		Args: []string{"sh"}, Pty: &agentv1.PtySize{Cols: 100, Rows: 30}, Tag: "term",
	}}))
	if err != nil {
		t.Fatal(err)
	}
	sel := &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Tag{Tag: "term"}}
	if !stream.Receive() {
		t.Fatal(stream.Err())
	}
	if _, err := c.proc.ResizePty(ctx, connect.NewRequest(&agentv1.ResizePtyRequest{Process: sel, Size: &agentv1.PtySize{Cols: 123, Rows: 45}})); err != nil {
		t.Fatal(err)
	}
	input := "stty size; tty; exit 7\n"
	if _, err := c.proc.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{Process: sel, Data: []byte(input)})); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	var exit *agentv1.ProcessEvent_Exited
	for stream.Receive() {
		ev := stream.Msg().Event
		if o := ev.GetOutput(); o != nil {
			if o.Stream != agentv1.Stream_STREAM_PTY {
				t.Fatalf("output on %v, want pty", o.Stream)
			}
			out.Write(o.Data)
		}
		if e := ev.GetExited(); e != nil {
			exit = e
		}
	}
	if !strings.Contains(out.String(), "45 123") || !strings.Contains(out.String(), "/dev/pts/") || exit == nil || exit.ExitCode != 7 {
		t.Fatalf("pty output %q exit %v", out.String(), exit)
	}
}

func TestFiles(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	dir := t.TempDir()
	p := filepath.Join(dir, "a", "b", "f.txt")
	if _, err := c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: p, Data: []byte("hello ")})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: p, Data: []byte("world"), Mode: agentv1.WriteMode_WRITE_MODE_APPEND})); err != nil {
		t.Fatal(err)
	}
	rd, err := c.fs.ReadFile(ctx, connect.NewRequest(&agentv1.ReadFileRequest{Path: p}))
	if err != nil || string(rd.Msg.Data) != "hello world" || !rd.Msg.Eof || rd.Msg.Size != 11 {
		t.Fatalf("read = %+v, %v", rd, err)
	}
	part, err := c.fs.ReadFile(ctx, connect.NewRequest(&agentv1.ReadFileRequest{Path: p, Offset: 6, Limit: 3}))
	if err != nil || string(part.Msg.Data) != "wor" || part.Msg.Eof {
		t.Fatalf("partial read = %+v, %v", part, err)
	}
	st, err := c.fs.Stat(ctx, connect.NewRequest(&agentv1.StatRequest{Path: p}))
	if err != nil || st.Msg.Entry.Type != agentv1.FileType_FILE_TYPE_FILE || st.Msg.Entry.Mode != 0o644 || st.Msg.Entry.Name != "f.txt" {
		t.Fatalf("stat = %+v, %v", st, err)
	}
	md, err := c.fs.MakeDir(ctx, connect.NewRequest(&agentv1.MakeDirRequest{Path: filepath.Join(dir, "a", "c")}))
	if err != nil || !md.Msg.Created {
		t.Fatalf("mkdir = %+v, %v", md, err)
	}
	md, err = c.fs.MakeDir(ctx, connect.NewRequest(&agentv1.MakeDirRequest{Path: filepath.Join(dir, "a", "c")}))
	if err != nil || md.Msg.Created {
		t.Fatalf("second mkdir = %+v, %v", md, err)
	}
	mv, err := c.fs.Move(ctx, connect.NewRequest(&agentv1.MoveRequest{Source: p, Destination: filepath.Join(dir, "a", "c", "g.txt")}))
	if err != nil || mv.Msg.Entry.Name != "g.txt" {
		t.Fatalf("move = %+v, %v", mv, err)
	}
	ls, err := c.fs.ListDir(ctx, connect.NewRequest(&agentv1.ListDirRequest{Path: filepath.Join(dir, "a"), Depth: 2}))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ls.Msg.Entries {
		names = append(names, strings.TrimPrefix(e.Path, dir))
	}
	if strings.Join(names, ",") != "/a/b,/a/c,/a/c/g.txt" {
		t.Fatalf("list = %v", names)
	}
	_, err = c.fs.Remove(ctx, connect.NewRequest(&agentv1.RemoveRequest{Path: filepath.Join(dir, "a")}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("non-recursive remove of a full dir: %v", err)
	}
	if _, err := c.fs.Remove(ctx, connect.NewRequest(&agentv1.RemoveRequest{Path: filepath.Join(dir, "a"), Recursive: true})); err != nil {
		t.Fatal(err)
	}
	_, err = c.fs.Stat(ctx, connect.NewRequest(&agentv1.StatRequest{Path: filepath.Join(dir, "a")}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("stat after remove: %v", err)
	}
	_, err = c.fs.ReadFile(ctx, connect.NewRequest(&agentv1.ReadFileRequest{Path: ""}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("empty path: %v", err)
	}
}

func TestSessionKeepsState(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	cs, err := c.session.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{Cwd: "/tmp"}))
	if err != nil {
		t.Fatal(err)
	}
	id := cs.Msg.Session.Id
	runIn := func(cmd string, timeoutMs uint32) *agentv1.RunInSessionResponse {
		t.Helper()
		r, err := c.session.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: id, Command: cmd, TimeoutMs: timeoutMs}))
		if err != nil {
			t.Fatalf("%q: %v", cmd, err)
		}
		return r.Msg
	}
	runIn("cd / && export GREETING='it'\\''s kept' && f() { echo fn-$1; }", 0)
	r := runIn(`echo "$GREETING"; pwd; f 1; echo -n no-newline`, 0)
	if string(r.Stdout) != "it's kept\n/\nfn-1\nno-newline" || r.Cwd != "/" || r.ExitCode != 0 {
		t.Fatalf("state not kept: stdout %q cwd %q code %d", r.Stdout, r.Cwd, r.ExitCode)
	}
	if r := runIn("echo 'unbalanced", 0); r.ExitCode == 0 || len(r.Stderr) == 0 {
		t.Fatalf("syntax error: %+v", r)
	}
	if r := runIn("read x; echo read=$x:$?", 0); !strings.HasPrefix(string(r.Stdout), "read=:1") {
		t.Fatalf("stdin is not /dev/null: %q", r.Stdout)
	}
	runIn("sleep 30 & echo $! > /tmp/.chronus-bg-$$", 0)
	r = runIn("sleep 20", 300)
	if !r.TimedOut {
		t.Fatalf("no timeout: %+v", r)
	}
	// The background job from an earlier command survives the timeout.
	if r := runIn("kill -0 $(cat /tmp/.chronus-bg-$$) && echo alive; kill $(cat /tmp/.chronus-bg-$$); rm /tmp/.chronus-bg-$$", 0); string(r.Stdout) != "alive\n" {
		t.Fatalf("background job: %q %q", r.Stdout, r.Stderr)
	}
	if r := runIn("echo still; false", 0); string(r.Stdout) != "still\n" || r.ExitCode != 1 {
		t.Fatalf("after timeout: %+v", r)
	}
	out, err := c.session.GetSessionOutput(ctx, connect.NewRequest(&agentv1.GetSessionOutputRequest{SessionId: id}))
	if err != nil || !strings.Contains(string(out.Msg.Data), "$ echo still; false\nstill\n[exit 1]\n") {
		t.Fatalf("log = %q, %v", out.Msg.GetData(), err)
	}
	if r := runIn("echo bye; exit 5", 0); r.ExitCode != 5 || string(r.Stdout) != "bye\n" {
		t.Fatalf("exit: %+v", r)
	}
	_, err = c.session.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: id, Command: "true"}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("run after exit: %v", err)
	}
	if _, err := c.session.CloseSession(ctx, connect.NewRequest(&agentv1.CloseSessionRequest{SessionId: id})); err != nil {
		t.Fatal(err)
	}
	_, err = c.session.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: id, Command: "true"}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("run after close: %v", err)
	}
}

func TestHealth(t *testing.T) {
	c := startAgent(t)
	h, err := c.agent.Health(ctxT(t), connect.NewRequest(&agentv1.HealthRequest{}))
	if err != nil || h.Msg.Connects != 1 || h.Msg.Hostname == "" {
		t.Fatalf("health = %+v, %v", h, err)
	}
}

func TestWatchDirAndMetrics(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	dir := t.TempDir()
	stream, err := c.fs.WatchDir(ctx, connect.NewRequest(&agentv1.WatchDirRequest{Path: dir, Recursive: true}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() || !stream.Msg().Started {
		t.Fatalf("no start: %v", stream.Err())
	}
	os.Mkdir(filepath.Join(dir, "sub"), 0o755)
	// The agent watches a new directory before it reports it, so once its
	// event is here a file in it is seen too.
	if !stream.Receive() || stream.Msg().Event.Name != "sub" || stream.Msg().Event.Type != agentv1.FileEventType_FILE_EVENT_TYPE_CREATE {
		t.Fatalf("first event %v, %v; want sub created", stream.Msg(), stream.Err())
	}
	os.WriteFile(filepath.Join(dir, "sub", "f"), []byte("x"), 0o644)
	os.Remove(filepath.Join(dir, "sub", "f"))
	want := []string{"sub:FILE_EVENT_TYPE_CREATE", "sub/f:FILE_EVENT_TYPE_CREATE", "sub/f:FILE_EVENT_TYPE_WRITE", "sub/f:FILE_EVENT_TYPE_REMOVE"}
	got := []string{want[0]}
	for len(got) < 10 && stream.Receive() {
		ev := stream.Msg().Event
		s := ev.Name + ":" + ev.Type.String()
		if len(got) == 0 || got[len(got)-1] != s {
			got = append(got, s)
		}
		if s == want[len(want)-1] {
			break
		}
	}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("events %v, want %v", got, want)
	}
	m, err := c.agent.Metrics(ctx, connect.NewRequest(&agentv1.MetricsRequest{}))
	if err != nil || m.Msg.CpuCount == 0 || m.Msg.MemTotalBytes == 0 || m.Msg.DiskTotalBytes == 0 {
		t.Fatalf("metrics %+v, %v", m, err)
	}
}

// One write is one WRITE event, as with envd: an overwrite (truncate, then
// write) too, and closing the file adds none.
func TestWatchDirReportsAWriteOnce(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	dir := t.TempDir()
	stream, err := c.fs.WatchDir(ctx, connect.NewRequest(&agentv1.WatchDirRequest{Path: dir}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() || !stream.Msg().Started {
		t.Fatalf("no start: %v", stream.Err())
	}
	f := filepath.Join(dir, "f")
	events := func(last string) string {
		t.Helper()
		var got []string
		for stream.Receive() {
			ev := stream.Msg().Event
			got = append(got, ev.Name+":"+strings.TrimPrefix(ev.Type.String(), "FILE_EVENT_TYPE_"))
			if got[len(got)-1] == last {
				return strings.Join(got, " ")
			}
		}
		t.Fatalf("the watch ended after %v: %v", got, stream.Err())
		return ""
	}
	os.WriteFile(f, []byte("first"), 0o644) //nolint:errcheck // checked by its events
	if got, want := events("f:WRITE"), "f:CREATE f:WRITE"; got != want {
		t.Fatalf("a new file: %q, want %q", got, want)
	}
	os.WriteFile(f, []byte("second, longer"), 0o644)    //nolint:errcheck // an overwrite
	os.WriteFile(filepath.Join(dir, "end"), nil, 0o644) //nolint:errcheck // the last event
	if got, want := events("end:CREATE"), "f:WRITE end:CREATE"; got != want {
		t.Fatalf("an overwrite: %q, want %q (one WRITE)", got, want)
	}
}

// include_entry: each event carries the entry as it was when sent; a
// removal carries none.
func TestWatchDirIncludesEntries(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	dir := t.TempDir()
	stream, err := c.fs.WatchDir(ctx, connect.NewRequest(&agentv1.WatchDirRequest{Path: dir, IncludeEntry: true}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() || !stream.Msg().Started {
		t.Fatalf("no start: %v", stream.Err())
	}
	f := filepath.Join(dir, "f")
	if _, err := c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: f, Data: []byte("12345")})); err != nil {
		t.Fatal(err)
	}
	var write *agentv1.FileEvent
	for write == nil && stream.Receive() {
		if ev := stream.Msg().Event; ev.Type == agentv1.FileEventType_FILE_EVENT_TYPE_WRITE {
			write = ev
		}
	}
	if e := write.GetEntry(); e.GetPath() != f || e.GetSize() != 5 || e.GetType() != agentv1.FileType_FILE_TYPE_FILE {
		t.Fatalf("the write's entry: %v", write)
	}
	os.Remove(f) //nolint:errcheck // checked by its event
	for stream.Receive() {
		if ev := stream.Msg().Event; ev.Type == agentv1.FileEventType_FILE_EVENT_TYPE_REMOVE {
			if ev.Entry != nil {
				t.Fatalf("a removal with an entry: %v", ev)
			}
			return
		}
	}
	t.Fatalf("no removal: %v", stream.Err())
}

func TestWriteReplaceKeepsModeAndLeavesNoTemporaryFile(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, []byte("old content"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A reader holding the old file keeps the old bytes: it was replaced,
	// not overwritten in place.
	held, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if _, err := c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: p, Data: []byte("new"), Mode: agentv1.WriteMode_WRITE_MODE_REPLACE})); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(p); string(got) != "new" {
		t.Fatalf("replaced file holds %q", got)
	}
	if old, _ := io.ReadAll(held); string(old) != "old content" {
		t.Fatalf("the old file changed under its reader: %q", old)
	}
	if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want the old 0600", fi.Mode())
	}
	// A new file gets the requested mode.
	q := filepath.Join(dir, "g")
	if _, err := c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: q, Data: []byte("x"), Mode: agentv1.WriteMode_WRITE_MODE_REPLACE, Perm: 0o640})); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(q); fi.Mode().Perm() != 0o640 {
		t.Fatalf("new file mode %v, want 0640", fi.Mode())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 2 {
		t.Fatalf("left behind: %v", ents)
	}
	_, err = c.fs.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: dir, Data: []byte("x"), Mode: agentv1.WriteMode_WRITE_MODE_REPLACE}))
	if err == nil || connect.CodeOf(err) == connect.CodeInternal {
		t.Fatalf("replacing a directory: %v", err)
	}
}

// A session command's output is capped per stream (the rest counted, not
// kept), the session's log keeps only its newest 4 MiB, and the session
// goes on working after both.
func TestSessionOutputIsCapped(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	cs, err := c.session.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	id := cs.Msg.Session.Id
	r, err := c.session.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{
		SessionId: id, Command: "head -c 3000000 /dev/zero | tr '\\0' x; head -c 5000 /dev/zero | tr '\\0' e >&2", MaxOutputBytes: 1000,
	}))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Msg.Stdout) != 1000 || r.Msg.StdoutDropped != 3000000-1000 || len(r.Msg.Stderr) != 1000 || r.Msg.StderrDropped != 4000 {
		t.Fatalf("kept %d+%d bytes, dropped %d+%d", len(r.Msg.Stdout), len(r.Msg.Stderr), r.Msg.StdoutDropped, r.Msg.StderrDropped)
	}
	// 6 MB more through the log: it keeps the newest LogCap bytes.
	if _, err := c.session.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: id, Command: "head -c 6000000 /dev/zero | tr '\\0' y; echo; echo last-line"})); err != nil {
		t.Fatal(err)
	}
	var total int64
	first := int64(-1)
	var tail []byte
	for off := int64(0); ; {
		out, err := c.session.GetSessionOutput(ctx, connect.NewRequest(&agentv1.GetSessionOutputRequest{SessionId: id, Offset: off}))
		if err != nil {
			t.Fatal(err)
		}
		if first < 0 {
			first = out.Msg.FirstOffset
		}
		total += int64(len(out.Msg.Data))
		tail = append(tail, out.Msg.Data...)
		if len(tail) > 64 {
			tail = tail[len(tail)-64:]
		}
		if out.Msg.NextOffset == off || len(out.Msg.Data) == 0 {
			break
		}
		off = out.Msg.NextOffset
	}
	if total > chronus.LogCap || total < chronus.LogCap-1<<20 || first < 9000000-chronus.LogCap {
		t.Fatalf("log holds %d bytes from offset %d; want about the newest %d", total, first, chronus.LogCap)
	}
	if !strings.Contains(string(tail), "last-line") {
		t.Fatalf("the log lost its newest output: ...%q", tail)
	}
	if r, err := c.session.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: id, Command: "echo alive"})); err != nil || string(r.Msg.Stdout) != "alive\n" {
		t.Fatalf("session after the caps: %v %v", r, err)
	}
}

// SetIdentity refuses what cannot be a hostname or a machine id, whether or
// not this agent applies identities (here it does not: it runs on the host).
func TestSetIdentityValidates(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	bad := map[string]*agentv1.SetIdentityRequest{
		"hostname with a slash":    {Hostname: "a/b"},
		"hostname with a space":    {Hostname: "a b"},
		"hostname of 65 bytes":     {Hostname: strings.Repeat("h", 65)},
		"short machine id":         {MachineId: "abc"},
		"machine id in upper case": {MachineId: strings.Repeat("A", 32)},
		"machine id not hex":       {MachineId: strings.Repeat("g", 32)},
	}
	for name, req := range bad {
		if _, err := c.agent.SetIdentity(ctx, connect.NewRequest(req)); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("%s: %v, want invalid_argument", name, err)
		}
	}
	ok := &agentv1.SetIdentityRequest{Hostname: "sbx-1", MachineId: strings.Repeat("0a", 16), Entropy: make([]byte, 64)}
	if _, err := c.agent.SetIdentity(ctx, connect.NewRequest(ok)); err != nil {
		t.Fatalf("a valid identity: %v", err)
	}
	if h, _ := os.Hostname(); h == "sbx-1" {
		t.Fatal("an agent that does not apply identities changed the host's name")
	}
}

// A template copy's settings replace the environment, directory and
// default user processes start with; bad settings are refused whole.
func TestSetIdentitySettingsReplaceTheTemplates(t *testing.T) {
	c := startAgent(t)
	ctx := ctxT(t)
	bad := map[string]*agentv1.SandboxSettings{
		"env without =":         {Env: []string{"NOEQUALS"}},
		"env with an empty key": {Env: []string{"=v"}},
		"env with a NUL":        {Env: []string{"A=b\x00c"}},
		"relative work_dir":     {WorkDir: "tmp"},
		"hosts too large":       {Hosts: strings.Repeat("h", maxSettingsFile+1)},
	}
	for name, st := range bad {
		if _, err := c.agent.SetIdentity(ctx, connect.NewRequest(&agentv1.SetIdentityRequest{Settings: st})); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("%s: %v, want invalid_argument", name, err)
		}
	}
	// Refused settings changed nothing.
	out := run(t, c, &agentv1.ProcessConfig{Args: []string{"sh", "-c", "echo $DSEC_TEST"}}, 0)
	if string(out.Stdout) != "1\n" {
		t.Fatalf("after refused settings the environment is %q", out.Stdout)
	}
	dir, err := os.MkdirTemp("", "workdir") // nobody may enter it
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755) //nolint:errcheck // the run says it
	st := &agentv1.SandboxSettings{Env: []string{"PATH=" + os.Getenv("PATH"), "MINE=yes", "DSEC_IMAGE_USER=nobody"}, WorkDir: dir}
	if _, err := c.agent.SetIdentity(ctx, connect.NewRequest(&agentv1.SetIdentityRequest{Settings: st})); err != nil {
		t.Fatal(err)
	}
	out = run(t, c, &agentv1.ProcessConfig{Args: []string{"sh", "-c", `echo "$MINE/$DSEC_TEST/$DSEC_IMAGE_USER/$(pwd)/$(id -un)"`}}, 0)
	if want := "yes///" + dir + "/nobody\n"; string(out.Stdout) != want {
		t.Fatalf("a process after the settings sees %q, want %q", out.Stdout, want)
	}
}
