package e2b

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Signed file URLs, as envd checks them. E2B's SDKs give a sandbox's
// uploadUrl/downloadUrl a signature instead of the access token:
// "v1_" + base64(sha256("PATH:OPERATION:USER:ACCESSTOKEN[:EXPIRY]")),
// OPERATION "read" or "write", EXPIRY (unix seconds) in
// signature_expiration when the URL expires. Through E2B_SANDBOX_URL the
// URL names no sandbox (it is the gateway's own /files): the gateway then
// finds the sandbox whose access token makes the signature.

// signatureFor is the signature of a file URL for a sandbox's token.
func signatureFor(path, operation, user, token, expiry string) string {
	raw := path + ":" + operation + ":" + user + ":" + token
	if expiry != "" {
		raw += ":" + expiry
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
}

// isSigned reports whether r is a /files request carrying a signature.
func isSigned(r *http.Request) bool {
	return r.URL.Path == "/files" && r.URL.Query().Get("signature") != ""
}

// checkSignature verifies a signed /files request for sandbox id.
func (g *Gateway) checkSignature(id string, r *http.Request) error {
	if !g.signedBy(id, r) {
		return errdefs.Unauthenticated("signature: not valid for this path, operation and user")
	}
	return checkExpiry(r)
}

// signedBy says whether sandbox id's access token made r's signature.
func (g *Gateway) signedBy(id string, r *http.Request) bool {
	q := r.URL.Query()
	op := "read"
	if r.Method == http.MethodPost {
		op = "write"
	}
	want := signatureFor(q.Get("path"), op, q.Get("username"), g.accessToken(id), q.Get("signature_expiration"))
	return subtle.ConstantTimeCompare([]byte(want), []byte(q.Get("signature"))) == 1
}

// checkExpiry refuses a signature whose expiration has passed.
func checkExpiry(r *http.Request) error {
	expiry := r.URL.Query().Get("signature_expiration")
	if expiry == "" {
		return nil
	}
	at, err := strconv.ParseInt(expiry, 10, 64)
	if err != nil {
		return errdefs.Unauthenticated("signature_expiration %q: not unix seconds", errdefs.Clip(expiry, 64))
	}
	if time.Now().Unix() > at {
		// envd's words exactly: E2B's suites compare the whole message.
		return errdefs.Unauthenticated("signature is already expired")
	}
	return nil
}

// sandboxBySignature finds the running sandbox whose access token signs
// r. It hashes once per sandbox of the gateway's project (a few µs each).
func (g *Gateway) sandboxBySignature(ctx context.Context, r *http.Request) (string, error) {
	all, err := g.listAll(asUser(ctx, g.cfg.ServiceKey), nil, nil)
	if err != nil {
		return "", err
	}
	for _, sb := range all {
		if g.signedBy(sb.Id, r) {
			return sb.Id, checkExpiry(r)
		}
	}
	return "", errdefs.Unauthenticated("signature: no running sandbox's access token makes it")
}
