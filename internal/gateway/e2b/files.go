package e2b

import (
	"compress/gzip"
	"context"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"strconv"
	"strings"
	"unicode/utf8"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/filemeta"
)

// fileChunk is how much of a file one agent call moves. Files of any size
// stream through the gateway in pieces of this size.
const fileChunk = 4 << 20

// writeInfo is one entry of the /files upload answer.
type writeInfo struct {
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Path     string            `json:"path"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// metadataHeader starts the upload headers whose rest names a metadata key
// of every uploaded file (X-Metadata-Author: mish), as envd takes them.
const metadataHeader = "X-Metadata-"

// uploadMetadata is the metadata an upload's headers give its files, keys
// lowercased, as envd stores them (internal/filemeta).
func uploadMetadata(h http.Header) (map[string]string, error) {
	var out map[string]string
	for name, values := range h {
		key, ok := strings.CutPrefix(http.CanonicalHeaderKey(name), metadataHeader)
		if !ok || len(values) == 0 {
			continue
		}
		if len(values) > 1 {
			return nil, errors.New("header " + name + " is given more than once")
		}
		if out == nil {
			out = map[string]string{}
		}
		out[strings.ToLower(key)] = values[0]
	}
	return out, filemeta.Validate(out)
}

// download serves GET /files?path=…: the file's bytes, read from the
// sandbox in chunks.
func (g *Gateway) download(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	p := r.URL.Query().Get("path")
	if p == "" {
		writeStatus(w, http.StatusBadRequest, "path: required (the file to download)")
		return
	}
	p = resolve(callOf(ctx).user, p)
	var off int64
	for {
		resp, err := g.files.ReadFile(ctx, connect.NewRequest(&agentv1.ReadFileRequest{Path: p, Offset: off, Limit: fileChunk, User: callOf(ctx).user}))
		if err != nil {
			if off == 0 {
				g.writeFileError(w, r, err)
				return
			}
			// Headers are out: the client sees a short body.
			g.log.Warn("download cut short", "path", p, "offset", off, "err", err)
			return
		}
		if off == 0 {
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Header().Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": path.Base(p)}))
			if resp.Msg.Eof {
				w.Header().Set("Content-Length", strconv.Itoa(len(resp.Msg.Data)))
			}
			w.WriteHeader(http.StatusOK)
		}
		if _, err := w.Write(resp.Msg.Data); err != nil {
			return
		}
		off += int64(len(resp.Msg.Data))
		if resp.Msg.Eof || len(resp.Msg.Data) == 0 {
			return
		}
	}
}

// upload serves POST /files: one file as application/octet-stream (the
// path in the query, gzip allowed) or files as multipart/form-data parts
// named "file" (each part's filename is its path, unless the query names
// the one file). A file appears whole or not at all: it is written next
// to its destination under a temporary name and renamed into place.
func (g *Gateway) upload(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	user := callOf(ctx).user
	metadata, err := uploadMetadata(r.Header)
	if err != nil {
		writeStatus(w, http.StatusBadRequest, "invalid metadata: "+err.Error())
		return
	}
	queryPath := r.URL.Query().Get("path")
	ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var out []writeInfo
	switch ct {
	case "application/octet-stream":
		if queryPath == "" {
			writeStatus(w, http.StatusBadRequest, "path: required for an application/octet-stream upload")
			return
		}
		body := io.Reader(r.Body)
		switch enc := r.Header.Get("Content-Encoding"); enc {
		case "", "identity":
		case "gzip":
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				writeStatus(w, http.StatusBadRequest, "body: Content-Encoding gzip but not gzip data: "+err.Error())
				return
			}
			defer zr.Close()
			body = zr
		default:
			writeStatus(w, http.StatusBadRequest, "Content-Encoding "+enc+": only gzip is supported")
			return
		}
		info, err := g.writeFile(ctx, user, resolve(user, queryPath), body, metadata)
		if err != nil {
			g.writeFileError(w, r, err)
			return
		}
		out = append(out, info)
	case "multipart/form-data":
		mr, err := r.MultipartReader()
		if err != nil {
			writeStatus(w, http.StatusBadRequest, "body: "+err.Error())
			return
		}
		for {
			part, err := mr.NextPart()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				writeStatus(w, http.StatusBadRequest, "body: bad multipart data: "+err.Error())
				return
			}
			if part.FormName() != "file" {
				part.Close()
				continue
			}
			target := rawFileName(part)
			if queryPath != "" {
				if len(out) > 0 {
					writeStatus(w, http.StatusBadRequest, "path: names one file but the body has several; name each part's path in its filename instead")
					return
				}
				target = queryPath
			}
			if !utf8.ValidString(target) {
				writeStatus(w, http.StatusBadRequest, "file: the part's filename is not UTF-8")
				return
			}
			if target == "" {
				writeStatus(w, http.StatusBadRequest, "file: a part without a filename and no path in the query")
				return
			}
			info, err := g.writeFile(ctx, user, resolve(user, target), part, metadata)
			part.Close()
			if err != nil {
				g.writeFileError(w, r, err)
				return
			}
			out = append(out, info)
		}
		if len(out) == 0 {
			writeStatus(w, http.StatusBadRequest, "body: no part named \"file\"")
			return
		}
	default:
		writeStatus(w, http.StatusBadRequest, "Content-Type "+strconv.Quote(ct)+": use multipart/form-data or application/octet-stream")
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// rawFileName is a part's filename as sent: E2B's SDKs put the whole path
// there, which Part.FileName would cut to its last element.
func rawFileName(part *multipart.Part) string {
	_, params, err := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
	if err != nil {
		return ""
	}
	return params["filename"]
}

// writeFile streams body into the sandbox file p, owned by user, as envd
// does: the file is created or truncated in place and written chunk by
// chunk, so a directory watcher sees the create and writes on p itself.
// Its metadata becomes metadata, none included: an upload replaces it.
func (g *Gateway) writeFile(ctx context.Context, user, p string, body io.Reader, metadata map[string]string) (writeInfo, error) {
	if p == "/" {
		return writeInfo{}, errdefs.InvalidArgument("path: / is a directory")
	}
	buf := make([]byte, fileChunk)
	mode := agentv1.WriteMode_WRITE_MODE_UNSPECIFIED // the first write creates or truncates
	var stored map[string]string
	for {
		n, rerr := io.ReadFull(body, buf)
		last := errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF)
		if rerr != nil && !last {
			return writeInfo{}, errdefs.InvalidArgument("body: reading the upload: %v", rerr)
		}
		if n > 0 || mode == agentv1.WriteMode_WRITE_MODE_UNSPECIFIED {
			first := mode == agentv1.WriteMode_WRITE_MODE_UNSPECIFIED
			resp, err := g.files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{
				Path: p, Data: buf[:n], Mode: mode, User: user, Metadata: metadata, ReplaceMetadata: first,
			}))
			if err != nil {
				return writeInfo{}, err
			}
			stored = resp.Msg.Entry.GetMetadata()
			mode, metadata = agentv1.WriteMode_WRITE_MODE_APPEND, nil
		}
		if last {
			// What the file holds, as envd reads it back.
			return writeInfo{Name: path.Base(p), Type: "file", Path: p, Metadata: stored}, nil
		}
	}
}

// writeFileError answers a /files error: 502 for a sandbox that is gone,
// as E2B's proxy does, and 400 for a directory where a file belongs, as
// envd does.
func (g *Gateway) writeFileError(w http.ResponseWriter, r *http.Request, err error) {
	err = g.explain(r.Context(), err)
	if errdefs.Code(err) == connect.CodeUnavailable {
		writeStatus(w, http.StatusBadGateway, messageOf(err))
		return
	}
	if errdefs.Code(err) == connect.CodeFailedPrecondition {
		writeStatus(w, http.StatusBadRequest, messageOf(err))
		return
	}
	writeError(w, err)
}
