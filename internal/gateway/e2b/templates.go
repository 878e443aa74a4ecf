package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// E2B's template builds (docs/e2b-templates.md): a template is an image of
// the caller's project named "e2b-ALIAS:TAG"; a build runs its steps with
// internal/build (templatebuild.go); builds and their logs live in the
// gateway's memory, uploaded files on its disk.

// templateImage names the image of a template's tag.
func templateImage(project, alias, tag string) string {
	return project + "/e2b-" + alias + ":" + tag
}

// defaultTag is the tag a template name without one means.
const defaultTag = "default"

var aliasRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,62}$`)

// parseTemplateName splits E2B's "[namespace/]alias[:tag]". The namespace
// (E2B's team) is the caller's project here and is not checked.
func parseTemplateName(name string) (alias, tag string, err error) {
	if i := strings.LastIndexByte(name, '/'); i >= 0 {
		name = name[i+1:]
	}
	alias, tag, hasTag := strings.Cut(name, ":")
	if !aliasRE.MatchString(alias) {
		return "", "", errdefs.InvalidArgument("name %q: the alias must be 1 to 63 of a-z, 0-9, '_' and '-', starting with a letter or digit", errdefs.Clip(name, 80))
	}
	if hasTag {
		if err := checkTag(tag); err != nil {
			return "", "", err
		}
	}
	return alias, tag, nil
}

var tagRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)

func checkTag(tag string) error {
	if !tagRE.MatchString(tag) {
		return errdefs.InvalidArgument("tag %q: want 1 to 128 of letters, digits, '_', '.' and '-', not starting with '.' or '-'", errdefs.Clip(tag, 80))
	}
	return nil
}

// whoAmI returns the project of the caller's key, asking IAM at most every
// half minute per key.
func (g *Gateway) whoAmI(ctx context.Context) (string, error) {
	c, _ := ctx.Value(callerKey{}).(caller)
	sum := sha256.Sum256([]byte(c.apiKey))
	k := hex.EncodeToString(sum[:])
	g.mu.Lock()
	if w, ok := g.projects[k]; ok && time.Now().Before(w.until) {
		g.mu.Unlock()
		return w.project, nil
	}
	g.mu.Unlock()
	resp, err := g.iam.WhoAmI(ctx, connect.NewRequest(&iamv1.WhoAmIRequest{}))
	if err != nil {
		return "", errdefs.FromConnect(err)
	}
	p := resp.Msg.GetKey().GetProject()
	g.mu.Lock()
	if len(g.projects) > 10000 {
		clear(g.projects)
	}
	g.projects[k] = knownProject{project: p, until: time.Now().Add(30 * time.Second)}
	g.mu.Unlock()
	return p, nil
}

type knownProject struct {
	project string
	until   time.Time
}

// templateFor resolves a template name of the caller's project to its
// image, or "" if the project has no such template.
func (g *Gateway) templateFor(ctx context.Context, name string) (string, error) {
	if name == "base" || name == codeInterpreterTemplate {
		return "", nil
	}
	alias, tag, err := parseTemplateName(name)
	if err != nil {
		return "", nil // not a template name; other names are tried
	}
	project, err := g.whoAmI(ctx)
	if err != nil {
		return "", err
	}
	im := templateImage(project, alias, cmpOr(tag, defaultTag))
	_, err = g.images.GetImage(ctx, connect.NewRequest(&imagev1.GetImageRequest{Name: im}))
	switch {
	case err == nil:
		return im, nil
	case errdefs.IsNotFound(errdefs.FromConnect(err)):
		return "", nil
	default:
		return "", errdefs.FromConnect(err)
	}
}

// requestJSON is TemplateBuildRequestV3 (and V2's alias).
type requestJSON struct {
	Name     string   `json:"name"`
	Alias    string   `json:"alias"`
	Tags     []string `json:"tags"`
	CPUCount *int     `json:"cpuCount"`
	MemoryMB *int     `json:"memoryMB"`
}

type requestedJSON struct {
	TemplateID string   `json:"templateID"`
	BuildID    string   `json:"buildID"`
	Public     bool     `json:"public"`
	Names      []string `json:"names"`
	Tags       []string `json:"tags"`
	Aliases    []string `json:"aliases"`
}

// requestBuild registers a build, waiting for its steps.
func (g *Gateway) requestBuild(w http.ResponseWriter, r *http.Request) {
	var req requestJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	name := cmpOr(req.Name, req.Alias)
	if name == "" || len(name) > 128 {
		writeStatus(w, http.StatusBadRequest, "name: required, at most 128 characters ([namespace/]alias[:tag])")
		return
	}
	alias, tag, err := parseTemplateName(name)
	if err != nil {
		writeError(w, err)
		return
	}
	if alias == "base" || alias == codeInterpreterTemplate {
		writeStatus(w, http.StatusBadRequest, "name "+strconv.Quote(alias)+": the gateway's own template; choose another name")
		return
	}
	var tags []string
	seen := map[string]bool{}
	for _, t := range append([]string{tag}, req.Tags...) {
		if t == "" || seen[t] {
			continue
		}
		if err := checkTag(t); err != nil {
			writeError(w, err)
			return
		}
		seen[t] = true
		tags = append(tags, t)
	}
	if len(tags) == 0 {
		tags = []string{defaultTag}
	}
	cpu, mem := 2, 1024
	if req.CPUCount != nil {
		cpu = *req.CPUCount
	}
	if req.MemoryMB != nil {
		mem = *req.MemoryMB
	}
	if cpu < 1 || cpu > 64 || mem < 128 || mem > 1<<20 {
		writeStatus(w, http.StatusBadRequest, "cpuCount must be 1 to 64 and memoryMB 128 to 1048576")
		return
	}
	project, err := g.whoAmI(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	go g.sweepUploads()
	b := g.builds.add(project, alias, tags, cpu, mem)
	writeJSON(w, http.StatusAccepted, requestedJSON{TemplateID: alias, BuildID: b.id, Names: []string{alias}, Aliases: []string{alias}, Tags: tags})
}

// uploadTTL is how long uploaded files are kept after their last use,
// for later builds that copy the same files.
const uploadTTL = 24 * time.Hour

// sweepUploads removes uploads unused for uploadTTL and what broken
// uploads left, at most every 10 minutes.
func (g *Gateway) sweepUploads() {
	g.mu.Lock()
	if time.Since(g.swept) < 10*time.Minute {
		g.mu.Unlock()
		return
	}
	g.swept = time.Now()
	g.mu.Unlock()
	filepath.WalkDir(g.cfg.TemplateDir, func(p string, d fs.DirEntry, err error) error { //nolint:errcheck // best effort; the next sweep tries again
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		age := time.Since(fi.ModTime())
		if age > uploadTTL || strings.HasPrefix(d.Name(), ".upload-") && age > time.Hour {
			os.Remove(p)
		}
		return nil
	})
}

// uploadFile is where a COPY step's files of a hash are kept.
func (g *Gateway) uploadFile(project, templateID, hash string) string {
	return filepath.Join(g.cfg.TemplateDir, project, templateID, hash+".tar")
}

type fileLinkJSON struct {
	Present bool   `json:"present"`
	URL     string `json:"url"`
}

// fileLink says whether a COPY step's files are here, with a URL to
// upload them to (always: the SDK re-uploads with forceUpload).
func (g *Gateway) fileLink(w http.ResponseWriter, r *http.Request) {
	tid, hash := r.PathValue("templateID"), r.PathValue("hash")
	if !hashRE.MatchString(hash) {
		writeStatus(w, http.StatusBadRequest, "hash: want 64 lowercase hex digits (the SHA-256 of the files)")
		return
	}
	project, err := g.whoAmI(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	if !g.builds.knows(project, tid) {
		writeStatus(w, http.StatusNotFound, "template "+strconv.Quote(tid)+" not found: request a build first")
		return
	}
	// Its time of last use, from which the sweep counts.
	now := time.Now()
	present := os.Chtimes(g.uploadFile(project, tid, hash), now, now) == nil
	expires := strconv.FormatInt(time.Now().Add(30*time.Minute).Unix(), 10)
	q := url.Values{"project": {project}, "expires": {expires}, "signature": {g.uploadSignature(project, tid, hash, expires)}}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	u := scheme + "://" + r.Host + "/e2b-uploads/" + url.PathEscape(tid) + "/" + hash + "?" + q.Encode()
	writeJSON(w, http.StatusCreated, fileLinkJSON{Present: present, URL: u})
}

func (g *Gateway) uploadSignature(project, templateID, hash, expires string) string {
	m := hmac.New(sha256.New, g.cfg.TokenSecret)
	fmt.Fprintf(m, "e2b-upload\x00%s\x00%s\x00%s\x00%s", project, templateID, hash, expires)
	return hex.EncodeToString(m.Sum(nil))
}

// uploadTemplateFiles takes a COPY step's files (a tar, gzipped or not) at a URL that
// fileLink signed; it carries no API key.
func (g *Gateway) uploadTemplateFiles(w http.ResponseWriter, r *http.Request) {
	tid, hash := r.PathValue("templateID"), r.PathValue("hash")
	q := r.URL.Query()
	project, expires := q.Get("project"), q.Get("expires")
	want := g.uploadSignature(project, tid, hash, expires)
	if subtle.ConstantTimeCompare([]byte(want), []byte(q.Get("signature"))) != 1 {
		writeStatus(w, http.StatusUnauthorized, "signature: not valid for this upload")
		return
	}
	if at, err := strconv.ParseInt(expires, 10, 64); err != nil || time.Now().Unix() > at {
		writeStatus(w, http.StatusUnauthorized, "the upload URL has expired; ask for a new one")
		return
	}
	// Signed names were checked when signed; checked again before they
	// become paths.
	if !hashRE.MatchString(hash) || !aliasRE.MatchString(tid) || strings.Contains(project, "..") {
		writeStatus(w, http.StatusBadRequest, "bad upload path")
		return
	}
	dst := g.uploadFile(project, tid, hash)
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		writeError(w, err)
		return
	}
	f, err := os.CreateTemp(filepath.Dir(dst), ".upload-*")
	if err != nil {
		writeError(w, err)
		return
	}
	defer os.Remove(f.Name())
	n, err := io.Copy(f, io.LimitReader(r.Body, g.cfg.MaxUpload+1))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil:
		writeStatus(w, http.StatusBadRequest, "upload: "+err.Error())
		return
	case n > g.cfg.MaxUpload:
		writeStatus(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("upload: larger than %d bytes", g.cfg.MaxUpload))
		return
	case r.ContentLength >= 0 && n != r.ContentLength:
		writeStatus(w, http.StatusBadRequest, fmt.Sprintf("upload: %d bytes of %d arrived", n, r.ContentLength))
		return
	}
	// Two uploads of one hash carry the same files: the last rename wins.
	if err := os.Rename(f.Name(), dst); err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Length", "0")
	w.WriteHeader(http.StatusOK)
}

// archiveOf is the uploaded file of a hash, or why there is none.
func (g *Gateway) archiveOf(project, templateID string) func(string) (string, error) {
	return func(hash string) (string, error) {
		p := g.uploadFile(project, templateID, hash)
		now := time.Now()
		if err := os.Chtimes(p, now, now); errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("the files of hash %s were not uploaded (GET /templates/%s/files/%s gives the URL)", hash, templateID, hash)
		} else if err != nil {
			return "", err
		}
		return p, nil
	}
}

type aliasJSON struct {
	TemplateID string `json:"templateID"`
	Public     bool   `json:"public"`
}

// aliasExists answers Template.exists: a template of the caller's project,
// or one of the gateway's own ("base", the Code Interpreter's).
func (g *Gateway) aliasExists(w http.ResponseWriter, r *http.Request, alias string) {
	if alias == "base" || alias == codeInterpreterTemplate {
		writeJSON(w, http.StatusOK, aliasJSON{TemplateID: alias, Public: true})
		return
	}
	if !aliasRE.MatchString(alias) {
		writeStatus(w, http.StatusNotFound, "template "+strconv.Quote(alias)+" not found")
		return
	}
	project, err := g.whoAmI(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	resp, err := g.images.ListImages(r.Context(), connect.NewRequest(&imagev1.ListImagesRequest{Project: project}))
	if err != nil {
		writeError(w, errdefs.FromConnect(err))
		return
	}
	prefix := templateImage(project, alias, "")
	for _, im := range resp.Msg.Images {
		if strings.HasPrefix(im.Name, prefix) {
			writeJSON(w, http.StatusOK, aliasJSON{TemplateID: alias})
			return
		}
	}
	writeStatus(w, http.StatusNotFound, "template "+strconv.Quote(alias)+" not found")
}

// userOf is the USER of a stored image ("" for root or none).
func (g *Gateway) userOf(ctx context.Context, name string) (string, error) {
	resp, err := g.images.GetImage(ctx, connect.NewRequest(&imagev1.GetImageRequest{Name: name}))
	if err != nil {
		return "", errdefs.FromConnect(err)
	}
	return resp.Msg.GetImage().GetConfig().GetUser(), nil
}

// baseOf resolves a build's base: E2B's base image and "base" are the
// gateway's base image, a template is ours, anything else an image name
// of the store or a registry reference.
func (g *Gateway) baseOf(ctx context.Context, req *buildStartJSON) (base string, fromTemplate bool, err error) {
	switch {
	case req.FromTemplate != "" && req.FromImage != "":
		return "", false, errdefs.InvalidArgument("fromImage and fromTemplate: give one")
	case req.FromTemplate == "base":
		return g.cfg.BaseImage, false, nil
	case req.FromTemplate == codeInterpreterTemplate:
		return g.cfg.CodeInterpreterImage, true, nil
	case req.FromTemplate != "":
		im, err := g.templateFor(ctx, req.FromTemplate)
		if err != nil {
			return "", false, err
		}
		if im == "" {
			return "", false, errdefs.InvalidArgument("fromTemplate %q: no such template in your project", errdefs.Clip(req.FromTemplate, 80))
		}
		return im, true, nil
	case req.FromImage == "":
		return "", false, errdefs.InvalidArgument("fromImage or fromTemplate: one is required")
	}
	if ref, _, _ := strings.Cut(req.FromImage, ":"); ref == e2bBaseImage {
		return g.cfg.BaseImage, false, nil
	}
	// An image of the store, or else a registry reference to pull
	// (internal/build's FROM tells them apart).
	return req.FromImage, false, nil
}
