package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// maxBody bounds a control-plane request body.
const maxBody = 1 << 20

func (g *Gateway) controlMux() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"message": "Health check successful"})
	})
	auth := g.authenticated
	mux.HandleFunc("POST /sandboxes", auth(g.create))
	mux.HandleFunc("POST /v2/sandboxes", auth(g.create))
	mux.HandleFunc("GET /sandboxes", auth(g.listV1))
	mux.HandleFunc("GET /v2/sandboxes", auth(g.listV2))
	mux.HandleFunc("GET /sandboxes/metrics", auth(g.metricsMany))
	mux.HandleFunc("GET /sandboxes/{id}", auth(g.get))
	mux.HandleFunc("DELETE /sandboxes/{id}", auth(g.kill))
	mux.HandleFunc("POST /sandboxes/{id}/timeout", auth(g.setTimeout))
	mux.HandleFunc("POST /sandboxes/{id}/refreshes", auth(g.refresh))
	mux.HandleFunc("POST /sandboxes/{id}/pause", auth(g.pause))
	mux.HandleFunc("POST /sandboxes/{id}/resume", auth(g.resume))
	mux.HandleFunc("POST /sandboxes/{id}/connect", auth(g.connect))
	mux.HandleFunc("POST /v2/sandboxes/{id}/connect", auth(g.connect))
	mux.HandleFunc("POST /sandboxes/{id}/fork", auth(g.fork))
	mux.HandleFunc("POST /sandboxes/{id}/snapshots", auth(g.snapshot))
	mux.HandleFunc("GET /snapshots", auth(g.listSnapshots))
	mux.HandleFunc("DELETE /templates/{id}", auth(g.deleteTemplate))
	mux.HandleFunc("GET /sandboxes/{id}/metrics", auth(g.metrics))
	mux.HandleFunc("PUT /sandboxes/{id}/network", auth(g.updateNetwork))
	mux.HandleFunc("GET /sandboxes/{id}/logs", notSupported("sandbox logs"))
	mux.HandleFunc("GET /v2/sandboxes/{id}/logs", notSupported("sandbox logs"))
	mux.HandleFunc("POST /v3/templates", auth(g.requestBuild))
	mux.HandleFunc("GET /templates/{templateID}/files/{hash}", auth(g.fileLink))
	mux.HandleFunc("PUT /e2b-uploads/{templateID}/{hash}", g.uploadTemplateFiles)
	mux.HandleFunc("POST /v2/templates/{templateID}/builds/{buildID}", auth(g.triggerBuild))
	mux.HandleFunc("GET /templates/{templateID}/builds/{buildID}/status", auth(g.buildStatus))
	// GET /templates/aliases/{alias} and GET /templates/{templateID}/tags
	// overlap in ServeMux's eyes ("/templates/aliases/tags").
	mux.HandleFunc("GET /templates/{first}/{second}", auth(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.PathValue("first") == "aliases":
			g.aliasExists(w, r, r.PathValue("second"))
		case r.PathValue("second") == "tags":
			g.listTags(w, r, r.PathValue("first"))
		default:
			writeStatus(w, http.StatusNotFound, r.Method+" "+r.URL.Path+": no such API route")
		}
	}))
	mux.HandleFunc("POST /templates/tags", auth(g.assignTags))
	mux.HandleFunc("DELETE /templates/tags", auth(g.removeTags))
	for _, p := range []string{"/templates", "/templates/", "/v2/templates", "/v2/templates/", "/v3/templates/"} {
		mux.HandleFunc(p, notSupported("this template call (template builds through POST /v3/templates are)"))
	}
	mux.HandleFunc("/volumes", notSupported("volumes"))
	mux.HandleFunc("/volumes/", notSupported("volumes"))
	mux.HandleFunc("/secrets", notSupported("secrets"))
	mux.HandleFunc("/secrets/", notSupported("secrets"))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeStatus(w, http.StatusNotFound, r.Method+" "+r.URL.Path+": no such API route")
	})
	return mux
}

// authenticated requires an API key and puts it in the request's context.
func (g *Gateway) authenticated(h func(http.ResponseWriter, *http.Request)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("X-API-Key")
		if key == "" {
			if v, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
				key = strings.TrimSpace(v)
			}
		}
		if key == "" {
			writeStatus(w, http.StatusUnauthorized, "missing API key: set E2B_API_KEY")
			return
		}
		// An id that cannot be one of ours names no sandbox: E2B answers
		// 404 (Sandbox.kill() then returns false), not 400.
		if id := r.PathValue("id"); strings.Contains(r.Pattern, "/sandboxes/{id}") {
			if _, _, err := sandboxid.Parse(id); err != nil {
				writeStatus(w, http.StatusNotFound, "sandbox "+strconv.Quote(id)+" not found")
				return
			}
		}
		h(w, r.WithContext(asUser(r.Context(), key)))
	}
}

// decode reads an optional JSON body into v.
func decode(r *http.Request, v any) error {
	data, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		return errdefs.InvalidArgument("request body: %v", err)
	}
	if len(data) > maxBody {
		return errdefs.InvalidArgument("request body: larger than %d bytes", maxBody)
	}
	if len(strings.TrimSpace(string(data))) == 0 {
		return nil
	}
	if err := json.Unmarshal(data, v); err != nil {
		return errdefs.InvalidArgument("request body: not the expected JSON: %v", err)
	}
	return nil
}

func (g *Gateway) getSandbox(ctx context.Context, id string) (*sandboxv1.Sandbox, error) {
	resp, err := g.sandbox.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: id}))
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	return resp.Msg.Sandbox, nil
}

func (g *Gateway) create(w http.ResponseWriter, r *http.Request) {
	var req newSandboxJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	onTimeout := sandboxv1.OnTimeout_ON_TIMEOUT_KILL
	var pauseDepth sandboxv1.PauseDepth // with its memory (offloaded where the backend can)
	if req.AutoPause != nil && *req.AutoPause {
		onTimeout = sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE
		if req.AutoPauseMemory != nil && !*req.AutoPauseMemory {
			pauseDepth = sandboxv1.PauseDepth_PAUSE_DEPTH_FILESYSTEM // its resume is a fresh start
		}
	}
	// Auto-resume holds for any pause (the timeout's or an explicit one),
	// so it is taken with or without autoPause.
	resumes, err := req.AutoResume.resumesOnCall()
	if err != nil {
		writeError(w, err)
		return
	}
	explicit := !resumes
	switch {
	case req.IAM != nil:
		writeStatus(w, http.StatusBadRequest, "iam: workload identity tokens are not supported")
		return
	case req.MCP != nil && !isJSONObject(req.MCP):
		// The SDKs start the MCP gateway themselves, by running
		// mcp-gateway in the sandbox once it is made (and kill it when
		// that fails): the field only has to be well formed.
		writeStatus(w, http.StatusBadRequest, "mcp: an object of MCP server configurations is expected")
		return
	case len(req.VolumeMounts) > 0:
		writeStatus(w, http.StatusBadRequest, "volumeMounts: volumes are not supported")
		return
	}
	for k := range req.Metadata {
		if strings.HasPrefix(k, "e2b.") {
			writeStatus(w, http.StatusBadRequest, "metadata key "+strconv.Quote(k)+": the prefix \"e2b.\" is reserved")
			return
		}
	}
	netp, err := networkPolicy(req.AllowInternetAccess, req.Network)
	if err != nil {
		writeError(w, err)
		return
	}
	if netp == nil && req.TemplateID == codeInterpreterTemplate {
		// E2B's default: the internet allowed, ports public.
		netp = &sandboxv1.NetworkPolicy{Internet: true, AllowPublicTraffic: true}
	}
	timeout := int64(defaultTimeout)
	if req.Timeout != nil {
		timeout = *req.Timeout
	}
	md := map[string]string{templateKey: req.TemplateID}
	for k, v := range req.Metadata {
		md[k] = v
	}
	// A create retried with the same Idempotency-Key answers the sandbox
	// the first attempt made.
	if key := r.Header.Get("Idempotency-Key"); key != "" {
		if len(key) > 256 {
			writeStatus(w, http.StatusBadRequest, "Idempotency-Key: at most 256 characters")
			return
		}
		md[idempotencyKey] = key
		c, _ := r.Context().Value(callerKey{}).(caller)
		defer g.creating.lock(c.apiKey, key)()
		found, err := g.listAll(r.Context(), map[string]string{idempotencyKey: key}, nil)
		if err != nil {
			writeError(w, err)
			return
		}
		if len(found) > 0 {
			writeJSON(w, http.StatusCreated, g.toSandbox(found[0]))
			return
		}
	}
	var sb *sandboxv1.Sandbox
	snapID := ""
	if sandboxid.IsSnapshot(req.TemplateID) {
		snapID = req.TemplateID
	} else if req.TemplateID != "" {
		// A named snapshot is a template of that name.
		id, err := g.snapshotByName(r.Context(), req.TemplateID)
		if err != nil {
			writeError(w, err)
			return
		}
		snapID = id
	}
	if snapID != "" {
		resp, err := g.sandbox.RestoreSnapshot(r.Context(), connect.NewRequest(&sandboxv1.RestoreSnapshotRequest{SnapshotId: snapID, TimeoutSeconds: timeout, Metadata: md, OnTimeout: onTimeout, ExplicitResume: &explicit}))
		if err != nil {
			writeError(w, err)
			return
		}
		sb = resp.Msg.Sandbox
	} else {
		img, err := g.templateFor(r.Context(), req.TemplateID)
		if err == nil && img == "" {
			img, err = g.imageFor(req.TemplateID)
		}
		if err != nil {
			writeError(w, err)
			return
		}
		resp, err := g.sandbox.CreateSandbox(r.Context(), connect.NewRequest(&sandboxv1.CreateSandboxRequest{Spec: &sandboxv1.SandboxSpec{
			Backend: g.cfg.Backend, Image: img, TimeoutSeconds: timeout, Env: req.EnvVars, Metadata: md, Network: netp, OnTimeout: onTimeout, OnTimeoutDepth: pauseDepth,
			ExplicitResume: explicit,
		}}))
		if err != nil {
			writeError(w, err)
			return
		}
		sb = resp.Msg.Sandbox
	}
	writeJSON(w, http.StatusCreated, g.toSandbox(sb))
}

// metadataFilter parses E2B's metadata query ("k=v&k2=v2", URL-encoded).
func metadataFilter(q string) (map[string]string, error) {
	if q == "" {
		return nil, nil
	}
	vals, err := url.ParseQuery(q)
	if err != nil {
		return nil, errdefs.InvalidArgument("metadata: not a query string like \"user=abc&app=prod\": %v", err)
	}
	out := map[string]string{}
	for k, v := range vals {
		if len(v) > 0 {
			out[k] = v[0]
		}
	}
	return out, nil
}

// listAll gathers every sandbox of the caller's project that matches, up to
// maxListed, following our API's pages.
func (g *Gateway) listAll(ctx context.Context, md map[string]string, states []sandboxv1.SandboxState) ([]*sandboxv1.Sandbox, error) {
	var out []*sandboxv1.Sandbox
	token := ""
	for {
		resp, err := g.sandbox.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{
			Metadata: md, States: states, PageSize: 1000, PageToken: token,
		}))
		if err != nil {
			return nil, err
		}
		out = append(out, resp.Msg.Sandboxes...)
		if token = resp.Msg.NextPageToken; token == "" || len(out) >= maxListed {
			return out, nil
		}
	}
}

// maxListed bounds what one list call gathers.
const maxListed = 10000

func (g *Gateway) listV1(w http.ResponseWriter, r *http.Request) {
	md, err := metadataFilter(r.URL.Query().Get("metadata"))
	if err != nil {
		writeError(w, err)
		return
	}
	all, err := g.listAll(r.Context(), md, []sandboxv1.SandboxState{sandboxv1.SandboxState_SANDBOX_STATE_RUNNING})
	if err != nil {
		writeError(w, err)
		return
	}
	out := []detailJSON{}
	for _, sb := range all {
		out = append(out, g.toDetail(sb, false))
	}
	writeJSON(w, http.StatusOK, out)
}

// listV2 is E2B's paged list: filters by metadata, state, template and
// start time, ordered by start time (newest first unless order=asc) across
// the whole result, then cut into pages; nextToken is an offset into it.
func (g *Gateway) listV2(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	md, err := metadataFilter(q.Get("metadata"))
	if err != nil {
		writeError(w, err)
		return
	}
	if t := q.Get("template"); t != "" {
		if md == nil {
			md = map[string]string{}
		}
		md[templateKey] = t
	}
	limit := 100
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > 1000 {
			writeStatus(w, http.StatusBadRequest, "limit "+strconv.Quote(l)+": want 1 to 1000")
			return
		}
		limit = n
	}
	offset := 0
	if t := q.Get("nextToken"); t != "" {
		n, err := strconv.Atoi(strings.TrimPrefix(t, "o"))
		if !strings.HasPrefix(t, "o") || err != nil || n < 0 {
			writeStatus(w, http.StatusBadRequest, "nextToken "+strconv.Quote(t)+": not a token from a previous list")
			return
		}
		offset = n
	}
	var after time.Time
	if a := q.Get("startedAfter"); a != "" {
		if after, err = time.Parse(time.RFC3339Nano, a); err != nil {
			writeStatus(w, http.StatusBadRequest, "startedAfter "+strconv.Quote(a)+": want an RFC 3339 time")
			return
		}
	}
	var states []sandboxv1.SandboxState
	for _, st := range q["state"] {
		for _, s := range strings.Split(st, ",") {
			switch s {
			case "running":
				states = append(states, sandboxv1.SandboxState_SANDBOX_STATE_RUNNING)
			case "paused":
				states = append(states, sandboxv1.SandboxState_SANDBOX_STATE_PAUSED)
			case "":
			default:
				writeStatus(w, http.StatusBadRequest, "state "+strconv.Quote(s)+": want running or paused")
				return
			}
		}
	}
	if len(states) == 0 {
		states = []sandboxv1.SandboxState{sandboxv1.SandboxState_SANDBOX_STATE_RUNNING, sandboxv1.SandboxState_SANDBOX_STATE_PAUSED}
	}
	all, err := g.listAll(r.Context(), md, states)
	if err != nil {
		writeError(w, err)
		return
	}
	matched := all[:0]
	for _, sb := range all {
		if after.IsZero() || !sb.CreatedAt.AsTime().Before(after) {
			matched = append(matched, sb)
		}
	}
	asc := q.Get("order") == "asc"
	sort.SliceStable(matched, func(i, j int) bool {
		a, b := matched[i].CreatedAt.AsTime(), matched[j].CreatedAt.AsTime()
		if a.Equal(b) {
			return matched[i].Id < matched[j].Id
		}
		return a.Before(b) == asc
	})
	out := []detailJSON{}
	for i := offset; i < len(matched) && i < offset+limit; i++ {
		out = append(out, g.toDetail(matched[i], false))
	}
	if offset+limit < len(matched) {
		w.Header().Set("X-Next-Token", "o"+strconv.Itoa(offset+limit))
	}
	writeJSON(w, http.StatusOK, out)
}

func (g *Gateway) get(w http.ResponseWriter, r *http.Request) {
	sb, err := g.getSandbox(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, g.toDetail(sb, true))
}

func (g *Gateway) kill(w http.ResponseWriter, r *http.Request) {
	if _, err := g.sandbox.StopSandbox(r.Context(), connect.NewRequest(&sandboxv1.StopSandboxRequest{SandboxId: r.PathValue("id")})); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

type timeoutJSON struct {
	Timeout  *int64 `json:"timeout"`
	Duration *int64 `json:"duration"`
}

func (g *Gateway) setTimeout(w http.ResponseWriter, r *http.Request) {
	var req timeoutJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	if req.Timeout == nil {
		writeStatus(w, http.StatusBadRequest, "timeout: required, in seconds")
		return
	}
	if _, err := g.sandbox.SetSandboxTimeout(r.Context(), connect.NewRequest(&sandboxv1.SetSandboxTimeoutRequest{SandboxId: r.PathValue("id"), TimeoutSeconds: *req.Timeout})); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// extend sets the time to live to seconds from now unless the sandbox
// already lives longer.
func (g *Gateway) extend(ctx context.Context, sb *sandboxv1.Sandbox, seconds int64) error {
	if time.Now().Add(time.Duration(seconds) * time.Second).Before(sb.ExpiresAt.AsTime()) {
		return nil
	}
	_, err := g.sandbox.SetSandboxTimeout(ctx, connect.NewRequest(&sandboxv1.SetSandboxTimeoutRequest{SandboxId: sb.Id, TimeoutSeconds: seconds}))
	return err
}

func (g *Gateway) refresh(w http.ResponseWriter, r *http.Request) {
	var req timeoutJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	seconds := int64(60)
	if req.Duration != nil {
		seconds = *req.Duration
	}
	sb, err := g.getSandbox(r.Context(), r.PathValue("id"))
	if err == nil {
		err = g.extend(r.Context(), sb, seconds)
	}
	if err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// pause is E2B's pause: with its memory (the default, memory: true) the
// sandbox is offloaded where the backend can (its memory written to disk
// and given back; frozen elsewhere). A filesystem-only pause (memory:
// false) ends its processes first, so that its resume is a fresh start on
// its files, as E2B's cold boot is.
func (g *Gateway) pause(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Memory *bool `json:"memory"`
	}
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	sb, err := g.getSandbox(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, err)
		return
	}
	if sb.State == sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		writeStatus(w, http.StatusConflict, "sandbox "+sb.Id+" is already paused")
		return
	}
	depth := sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD
	if req.Memory != nil && !*req.Memory {
		depth = sandboxv1.PauseDepth_PAUSE_DEPTH_FILESYSTEM
	}
	if _, err := g.sandbox.PauseSandbox(r.Context(), connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: sb.Id, Depth: depth})); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (g *Gateway) resume(w http.ResponseWriter, r *http.Request) {
	var req timeoutJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	sb, err := g.getSandbox(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, err)
		return
	}
	if sb.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		writeStatus(w, http.StatusConflict, "sandbox "+sb.Id+" is not paused")
		return
	}
	g.resumeAndAnswer(w, r, sb, req.Timeout, http.StatusCreated)
}

// connect answers 200 for a running sandbox (its time to live only
// extended) and 201 for a paused one, which it resumes.
func (g *Gateway) connect(w http.ResponseWriter, r *http.Request) {
	var req timeoutJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	sb, err := g.getSandbox(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, err)
		return
	}
	if sb.State == sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		g.resumeAndAnswer(w, r, sb, req.Timeout, http.StatusCreated)
		return
	}
	if req.Timeout != nil {
		if err := g.extend(r.Context(), sb, *req.Timeout); err != nil {
			writeError(w, err)
			return
		}
	}
	writeJSON(w, http.StatusOK, g.toSandbox(sb))
}

func (g *Gateway) resumeAndAnswer(w http.ResponseWriter, r *http.Request, sb *sandboxv1.Sandbox, timeout *int64, status int) {
	resp, err := g.sandbox.ResumeSandbox(r.Context(), connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: sb.Id}))
	if err != nil {
		writeError(w, err)
		return
	}
	if timeout != nil {
		if err := g.extend(r.Context(), resp.Msg.Sandbox, *timeout); err != nil {
			writeError(w, err)
			return
		}
	}
	writeJSON(w, status, g.toSandbox(resp.Msg.Sandbox))
}

type forkJSON struct {
	Timeout *int64 `json:"timeout"`
	Count   *int32 `json:"count"`
}

type forkResultJSON struct {
	Sandbox *sandboxJSON `json:"sandbox,omitempty"`
	Error   *apiError    `json:"error,omitempty"`
}

func (g *Gateway) fork(w http.ResponseWriter, r *http.Request) {
	var req forkJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	count := int32(1)
	if req.Count != nil {
		count = *req.Count
	}
	if count < 1 || count > sandboxspec.MaxForkCount {
		writeStatus(w, http.StatusBadRequest, "count "+strconv.Itoa(int(count))+": want 1 to "+strconv.Itoa(sandboxspec.MaxForkCount))
		return
	}
	fr := &sandboxv1.ForkSandboxRequest{SandboxId: r.PathValue("id"), Count: count}
	if req.Timeout != nil {
		fr.TimeoutSeconds = *req.Timeout
	}
	resp, err := g.sandbox.ForkSandbox(r.Context(), connect.NewRequest(fr))
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]forkResultJSON, 0, len(resp.Msg.Results))
	for _, res := range resp.Msg.Results {
		if res.Sandbox != nil {
			s := g.toSandbox(res.Sandbox)
			out = append(out, forkResultJSON{Sandbox: &s})
			continue
		}
		code := statusOf(errdefs.ItemCode(res.ErrorCode))
		out = append(out, forkResultJSON{Error: &apiError{Code: code, Message: res.ErrorMessage}})
	}
	writeJSON(w, http.StatusCreated, out)
}

type snapshotJSON struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

func (g *Gateway) snapshot(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name *string `json:"name"`
		Mode *string `json:"mode"`
	}
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	if req.Mode != nil && *req.Mode != "full" {
		writeStatus(w, http.StatusBadRequest, "mode "+strconv.Quote(*req.Mode)+": only \"full\" snapshots (memory and filesystem) are supported")
		return
	}
	name := ""
	if req.Name != nil {
		name = *req.Name
	}
	resp, err := g.sandbox.SnapshotSandbox(r.Context(), connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: r.PathValue("id"), Name: name}))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, toSnapshotJSON(resp.Msg.Snapshot))
}

// toSnapshotJSON names a snapshot by its name when it has one, and by
// its id (both start sandboxes as a template id).
func toSnapshotJSON(s *sandboxv1.Snapshot) snapshotJSON {
	out := snapshotJSON{SnapshotID: s.Id, Names: []string{s.Id}}
	if s.Name != "" {
		out.Names = []string{s.Name, s.Id}
	}
	return out
}

// snapshotByName is the id of the caller's snapshot called name, or ""
// when it has none (the template id then names an image).
func (g *Gateway) snapshotByName(ctx context.Context, name string) (string, error) {
	resp, err := g.sandbox.ListSnapshots(ctx, connect.NewRequest(&sandboxv1.ListSnapshotsRequest{}))
	if err != nil {
		return "", err
	}
	base, _, _ := strings.Cut(name, ":") // E2B names carry a tag ("my-state:latest")
	for _, s := range resp.Msg.Snapshots {
		if s.Name != "" && (s.Name == name || s.Name == base) {
			return s.Id, nil
		}
	}
	return "", nil
}

func (g *Gateway) listSnapshots(w http.ResponseWriter, r *http.Request) {
	resp, err := g.sandbox.ListSnapshots(r.Context(), connect.NewRequest(&sandboxv1.ListSnapshotsRequest{SandboxId: r.URL.Query().Get("sandboxID")}))
	if err != nil {
		writeError(w, err)
		return
	}
	name := r.URL.Query().Get("name")
	out := []snapshotJSON{}
	for _, s := range resp.Msg.Snapshots {
		if name == "" || snapshotCalled(s, name) {
			out = append(out, toSnapshotJSON(s))
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// snapshotCalled reports whether s is what E2B's list filter name means:
// the snapshot of that name (with or without a tag: OpenDsec's snapshots
// have none) or that id. A name is matched whole, never as a prefix.
func snapshotCalled(s *sandboxv1.Snapshot, name string) bool {
	base, _, _ := strings.Cut(name, ":")
	return s.Id == name || (s.Name != "" && (s.Name == name || s.Name == base))
}

// deleteTemplate deletes snapshots (E2B's SDKs delete a snapshot as the
// template it is), and templates the project built, every tag
// (templatetags.go).
func (g *Gateway) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !sandboxid.IsSnapshot(id) {
		named, err := g.snapshotByName(r.Context(), id)
		if err != nil {
			writeError(w, err)
			return
		}
		if named == "" {
			g.deleteTemplateImages(w, r, id)
			return
		}
		id = named
	}
	if _, err := g.sandbox.DeleteSnapshot(r.Context(), connect.NewRequest(&sandboxv1.DeleteSnapshotRequest{SnapshotId: id})); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// metricsEvery is how often a node records a sandbox's use.
const metricsEvery = 5 * time.Second

type metricJSON struct {
	Timestamp     string  `json:"timestamp"`
	TimestampUnix int64   `json:"timestampUnix"`
	CPUCount      int     `json:"cpuCount"`
	CPUUsedPct    float64 `json:"cpuUsedPct"`
	MemUsed       int64   `json:"memUsed"`
	MemTotal      int64   `json:"memTotal"`
	MemCache      int64   `json:"memCache"`
	DiskUsed      int64   `json:"diskUsed"`
	DiskTotal     int64   `json:"diskTotal"`
}

// recorded answers the samples the sandbox's node recorded between start
// and end (zero: unbounded), after checking with the caller's own key that
// the caller may see the sandbox.
func (g *Gateway) recorded(ctx context.Context, id string, start, end time.Time) ([]metricJSON, error) {
	req := &sandboxv1.GetSandboxMetricsRequest{SandboxId: id}
	if !start.IsZero() {
		req.Start = timestamppb.New(start)
	}
	if !end.IsZero() {
		req.End = timestamppb.New(end)
	}
	resp, err := g.sandbox.GetSandboxMetrics(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	out := make([]metricJSON, 0, len(resp.Msg.Samples))
	for _, s := range resp.Msg.Samples {
		t := s.Time.AsTime().UTC()
		out = append(out, metricJSON{
			Timestamp: t.Format(time.RFC3339Nano), TimestampUnix: t.Unix(), CPUCount: int(s.CpuCount), CPUUsedPct: s.CpuUsedPct,
			MemUsed: s.MemUsedBytes, MemTotal: s.MemTotalBytes, MemCache: s.MemCacheBytes, DiskUsed: s.DiskUsedBytes, DiskTotal: s.DiskTotalBytes,
		})
	}
	return out, nil
}

// unixParam reads a query parameter of Unix seconds; absent is zero.
func unixParam(r *http.Request, name string) (time.Time, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return time.Time{}, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 || n > 1<<40 {
		return time.Time{}, errdefs.InvalidArgument("%s %q: Unix seconds expected", name, errdefs.Clip(v, 64))
	}
	return time.Unix(n, 0), nil
}

// metrics answers the samples in [start, end], as E2B does (none for a
// range before the sandbox existed).
func (g *Gateway) metrics(w http.ResponseWriter, r *http.Request) {
	start, err := unixParam(r, "start")
	if err == nil {
		var end time.Time
		if end, err = unixParam(r, "end"); err == nil {
			var out []metricJSON
			if out, err = g.recorded(r.Context(), r.PathValue("id"), start, end); err == nil {
				writeJSON(w, http.StatusOK, out)
				return
			}
		}
	}
	writeError(w, err)
}

func (g *Gateway) metricsMany(w http.ResponseWriter, r *http.Request) {
	ids := strings.Split(r.URL.Query().Get("sandbox_ids"), ",")
	if len(ids) == 0 || ids[0] == "" || len(ids) > 100 {
		writeStatus(w, http.StatusBadRequest, "sandbox_ids: 1 to 100 comma-separated ids")
		return
	}
	// Each sandbox's latest sample.
	out := map[string]metricJSON{}
	since := time.Now().Add(-2 * metricsEvery)
	for _, id := range ids {
		ms, err := g.recorded(r.Context(), id, since, time.Time{})
		if err != nil {
			if errors.Is(err, errdefs.ErrNotFound) {
				continue
			}
			writeError(w, err)
			return
		}
		if len(ms) > 0 {
			out[id] = ms[len(ms)-1]
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"sandboxes": out})
}

// isJSONObject reports whether v, decoded from JSON, was an object.
func isJSONObject(v any) bool {
	_, ok := v.(map[string]any)
	return ok
}
