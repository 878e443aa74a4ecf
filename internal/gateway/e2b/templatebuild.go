package e2b

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/build"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// Build states, as E2B names them.
const (
	buildWaiting  = "waiting"
	buildBuilding = "building"
	buildReady    = "ready"
	buildError    = "error"
)

// Bounds of what the gateway keeps of builds.
const (
	maxBuilds     = 1000    // the oldest finished ones are forgotten
	maxLogEntries = 20000   // per build; the rest is cut
	maxLogBytes   = 8 << 20 // likewise
	maxLogLine    = 4096
	// maxRunning bounds a project's builds running at once.
	maxRunning   = 4
	buildTimeout = time.Hour
)

// templateBuild is one build and its log.
type templateBuild struct {
	id, templateID, project string
	tags                    []string
	cpu, memoryMB           int
	created                 time.Time

	// Under templateBuilds.mu:
	status   string
	step     string // the E2B step running ("base", "1", …, "finalize")
	entries  []logEntryJSON
	logBytes int
	reason   *reasonJSON
}

type logEntryJSON struct {
	Timestamp string `json:"timestamp"`
	Level     string `json:"level"`
	Message   string `json:"message"`
	Step      string `json:"step,omitempty"`
}

type reasonJSON struct {
	Message string `json:"message"`
	Step    string `json:"step,omitempty"`
}

type buildStatusJSON struct {
	TemplateID string         `json:"templateID"`
	BuildID    string         `json:"buildID"`
	Status     string         `json:"status"`
	Logs       []string       `json:"logs"`
	LogEntries []logEntryJSON `json:"logEntries"`
	Reason     *reasonJSON    `json:"reason,omitempty"`
}

// templateBuilds are the builds the gateway knows.
type templateBuilds struct {
	mu     sync.Mutex
	byID   map[string]*templateBuild
	order  []string // oldest first
	cancel map[string]context.CancelFunc
}

func newTemplateBuilds() *templateBuilds {
	return &templateBuilds{byID: map[string]*templateBuild{}, cancel: map[string]context.CancelFunc{}}
}

func (s *templateBuilds) add(project, templateID string, tags []string, cpu, mem int) *templateBuild {
	var id [16]byte
	rand.Read(id[:]) //nolint:errcheck // never fails
	b := &templateBuild{id: hex.EncodeToString(id[:]), templateID: templateID, project: project, tags: tags, cpu: cpu, memoryMB: mem, created: time.Now(), status: buildWaiting}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.byID[b.id] = b
	s.order = append(s.order, b.id)
	for i := 0; len(s.byID) > maxBuilds && i < len(s.order); {
		old := s.byID[s.order[i]]
		if old != nil && old.status == buildBuilding {
			i++
			continue
		}
		delete(s.byID, s.order[i])
		s.order = append(s.order[:i], s.order[i+1:]...)
	}
	return b
}

// running counts the project's builds in progress; the caller holds mu.
func (s *templateBuilds) running(project string) int {
	n := 0
	for _, b := range s.byID {
		if b.project == project && b.status == buildBuilding {
			n++
		}
	}
	return n
}

// knows says whether the project has asked to build the template.
func (s *templateBuilds) knows(project, templateID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range s.byID {
		if b.project == project && b.templateID == templateID {
			return true
		}
	}
	return false
}

func (s *templateBuilds) get(project, templateID, id string) (*templateBuild, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.byID[id]
	if b == nil || b.project != project || b.templateID != templateID {
		return nil, errdefs.NotFound("build %q of template %q not found", errdefs.Clip(id, 40), errdefs.Clip(templateID, 64))
	}
	return b, nil
}

// log appends lines to a build's log, for its current step.
func (s *templateBuilds) log(b *templateBuild, level, text string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now().UTC().Format(time.RFC3339Nano)
	for _, line := range strings.Split(strings.TrimRight(text, "\n"), "\n") {
		if len(line) > maxLogLine {
			line = line[:maxLogLine] + "…"
		}
		switch {
		case len(b.entries) > maxLogEntries || b.logBytes > maxLogBytes:
			return
		case len(b.entries) == maxLogEntries || b.logBytes+len(line) > maxLogBytes:
			line, level = fmt.Sprintf("(the log is cut here: more than %d lines or %d MiB)", maxLogEntries, maxLogBytes>>20), "warn"
			b.logBytes = maxLogBytes + 1
		}
		b.logBytes += len(line)
		b.entries = append(b.entries, logEntryJSON{Timestamp: now, Level: level, Message: strings.ToValidUTF8(line, "?"), Step: b.step})
	}
}

// logWriter turns a build's output into log entries, a line each.
type logWriter struct {
	s   *templateBuilds
	b   *templateBuild
	buf bytes.Buffer
}

func (w *logWriter) Write(p []byte) (int, error) {
	w.buf.Write(p)
	for {
		i := bytes.IndexByte(w.buf.Bytes(), '\n')
		if i < 0 {
			if w.buf.Len() > maxLogLine {
				w.s.log(w.b, "info", w.buf.String())
				w.buf.Reset()
			}
			return len(p), nil
		}
		w.s.log(w.b, "info", string(w.buf.Next(i+1)))
	}
}

func (w *logWriter) flush() {
	if w.buf.Len() > 0 {
		w.s.log(w.b, "info", w.buf.String())
		w.buf.Reset()
	}
}

// callerBuild is the build the request's path names, of the caller's
// project.
func (g *Gateway) callerBuild(r *http.Request) (string, *templateBuild, error) {
	project, err := g.whoAmI(r.Context())
	if err != nil {
		return "", nil, err
	}
	b, err := g.builds.get(project, r.PathValue("templateID"), r.PathValue("buildID"))
	return project, b, err
}

// triggerBuild starts a build with its steps.
func (g *Gateway) triggerBuild(w http.ResponseWriter, r *http.Request) {
	project, b, err := g.callerBuild(r)
	if err != nil {
		writeError(w, err)
		return
	}
	var req buildStartJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	base, fromTemplate, err := g.baseOf(r.Context(), &req)
	if err != nil {
		writeError(w, err)
		return
	}
	var creds *imagev1.RegistryCredentials
	if rg := req.FromImageRegistry; rg != nil {
		if rg.Type != "registry" {
			writeStatus(w, http.StatusBadRequest, "fromImageRegistry: type "+strconv.Quote(rg.Type)+" is not supported; use \"registry\" (a user name and password)")
			return
		}
		creds = &imagev1.RegistryCredentials{Username: rg.Username, Password: rg.Password}
	}
	baseUser := ""
	if fromTemplate {
		// A template's steps go on as its user (its start command too).
		if baseUser, err = g.userOf(r.Context(), base); err != nil {
			writeError(w, err)
			return
		}
	}
	plan, err := planBuild(&req, base, fromTemplate, baseUser, g.archiveOf(project, b.templateID))
	if err != nil {
		writeError(w, err)
		return
	}
	force := req.Force
	for _, s := range req.Steps {
		force = force || s.Force
	}
	c, _ := r.Context().Value(callerKey{}).(caller)
	g.builds.mu.Lock()
	if b.status != buildWaiting {
		g.builds.mu.Unlock()
		writeStatus(w, http.StatusBadRequest, "build "+b.id+" is "+b.status+", not waiting: request a new build")
		return
	}
	if n := g.builds.running(project); n >= maxRunning {
		g.builds.mu.Unlock()
		writeError(w, errdefs.ResourceExhausted("your project has %d template builds running, the most at once; trigger this one when one ends", n))
		return
	}
	b.status, b.step = buildBuilding, "base"
	ctx, cancel := context.WithTimeout(asUser(g.ctx, c.apiKey), buildTimeout)
	g.builds.cancel[b.id] = cancel
	g.builds.mu.Unlock()
	go g.runBuild(ctx, b, plan, c.apiKey, creds, force)
	w.Header().Set("Content-Length", "0")
	w.WriteHeader(http.StatusAccepted)
}

// runBuild runs a build to its end, in the background.
func (g *Gateway) runBuild(ctx context.Context, b *templateBuild, plan []plannedStep, apiKey string, creds *imagev1.RegistryCredentials, force bool) {
	defer func() {
		g.builds.mu.Lock()
		g.builds.cancel[b.id]()
		delete(g.builds.cancel, b.id)
		g.builds.mu.Unlock()
	}()
	began := time.Now()
	lw := &logWriter{s: g.builds, b: b}
	err := g.build(ctx, b, plan, apiKey, creds, force, lw)
	lw.flush()
	g.builds.mu.Lock()
	defer g.builds.mu.Unlock()
	if err != nil {
		step := "base"
		var se *build.StepError
		if errors.As(err, &se) {
			step = "finalize" // after the last step: naming the result
			if se.Step < len(plan) {
				step = plan[se.Step].step
			}
		}
		b.status, b.reason = buildError, &reasonJSON{Message: buildMessage(err), Step: step}
		b.entries = append(b.entries, logEntryJSON{Timestamp: time.Now().UTC().Format(time.RFC3339Nano), Level: "error", Message: "Build failed: " + b.reason.Message, Step: step})
		g.log.Info("template build failed", "template", b.templateID, "build", b.id, "step", step, "error", err)
		return
	}
	b.status, b.step = buildReady, "finalize"
	b.entries = append(b.entries, logEntryJSON{Timestamp: time.Now().UTC().Format(time.RFC3339Nano), Level: "info", Message: fmt.Sprintf("Build finished in %s", time.Since(began).Round(time.Millisecond)), Step: "finalize"})
}

func (g *Gateway) build(ctx context.Context, b *templateBuild, plan []plannedStep, apiKey string, creds *imagev1.RegistryCredentials, force bool, lw *logWriter) error {
	c, err := client.NewWithTLS(g.cfg.APIURL, apiKey, g.cfg.apiTLS())
	if err != nil {
		return err
	}
	target := &build.ClientTarget{
		C: c, Backend: g.cfg.BuildBackend, Credentials: creds,
		Resources: &sandboxv1.Resources{CpuCores: float64(b.cpu), MemoryMb: int64(b.memoryMB)},
		// E2B's build steps reach the internet (apt, pip, npm, git).
		Network: &sandboxv1.NetworkPolicy{Internet: true},
	}
	ins := make([]build.Instruction, len(plan))
	for i, p := range plan {
		ins[i] = p.in
	}
	names := make([]string, len(b.tags))
	for i, t := range b.tags {
		names[i] = templateImage(b.project, b.templateID, t)
	}
	res, err := build.Build(ctx, target, ins, build.Options{
		Tag: names[0], CacheProject: b.project, NoCache: force, Log: lw,
		Step: func(i int) {
			lw.flush()
			g.builds.mu.Lock()
			b.step = plan[i].step
			g.builds.mu.Unlock()
		},
	})
	if err != nil {
		return err
	}
	g.builds.mu.Lock()
	b.step = "finalize"
	g.builds.mu.Unlock()
	for _, n := range names[1:] {
		if _, err := target.Tag(ctx, res.Image.Name, n); err != nil {
			return &build.StepError{Step: len(plan), Err: fmt.Errorf("tag %s: %w", n, err)}
		}
	}
	g.builds.log(b, "info", fmt.Sprintf("Template %s built: %s (%d steps, %d from the cache)", b.templateID, strings.Join(b.tags, ", "), res.Steps, res.Cached))
	return nil
}

var linePrefixRE = regexp.MustCompile(`^(Dockerfile:\d+: |step \d+: )`)

// buildMessage is a build error as E2B's SDKs show it: without the line
// numbers of our own instructions.
func buildMessage(err error) string {
	return linePrefixRE.ReplaceAllString(err.Error(), "")
}

// buildStatus answers a build's state and its log from logsOffset, at
// most limit (≤100) entries a call.
func (g *Gateway) buildStatus(w http.ResponseWriter, r *http.Request) {
	offset, limit := 0, 100
	q := r.URL.Query()
	if v := q.Get("logsOffset"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			writeStatus(w, http.StatusBadRequest, "logsOffset: want an integer ≥ 0")
			return
		}
		offset = n
	}
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > 100 {
			writeStatus(w, http.StatusBadRequest, "limit: want an integer from 0 to 100")
			return
		}
		limit = n
	}
	_, b, err := g.callerBuild(r)
	if err != nil {
		writeError(w, err)
		return
	}
	g.builds.mu.Lock()
	out := buildStatusJSON{TemplateID: b.templateID, BuildID: b.id, Status: b.status, Logs: []string{}, LogEntries: []logEntryJSON{}, Reason: b.reason}
	if offset < len(b.entries) {
		out.LogEntries = append(out.LogEntries, b.entries[offset:min(len(b.entries), offset+limit)]...)
	}
	g.builds.mu.Unlock()
	writeJSON(w, http.StatusOK, out)
}
