package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/pki"
)

const iamUsage = `usage:
  dsec iam --id ID --dir DIR --bind HOST:PORT (--bootstrap | --join HOST:PORT,...) TLS flags
      run an IAM replica
  dsec iam status --peer HOST:PORT TLS flags     the leader, term and indexes a replica sees
  dsec iam join --peer HOST:PORT --id ID --addr HOST:PORT [--nonvoter] TLS flags
  dsec iam remove --peer HOST:PORT --id ID TLS flags
TLS flags: --ca FILE --cert FILE --key FILE (from dsec ca issue --role iam)`

// cmdIAM runs an IAM replica or asks one about its cluster.
func cmdIAM(ctx context.Context, args []string) error {
	verb := ""
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		verb, args = args[0], args[1:]
	}
	fs := flag.NewFlagSet("iam "+verb, flag.ExitOnError)
	fs.Usage = func() { fmt.Fprintln(os.Stderr, iamUsage); fs.PrintDefaults() }
	tf := addTLSFlags(fs, "this replica's (or the asker's) certificate")
	switch verb {
	case "":
		return serveIAM(ctx, fs, args, tf)
	case "status", "join", "remove":
	default:
		return fmt.Errorf("iam: unknown verb %q\n%s", verb, iamUsage)
	}
	peer := fs.String("peer", "", "a replica's address (host:port)")
	id := fs.String("id", "", "replica id (join, remove)")
	addr := fs.String("addr", "", "the joining replica's address (join)")
	nonvoter := fs.Bool("nonvoter", false, "join as a non-voting replica (join)")
	asJSON := fs.Bool("json", false, "print the status as JSON (status)")
	fs.Parse(args)
	if *peer == "" {
		return fmt.Errorf("iam %s: --peer: required (a replica's host:port)", verb)
	}
	ident, err := tf.identity("")
	if err != nil {
		return fmt.Errorf("iam %s: %w", verb, err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	switch verb {
	case "join":
		if *id == "" || *addr == "" {
			return fmt.Errorf("iam join: --id and --addr: required")
		}
		return iam.RemoteJoin(ctx, *peer, ident.ClientConfig(), iam.Member{ID: *id, Addr: *addr, Voter: !*nonvoter})
	case "remove":
		if *id == "" {
			return fmt.Errorf("iam remove: --id: required")
		}
		return iam.RemoteRemove(ctx, *peer, ident.ClientConfig(), *id)
	}
	st, err := iam.RemoteStatus(ctx, *peer, ident.ClientConfig())
	if err != nil {
		return err
	}
	if *asJSON {
		return json.NewEncoder(os.Stdout).Encode(st)
	}
	fmt.Printf("replica %s (version %s): %s, term %d, last log index %d, commit index %d, applied index %d, last snapshot index %d\n",
		st.ID, st.Version, st.State, st.Term, st.LastLogIndex, st.CommitIndex, st.AppliedIndex, st.LastSnapshotIndex)
	fmt.Printf("leader: %s (%s)\n", st.LeaderID, st.LeaderAddr)
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tADDRESS\tVOTER")
	for _, m := range st.Members {
		fmt.Fprintf(tw, "%s\t%s\t%v\n", m.ID, m.Addr, m.Voter)
	}
	return tw.Flush()
}

func serveIAM(ctx context.Context, fs *flag.FlagSet, args []string, tf *tlsFlags) error {
	id := fs.String("id", "", "this replica's id, unique in the cluster")
	dir := fs.String("dir", "", "state directory (Raft log, snapshots)")
	bind := fs.String("bind", "127.0.0.1:7400", "address to listen on for Raft and replica requests")
	advertise := fs.String("advertise", "", "address the other replicas reach this one at (default: --bind)")
	bootstrap := fs.Bool("bootstrap", false, "start a new cluster with this replica (first start only)")
	join := fs.String("join", "", "comma-separated addresses of replicas of an existing cluster to join")
	adminKey := fs.String("admin-key-file", "", "with --bootstrap: where to write the root project's first admin key")
	lf := addLogFlags(fs)
	metricsListen := addMetricsFlag(fs)
	fs.Parse(args)
	if *id == "" || *dir == "" {
		return fmt.Errorf("iam: --id and --dir: required\n%s", iamUsage)
	}
	ident, err := tf.identity(pki.RoleIAM)
	if err != nil {
		return fmt.Errorf("iam: %w", err)
	}
	cfg := iam.ServeConfig{Config: iam.Config{
		Dir: *dir, NodeID: *id, Bind: *bind, Advertise: *advertise, Bootstrap: *bootstrap,
		// Apiservers hold non-voting replicas: they join, and send writes.
		ServerTLS: ident.ServerConfig(pki.RoleIAM, pki.RoleAPIServer), ClientTLS: ident.ClientConfig(),
	}, Join: splitList(*join), AdminKeyFile: *adminKey}
	log := lf.logger()
	reg, err := serveMetrics(ctx, *metricsListen, log)
	if err != nil {
		return err
	}
	cfg.Metrics = reg
	return iam.Serve(ctx, cfg, log)
}
