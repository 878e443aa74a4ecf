package e2b

import (
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// E2B's template tags (Template.assignTags, removeTags, getTags): each tag
// of a template is a name of its image, PROJECT/e2b-ALIAS:TAG.

// buildIDOf is the build id E2B's SDKs read (a UUID) for a tag: the
// image's digest, as a UUID, so that two tags of one build answer the
// same id.
func buildIDOf(digest string) string {
	h, _ := strings.CutPrefix(digest, "sha256:")
	if len(h) < 32 {
		h += strings.Repeat("0", 32-len(h))
	}
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

type assignTagsJSON struct {
	Target string   `json:"target"`
	Tags   []string `json:"tags"`
}

type assignedTagsJSON struct {
	Tags    []string `json:"tags"`
	BuildID string   `json:"buildID"`
}

// assignTags names a template's build (target "alias:tag") with more tags.
func (g *Gateway) assignTags(w http.ResponseWriter, r *http.Request) {
	var req assignTagsJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	alias, tag, err := parseTemplateName(req.Target)
	if err != nil {
		writeError(w, err)
		return
	}
	if len(req.Tags) == 0 {
		writeStatus(w, http.StatusBadRequest, "tags: at least one is required")
		return
	}
	for _, t := range req.Tags {
		if err := checkTag(t); err != nil {
			writeError(w, err)
			return
		}
	}
	project, err := g.whoAmI(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	src := templateImage(project, alias, cmpOr(tag, defaultTag))
	got, err := g.images.GetImage(r.Context(), connect.NewRequest(&imagev1.GetImageRequest{Name: src}))
	if err != nil {
		writeError(w, templateNotFound(err, req.Target))
		return
	}
	for _, t := range req.Tags {
		if _, err := g.images.TagImage(r.Context(), connect.NewRequest(&imagev1.TagImageRequest{Source: src, Name: templateImage(project, alias, t)})); err != nil {
			writeError(w, errdefs.FromConnect(err))
			return
		}
	}
	writeJSON(w, http.StatusCreated, assignedTagsJSON{Tags: req.Tags, BuildID: buildIDOf(got.Msg.Image.Digest)})
}

type removeTagsJSON struct {
	Name string   `json:"name"`
	Tags []string `json:"tags"`
}

// removeTags removes tags of a template: the names go, the images stay
// while another name or a sandbox uses them.
func (g *Gateway) removeTags(w http.ResponseWriter, r *http.Request) {
	var req removeTagsJSON
	if err := decode(r, &req); err != nil {
		writeError(w, err)
		return
	}
	alias, _, err := parseTemplateName(req.Name)
	if err != nil {
		writeError(w, err)
		return
	}
	if len(req.Tags) == 0 {
		writeStatus(w, http.StatusBadRequest, "tags: at least one is required")
		return
	}
	project, err := g.whoAmI(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	for _, t := range req.Tags {
		if err := checkTag(t); err != nil {
			writeError(w, err)
			return
		}
		if _, err := g.images.DeleteImage(r.Context(), connect.NewRequest(&imagev1.DeleteImageRequest{Name: templateImage(project, alias, t)})); err != nil {
			writeError(w, templateNotFound(err, alias+":"+t))
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

type templateTagJSON struct {
	Tag       string `json:"tag"`
	BuildID   string `json:"buildID"`
	CreatedAt string `json:"createdAt"`
}

// listTags lists a template's tags, oldest first.
func (g *Gateway) listTags(w http.ResponseWriter, r *http.Request, id string) {
	alias, _, err := parseTemplateName(id)
	if err != nil {
		writeStatus(w, http.StatusNotFound, "template "+strconv.Quote(id)+" not found")
		return
	}
	tags, err := g.tagsOf(r, alias)
	if err != nil {
		writeError(w, err)
		return
	}
	if len(tags) == 0 {
		writeStatus(w, http.StatusNotFound, "template "+strconv.Quote(alias)+" not found")
		return
	}
	writeJSON(w, http.StatusOK, tags)
}

func (g *Gateway) tagsOf(r *http.Request, alias string) ([]templateTagJSON, error) {
	project, err := g.whoAmI(r.Context())
	if err != nil {
		return nil, err
	}
	resp, err := g.images.ListImages(r.Context(), connect.NewRequest(&imagev1.ListImagesRequest{Project: project}))
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	prefix := templateImage(project, alias, "")
	type dated struct {
		tag templateTagJSON
		at  time.Time
	}
	var found []dated
	for _, im := range resp.Msg.Images {
		if t, ok := strings.CutPrefix(im.Name, prefix); ok {
			at := im.GetCreatedAt().AsTime()
			found = append(found, dated{templateTagJSON{Tag: t, BuildID: buildIDOf(im.Digest), CreatedAt: at.UTC().Format(time.RFC3339Nano)}, at})
		}
	}
	sort.Slice(found, func(i, j int) bool { return found[i].at.Before(found[j].at) })
	out := make([]templateTagJSON, len(found))
	for i, f := range found {
		out[i] = f.tag
	}
	return out, nil
}

// deleteTemplateImages deletes every tag of a template of the project.
func (g *Gateway) deleteTemplateImages(w http.ResponseWriter, r *http.Request, id string) {
	alias, _, err := parseTemplateName(id)
	if err != nil {
		writeStatus(w, http.StatusNotFound, "template "+strconv.Quote(id)+" not found")
		return
	}
	tags, err := g.tagsOf(r, alias)
	if err != nil {
		writeError(w, err)
		return
	}
	if len(tags) == 0 {
		writeStatus(w, http.StatusNotFound, "template "+strconv.Quote(id)+" not found")
		return
	}
	project, err := g.whoAmI(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	for _, t := range tags {
		if _, err := g.images.DeleteImage(r.Context(), connect.NewRequest(&imagev1.DeleteImageRequest{Name: templateImage(project, alias, t.Tag)})); err != nil && !errdefs.IsNotFound(errdefs.FromConnect(err)) {
			writeError(w, errdefs.FromConnect(err))
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// templateNotFound words an image's absence as E2B's missing template.
func templateNotFound(err error, name string) error {
	err = errdefs.FromConnect(err)
	if errdefs.IsNotFound(err) {
		return errdefs.NotFound("template %q not found", errdefs.Clip(name, 80))
	}
	return err
}
