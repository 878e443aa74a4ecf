package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/opendsec/opendsec/internal/apiserver"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/pki"
	ociregistry "github.com/opendsec/opendsec/internal/registry"
)

// cmdAPIServer runs an apiserver alone. Any number run side by side:
// clients list them all in DSEC_API_URL.
func cmdAPIServer(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("apiserver", flag.ExitOnError)
	id := fs.String("id", "", "this apiserver's id, unique in the cluster (names its IAM replica)")
	stateDir := fs.String("state-dir", "", "directory of its IAM replica (a cache: it is rebuilt from the voters)")
	listen := fs.String("listen", "127.0.0.1:7070", "client API address")
	edges := fs.String("edges", "", "comma-separated edge addresses (host:port)")
	iamPeers := fs.String("iam", "", "comma-separated IAM replica addresses to join through")
	iamBind := fs.String("iam-bind", "127.0.0.1:0", "address of its IAM replica's port (the leader dials it; a restart on a new port joins again)")
	iamAdvertise := fs.String("iam-advertise", "", "the address IAM replicas dial for it (default: --iam-bind's)")
	images := fs.String("image-store", "", "the shared image store directory (required)")
	watchers := fs.String("watcher", "", "comma-separated watcher daemons to read the edges' state from (default: poll the edges here)")
	rf := addRegistryFlags(fs)
	tf := addTLSFlags(fs, "this apiserver's certificate (dsec ca issue --role apiserver)")
	lf := addLogFlags(fs)
	metricsListen := addMetricsFlag(fs)
	clientTLS := fs.Bool("client-tls", false, "serve the client API over TLS with this apiserver's certificate (clients verify it with the CA: DSEC_CA_FILE); default plain HTTP")
	clientCA := fs.String("client-ca", "", "with --client-tls: require clients to present a certificate this CA (PEM) signed (mutual TLS; dsec ca issue --role client makes them)")
	fs.Parse(args)
	if *clientCA != "" && !*clientTLS {
		return fmt.Errorf("apiserver: --client-ca %s needs --client-tls (mutual TLS is TLS)", *clientCA)
	}
	if *id == "" || *stateDir == "" || *edges == "" || *iamPeers == "" || *images == "" {
		return fmt.Errorf("apiserver: --id, --state-dir, --edges, --iam and --image-store: required")
	}
	ident, err := tf.identity(pki.RoleAPIServer)
	if err != nil {
		return fmt.Errorf("apiserver: %w", err)
	}
	cfg := apiserver.ServeConfig{
		Listen: *listen, Edges: splitList(*edges), EdgeTLS: ident.ClientConfig(), IAMPeers: splitList(*iamPeers), ImageStore: *images,
		Watchers: splitList(*watchers),
		Config:   apiserver.Config{Registries: rf.config()},
		IAM: iam.Config{Dir: filepath.Join(*stateDir, "iam"), NodeID: *id, Bind: *iamBind, Advertise: *iamAdvertise,
			ServerTLS: ident.ServerConfig(pki.RoleIAM), ClientTLS: ident.ClientConfig()},
	}
	if *clientTLS {
		cfg.TLS = ident.PublicServerConfig()
		if *clientCA != "" {
			if cfg.TLS.ClientCAs, err = loadCAPool(*clientCA); err != nil {
				return fmt.Errorf("apiserver: --client-ca %w", err)
			}
			cfg.TLS.ClientAuth = tls.RequireAndVerifyClientCert
		}
	}
	log := lf.logger().With(logging.Component, "apiserver")
	reg, err := serveMetrics(ctx, *metricsListen, log)
	if err != nil {
		return err
	}
	cfg.Metrics = reg
	return apiserver.Serve(ctx, cfg, log)
}

// splitList splits a comma-separated flag, dropping empty items.
func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

type registryFlags struct{ insecure, allow, dockerConfig *string }

// addRegistryFlags adds how image pulls and pushes reach registries.
func addRegistryFlags(fs *flag.FlagSet) registryFlags {
	return registryFlags{
		insecure:     fs.String("insecure-registry", "", "comma-separated registries (host or host:port) image pulls and pushes may reach over plain HTTP; loopback ones always may, every other only over TLS"),
		allow:        fs.String("registry-allow", "", "comma-separated registries (host or host:port; docker.io for Docker Hub) pulls and pushes may name; empty: any (link-local addresses are never reached)"),
		dockerConfig: fs.String("registry-config", ociregistry.DefaultDockerConfigPath(), "docker config file with the logins (and credential helpers) used when a pull or push brings none; a missing file means none"),
	}
}

func (f registryFlags) config() apiserver.RegistryConfig {
	return apiserver.RegistryConfig{Insecure: splitList(*f.insecure), Allowed: splitList(*f.allow), DockerConfig: *f.dockerConfig}
}
