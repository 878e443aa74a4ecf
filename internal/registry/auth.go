package registry

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Credentials log in to a registry: a user name and password, or an
// identity (refresh) token as `docker login` stores for some registries.
type Credentials struct {
	Username      string `json:"username,omitempty"`
	Password      string `json:"password,omitempty"`
	IdentityToken string `json:"identity_token,omitempty"`
}

// Empty reports whether c carries nothing.
func (c Credentials) Empty() bool { return c == Credentials{} }

// DockerConfig is what a docker config file (~/.docker/config.json) says
// about registries: stored logins, and credential helpers to ask.
type DockerConfig struct {
	Auths       map[string]dockerAuth `json:"auths"`
	CredsStore  string                `json:"credsStore"`
	CredHelpers map[string]string     `json:"credHelpers"`
}

type dockerAuth struct {
	Auth          string `json:"auth"`
	Username      string `json:"username"`
	Password      string `json:"password"`
	IdentityToken string `json:"identitytoken"`
}

// maxDockerConfig bounds the file read: logins are a few hundred bytes each.
const maxDockerConfig = 1 << 20

// DefaultDockerConfigPath is where docker reads its config: $DOCKER_CONFIG/
// config.json, else ~/.docker/config.json.
func DefaultDockerConfigPath() string {
	if d := os.Getenv("DOCKER_CONFIG"); d != "" {
		return filepath.Join(d, "config.json")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return ""
	}
	return filepath.Join(home, ".docker", "config.json")
}

// LoadDockerConfig reads a docker config file. A missing file is an empty
// config (no logins), as for docker.
func LoadDockerConfig(path string) (*DockerConfig, error) {
	if path == "" {
		return &DockerConfig{}, nil
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return &DockerConfig{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("docker config %s: %w", path, err)
	}
	c, err := ParseDockerConfig(data)
	if err != nil {
		return nil, fmt.Errorf("docker config %s: %w", path, err)
	}
	return c, nil
}

// ParseDockerConfig parses a docker config file's content.
func ParseDockerConfig(data []byte) (*DockerConfig, error) {
	if len(data) > maxDockerConfig {
		return nil, errdefs.InvalidArgument("larger than %d bytes", maxDockerConfig)
	}
	var c DockerConfig
	if len(bytes.TrimSpace(data)) == 0 {
		return &c, nil
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, errdefs.InvalidArgument("not a docker config file (JSON with \"auths\"): %v", err)
	}
	for key, a := range c.Auths {
		if a.Auth == "" {
			continue
		}
		if _, _, err := decodeAuth(a.Auth); err != nil {
			return nil, errdefs.InvalidArgument("auths[%q].auth: %v", key, err)
		}
	}
	for host, helper := range c.CredHelpers {
		if !helperName(helper) {
			return nil, errdefs.InvalidArgument("credHelpers[%q]: %q is not a helper name (letters, digits, '-', '_', '.')", host, helper)
		}
	}
	if c.CredsStore != "" && !helperName(c.CredsStore) {
		return nil, errdefs.InvalidArgument("credsStore: %q is not a helper name (letters, digits, '-', '_', '.')", c.CredsStore)
	}
	return &c, nil
}

func helperName(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return false
		}
	}
	return s != "." && s != ".."
}

func decodeAuth(s string) (user, pass string, err error) {
	raw, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return "", "", errors.New("not base64")
	}
	user, pass, ok := strings.Cut(string(raw), ":")
	if !ok {
		return "", "", errors.New("not base64 of user:password")
	}
	return user, pass, nil
}

// configKey reduces an auths key ("https://index.docker.io/v1/",
// "http://host:5000", "host:5000/v2/") to its registry host.
func configKey(k string) string {
	k = strings.TrimPrefix(strings.TrimPrefix(k, "https://"), "http://")
	k, _, _ = strings.Cut(k, "/")
	if k == "index.docker.io" || k == "registry-1.docker.io" {
		return "docker.io"
	}
	return k
}

// For returns the logins the config holds for a registry host ("host:port";
// "docker.io" for Docker Hub): a credential helper's answer first, as
// docker asks them, then a stored login. Empty credentials: anonymous.
func (c *DockerConfig) For(ctx context.Context, host string) (Credentials, error) {
	if host == "index.docker.io" || host == "registry-1.docker.io" {
		host = "docker.io"
	}
	helper := c.CredHelpers[host]
	if helper == "" {
		helper = c.CredsStore
	}
	if helper != "" {
		cr, err := askHelper(ctx, helper, host)
		if err != nil || !cr.Empty() {
			return cr, err
		}
	}
	for k, a := range c.Auths {
		if configKey(k) != host {
			continue
		}
		cr := Credentials{Username: a.Username, Password: a.Password, IdentityToken: a.IdentityToken}
		if a.Auth != "" {
			cr.Username, cr.Password, _ = decodeAuth(a.Auth) // checked when parsed
		}
		return cr, nil
	}
	return Credentials{}, nil
}

// askHelper runs docker-credential-HELPER get, as docker does: the server
// URL on stdin, {"Username","Secret"} on stdout; "<token>" as the user name
// means the secret is an identity token.
func askHelper(ctx context.Context, helper, host string) (Credentials, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	server := host
	if host == "docker.io" {
		server = "https://index.docker.io/v1/"
	}
	cmd := exec.CommandContext(ctx, "docker-credential-"+helper, "get")
	cmd.Stdin = strings.NewReader(server)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(string(out) + stderr.String())
		if strings.Contains(msg, "credentials not found") {
			return Credentials{}, nil
		}
		return Credentials{}, fmt.Errorf("credential helper docker-credential-%s for %s: %v: %s", helper, host, err, errdefs.Clip(msg, 200))
	}
	var ans struct{ Username, Secret string }
	if err := json.Unmarshal(out, &ans); err != nil {
		return Credentials{}, fmt.Errorf("credential helper docker-credential-%s for %s: answer is not JSON: %v", helper, host, err)
	}
	if ans.Username == "<token>" {
		return Credentials{IdentityToken: ans.Secret}, nil
	}
	return Credentials{Username: ans.Username, Password: ans.Secret}, nil
}
