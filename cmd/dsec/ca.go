package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/opendsec/opendsec/internal/pki"
)

// cmdCA manages the cluster's certificate authority: init makes it, issue
// makes (or, run again, rotates) a component's certificate.
func cmdCA(args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("ca: want init or issue")
	}
	fs := flag.NewFlagSet("ca "+args[0], flag.ExitOnError)
	dir := fs.String("dir", "pki", "directory of the CA (ca.crt, ca.key) and the certificates it issues")
	switch args[0] {
	case "init":
		fs.Parse(args[1:])
		if _, err := os.Stat(filepath.Join(*dir, "ca.crt")); err == nil {
			return fmt.Errorf("ca init: %s already holds a CA; issue certificates with dsec ca issue", *dir)
		}
		ca, err := pki.LoadOrCreateCA(*dir)
		if err != nil {
			return err
		}
		fmt.Printf("cluster CA: %s (its key %s stays on this machine)\n", ca.CertFile(), filepath.Join(*dir, "ca.key"))
		return nil
	case "issue":
		role := fs.String("role", "", "role of the certificate: "+strings.Join(pki.Roles, ", "))
		var hosts stringList
		fs.Var(&hosts, "host", "DNS name or IP address the component serves on (repeatable)")
		fs.Parse(args[1:])
		if fs.NArg() != 1 {
			return fmt.Errorf("ca issue: want one NAME, e.g. dsec ca issue --role edge --host 10.0.0.5 edge-1")
		}
		if _, err := os.Stat(filepath.Join(*dir, "ca.crt")); err != nil {
			return fmt.Errorf("ca issue: no CA in %s: run dsec ca init --dir %s first", *dir, *dir)
		}
		ca, err := pki.LoadOrCreateCA(*dir)
		if err != nil {
			return err
		}
		name := fs.Arg(0)
		if _, err := ca.Renew(name, *role, hosts); err != nil {
			return fmt.Errorf("ca issue: %w", err)
		}
		crt, key := ca.PairFiles(name)
		fmt.Printf("%s (role %s): %s, key %s; trust %s\n", name, *role, crt, key, ca.CertFile())
		return nil
	}
	return fmt.Errorf("ca: unknown verb %q: want init or issue", args[0])
}

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }
