package main

import (
	"flag"
	"fmt"
	"log/slog"

	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/pki"
)

// tlsFlags are a component's certificate flags (from dsec ca issue).
type tlsFlags struct{ ca, cert, key *string }

func addTLSFlags(fs *flag.FlagSet, certHelp string) *tlsFlags {
	return &tlsFlags{
		ca:   fs.String("ca", "", "CA bundle"),
		cert: fs.String("cert", "", certHelp),
		key:  fs.String("key", "", "its key"),
	}
}

// identity loads the certificate and, when role is not "", checks that it
// carries that role.
func (f *tlsFlags) identity(role string) (*pki.Identity, error) {
	if *f.ca == "" || *f.cert == "" || *f.key == "" {
		return nil, fmt.Errorf("--ca, --cert and --key: required (make them with dsec ca init and dsec ca issue)")
	}
	id, err := pki.LoadIdentity(*f.ca, *f.cert, *f.key)
	if err != nil {
		return nil, err
	}
	if got := id.Role(); role != "" && got != role {
		return nil, fmt.Errorf("--cert has role %q; this needs one issued with --role %s", got, role)
	}
	return id, nil
}

// logFlags are the logging flags every long-running command takes.
type logFlags struct {
	format *string
	level  slog.Level
}

func addLogFlags(fs *flag.FlagSet) *logFlags {
	f := &logFlags{format: fs.String("log-format", "text", "text or json")}
	fs.TextVar(&f.level, "log-level", slog.LevelInfo, "debug, info, warn or error")
	return f
}

func (f *logFlags) logger() *slog.Logger { return logging.New(*f.format, f.level) }

// poolFlag is the repeatable --pool flag: warm pools (edge.ParsePool).
type poolFlag []edge.Pool

func (f *poolFlag) String() string { return fmt.Sprint(len(*f), " pools") }
func (f *poolFlag) Set(v string) error {
	p, err := edge.ParsePool(v)
	if err != nil {
		return err
	}
	*f = append(*f, p)
	return nil
}

const poolHelp = "a warm pool, repeatable: IMAGE=SIZE[,backend=B][,cpu=CORES][,memory=MIB][,disk=MIB][,project=P] keeps SIZE sandboxes of that image and shape started (backend container, project root); a create of that image and shape without a network claims one instead of starting one"
